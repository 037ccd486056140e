"""A pids- and memory-limited cgroup per sandbox execution, on cgroup v1 or v2.

Why: a process limit set with RLIMIT_NPROC counts every process of the user, and does not
apply to root at all. A cgroup bounds the sandbox's whole process tree (fork bomb) and its
total memory (many processes each under RLIMIT_AS, files in its tmpfs) whoever runs it, and
lets the host kill every process in it at once.

One cgroup per execution, not per slot: a process that made a pid namespace stays charged
to ``pids.current`` for a moment after it is gone (seen here: about a second), so a
long-lived cgroup at a busy slot would fill up with these and refuse to fork.

Where the cgroups live:
- v2 (one ``cgroup2`` mount that has the ``pids`` and ``memory`` controllers): a child of the
  cgroup this process is in, which must be delegated to us (its ``cgroup.subtree_control``
  writable and able to enable both controllers; under systemd, ``systemd-run --scope -p
  Delegate=yes``). Because of v2's "no processes in inner cgroups" rule, a cgroup that still
  holds this process itself cannot enable them, and v2 is then reported as unusable.
- v1 (separate ``pids`` and ``memory`` hierarchies, the case on these CI machines): one
  child per controller under the cgroup this process is in.

``open_slot_cgroup`` returns None with a reason when neither works (not root, read-only
cgroupfs, no controllers); the caller decides whether that is fatal.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

# bwrap, its pid-1 helper and the interpreter itself come on top of the program's processes.
OVERHEAD_PROCS = 4
# Page cache and kernel structures of the sandbox itself, on top of the program's memory.
OVERHEAD_BYTES = 64 << 20
# CPU bandwidth of one execution, where the cpu controller is there: one core. RLIMIT_CPU is
# per process, so without this a program forking max_procs busy children would take every
# core for the whole wall-clock limit and starve the other slots and the trainer.
CPU_PERIOD_US = 100_000
CPU_QUOTA_US = 100_000


@dataclass(frozen=True)
class Mount:
    path: Path
    kind: str  # "cgroup" (v1) or "cgroup2"
    controllers: frozenset[str]


def read_mounts(mounts_text: str) -> list[Mount]:
    """The cgroup mounts listed in a /proc/self/mounts text."""
    found = []
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[2] not in ("cgroup", "cgroup2"):
            continue
        controllers = frozenset(parts[3].split(",")) if parts[2] == "cgroup" else frozenset()
        found.append(Mount(Path(parts[1]), parts[2], controllers))
    return found


def read_own_cgroups(cgroup_text: str) -> dict[str, str]:
    """Controller -> path of this process's cgroup, from /proc/self/cgroup; "" keys v2."""
    own = {}
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            own[""] = path
        for controller in controllers.split(","):
            if controller:
                own[controller] = path
    return own


@dataclass
class SlotCgroup:
    """The cgroup directories of one slot (one per v1 controller, or one v2 directory)."""

    version: int
    dirs: list[Path]

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        found = set()
        for procs in self.procs_files:
            try:
                found.update(int(p) for p in procs.read_text().split())
            except OSError:
                pass
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for going over the memory limit."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                try:
                    for line in (d / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
                except (OSError, ValueError):
                    continue
        return 0

    def kill_all(self, rounds: int = 50) -> bool:
        """SIGKILL everything in the slot; True once it is empty.

        v2 has ``cgroup.kill``. On v1 a fork bomb can fork between reading the list and the
        kills, so read and kill again until nothing is left (RLIMIT_NPROC and pids.max keep
        each round short).
        """
        if self.version == 2:
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for _ in range(rounds):
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        return not self.pids()

    def remove(self) -> bool:
        """Kill what is left and remove the directories; False if one is still busy (try later)."""
        self.kill_all()
        left = []
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
        self.dirs = left
        return not left


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _make_v1(
    mounts: list[Mount], own: dict[str, str], name: str, max_procs: int, memory_bytes: int
) -> tuple[SlotCgroup | None, str]:
    dirs = []
    try:
        for controller in ("pids", "memory", "cpu"):
            mount = next((m for m in mounts if m.kind == "cgroup" and controller in m.controllers), None)
            if mount is None:
                if controller == "cpu":  # optional: a bound on CPU share, not on safety
                    continue
                raise OSError(f"no cgroup v1 mount has the {controller} controller")
            d = mount.path / own.get(controller, "/").lstrip("/") / name
            d.mkdir(exist_ok=True)
            dirs.append(d)
            if controller == "pids":
                _write(d / "pids.max", str(max_procs + OVERHEAD_PROCS))
            elif controller == "cpu":
                _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", str(CPU_QUOTA_US))
            else:
                _write(d / "memory.limit_in_bytes", str(memory_bytes + OVERHEAD_BYTES))
                swap = d / "memory.memsw.limit_in_bytes"
                if swap.exists():  # only with swap accounting; otherwise swap is not an escape
                    _write(swap, str(memory_bytes + OVERHEAD_BYTES))
    except OSError as exc:
        SlotCgroup(1, dirs).remove()
        return None, f"cgroup v1: {exc}"
    return SlotCgroup(1, dirs), ""


def _make_v2(
    mount: Mount, own: dict[str, str], name: str, max_procs: int, memory_bytes: int
) -> tuple[SlotCgroup | None, str]:
    parent = mount.path / own.get("", "/").lstrip("/")
    d = parent / name
    try:
        available = set((parent / "cgroup.controllers").read_text().split())
        missing = {"pids", "memory"} - available
        if missing:
            return None, f"cgroup v2 at {parent}: controllers {sorted(missing)} are not delegated"
        wanted = {"pids", "memory"} | ({"cpu"} & available)
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if not wanted <= enabled:
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted - enabled)))
        d.mkdir(exist_ok=True)
        _write(d / "pids.max", str(max_procs + OVERHEAD_PROCS))
        _write(d / "memory.max", str(memory_bytes + OVERHEAD_BYTES))
        if "cpu" in wanted:
            _write(d / "cpu.max", f"{CPU_QUOTA_US} {CPU_PERIOD_US}")
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
    except OSError as exc:
        SlotCgroup(2, [d] if d.exists() else []).remove()
        return None, f"cgroup v2 at {parent}: {exc}"
    return SlotCgroup(2, [d]), ""


def open_slot_cgroup(
    name: str, *, max_procs: int, memory_bytes: int, mounts_text: str | None = None, cgroup_text: str | None = None
) -> tuple[SlotCgroup | None, str]:
    """Create the cgroup(s) for one slot; ``(cgroup, "")`` or ``(None, why not)``.

    v2 is tried first where it has both controllers, then v1. The texts default to this
    process's /proc/self/mounts and /proc/self/cgroup (tests pass their own).
    """
    if mounts_text is None:
        mounts_text = Path("/proc/self/mounts").read_text()
    if cgroup_text is None:
        cgroup_text = Path("/proc/self/cgroup").read_text()
    mounts, own = read_mounts(mounts_text), read_own_cgroups(cgroup_text)
    reasons = []
    for mount in (m for m in mounts if m.kind == "cgroup2"):
        try:
            has = {"pids", "memory"} <= set((mount.path / "cgroup.controllers").read_text().split())
        except OSError:
            has = False
        if has:
            slot, why = _make_v2(mount, own, name, max_procs, memory_bytes)
            if slot is not None:
                return slot, ""
            reasons.append(why)
    if any(m.kind == "cgroup" for m in mounts):
        slot, why = _make_v1(mounts, own, name, max_procs, memory_bytes)
        if slot is not None:
            return slot, ""
        reasons.append(why)
    if not mounts:
        reasons.append("no cgroup filesystem is mounted")
    return None, "; ".join(reasons) or "no cgroup hierarchy has the pids and memory controllers"
