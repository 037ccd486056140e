"""Run untrusted Python programs in bubblewrap, a bounded number at a time.

Every execution is one fresh sandbox:

- bubblewrap with new network, pid, ipc, uts and cgroup namespaces: no network at all (not
  even the host's loopback), no view of host processes, dies with its parent;
- a root filesystem holding only read-only system directories (``/usr`` and the ``/lib*``,
  ``/bin`` links), the interpreter's own prefix, the slot's program directory (read-only) and
  a private, size-capped ``/tmp``; no ``/home``, ``/root`` or ``/etc``;
- resource limits set before the program starts (CPU seconds, address space, processes,
  file size, open files; ``harness.py``);
- not root's powers. Run by root, bwrap does its mounts as root and then ``setpriv``
  switches to a per-slot unprivileged uid with no capabilities and ``no_new_privs``, so
  RLIMIT_NPROC applies (it never does to root). Each pool claims its own range of uids
  (``uids.py``), so no two pools on one machine share a uid, nor its process count. Run by
  another user, bwrap puts the program in a new user namespace, where the process count is
  that namespace's own;
- where cgroups are writable, a per-slot cgroup with ``pids.max`` and a memory limit;
- the host reads at most ``max_output_bytes`` of stdout and stderr, kills the whole process
  group at the time limit or the output cap, and empties the slot's cgroup afterwards.

The pool has ``workers`` slots (default: one per CPU core); ``run`` blocks until a slot is
free, so any number of threads may call it without oversubscribing the machine.
"""

from __future__ import annotations

import itertools
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarmrl.config import SandboxConfig
from swarmrl.errors import SwarmrlError
from swarmrl.sandbox.cgroups import SlotCgroup, open_slot_cgroup
from swarmrl.sandbox.uids import UidRange, UidsUnavailable

# Defaults come from the config (swarmrl/config/task.py, SandboxConfig): one source of truth.
_SB = SandboxConfig()

HARNESS = Path(__file__).with_name("harness.py")

# Exit code of the wrapper shell when it cannot join the slot's cgroup.
_EXIT_NO_CGROUP = 97
# Joins the cgroups named on the command line, then becomes bwrap (same pid, same group).
_JOIN_CGROUPS = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 97; shift; n=$((n-1)); done; exec "$@"'

FIX_IT = (
    "Fix: install bubblewrap (`apt-get install bubblewrap` on Debian or Ubuntu, `dnf install "
    "bubblewrap` on Fedora). If it is installed and still fails as a normal user, unprivileged "
    "user namespaces are switched off (`sysctl -w kernel.unprivileged_userns_clone=1`, or "
    "`kernel.apparmor_restrict_unprivileged_userns=0` on Ubuntu 24.04), or run as root; in a "
    "container, start it with `--security-opt seccomp=unconfined --security-opt "
    "apparmor=unconfined` or `--privileged`. Only for code you trust: `--sandbox.unsafe_no_sandbox "
    "true` runs programs with no sandbox at all."
)


class SandboxUnavailable(SwarmrlError, RuntimeError):
    """Bubblewrap cannot run here; the message says why and how to fix it."""


class SandboxFailure(RuntimeError):
    """One execution could not be started (no cgroup, no process): the host's problem, not the
    program's, so the row is reported as an error rather than scored 0."""


@dataclass(frozen=True)
class SandboxSettings:
    """What one sandboxed execution may use. See ``SandboxConfig`` for each field's meaning."""

    workers: int = 2  # the config's None means "one per CPU"; a bare SandboxSettings takes 2
    memory_bytes: int = _SB.memory_mb << 20
    max_procs: int = _SB.max_procs
    max_file_bytes: int = _SB.max_file_mb << 20
    max_open_files: int = _SB.max_open_files
    max_output_bytes: int = _SB.max_output_kb << 10
    tmp_bytes: int = _SB.tmp_mb << 20
    startup_grace_s: float = _SB.startup_grace_s
    uid_base: int = _SB.uid_base  # where a pool starts looking for free uids (uids.py)
    uid_lock_dir: str | None = None  # where pools claim uids; None: uids.DEFAULT_LOCK_DIR
    cgroups: str = _SB.cgroups  # "auto" | "required" | "off"
    bwrap: str = _SB.bwrap
    python: str | None = _SB.python
    unsafe_no_sandbox: bool = _SB.unsafe_no_sandbox


@dataclass(frozen=True)
class ExecResult:
    """What one execution did. ``status``: "ok" (exit 0), "exit" (non-zero exit code),
    "signal" (killed by a signal, e.g. SIGXCPU at the CPU limit; ``exit_code`` is minus the
    signal), "memory_limit" (the kernel killed a process over the cgroup's memory), "timeout"
    (the host killed it at the wall-clock limit), "output_limit" (the host killed it for
    writing more than the cap), "sandbox_error" (the sandbox itself failed to start)."""

    status: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float

    def last_error_line(self) -> str:
        """The last non-empty stderr line (the exception, for a Python traceback), shortened."""
        lines = [line for line in self.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1].strip()[:200] if lines else ""


def sandbox_python(configured: str | None) -> str:
    """The interpreter run inside the sandbox: the configured one, or this Python's base
    interpreter (its standard library only: the program runs with ``-I -S``)."""
    if configured:
        return configured
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base if base.exists() else Path(sys.executable).resolve())


def _python_prefix(python: str) -> Path:
    """The directory to bind for the interpreter: its prefix (bound read-only unless under /usr).

    Refuses a prefix that would expose much of the host: ``/`` (an interpreter in ``/bin`` on a
    system without merged /usr) or a top-level directory such as ``/home`` or ``/work``, where
    datasets with the expected outputs may live.
    """
    prefix = Path(python).resolve().parent.parent
    if len(prefix.parts) < 3 and prefix != Path("/usr"):
        raise SandboxUnavailable(
            f"the sandbox's interpreter {python} lives under {prefix}, and binding that into the "
            "sandbox would expose too much of the host; set sandbox.python to an interpreter in "
            "/usr/bin or in its own prefix (e.g. /opt/python3.11/bin/python3)"
        )
    return prefix


def _limits_arg(limits: dict) -> str:
    """The harness's LIMITS argument: ``name=value,...`` for the limits that are set."""
    return ",".join(f"{name}={int(value)}" for name, value in limits.items() if value is not None)


def _system_binds() -> list[str]:
    """Read-only /usr, and /lib, /lib64, /bin, /sbin as the links or directories they are."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):
        path = Path(name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            args += ["--ro-bind", name, name]
    return args


class Sandbox:
    """A bounded pool of sandbox slots. Create once, call ``run`` from any thread, ``close``.

    Creating it runs one trivial program through the whole path; if that fails it raises
    :class:`SandboxUnavailable` naming the cause and the fix.
    """

    def __init__(self, settings: SandboxSettings = SandboxSettings(), *, log=None):
        self.settings = settings
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.is_root = os.geteuid() == 0
        self.python = sandbox_python(settings.python)
        self._root = Path(tempfile.mkdtemp(prefix="swarmrl-sandbox-"))
        self._root.chmod(0o755)
        self._free: queue.Queue[int] = queue.Queue()
        self._use_cgroups = False
        self._stale_cgroups: list[SlotCgroup] = []
        self._stale_lock = threading.Lock()
        self._runs = itertools.count()
        self._closed = False
        self.cgroup_note = "off"
        self._uids: UidRange | None = None
        try:
            if settings.unsafe_no_sandbox:
                self._log(
                    "WARNING: sandbox.unsafe_no_sandbox is set: untrusted programs run WITHOUT a "
                    "sandbox, as this user, with network and file access. Use it only for code you "
                    "trust."
                )
            else:
                self._check_bwrap()
                self._prefix = _python_prefix(self.python)
                if self.is_root:
                    try:
                        self._uids = UidRange(settings.uid_base, settings.workers, settings.uid_lock_dir)
                    except UidsUnavailable as exc:
                        raise SandboxUnavailable(str(exc)) from None
            for slot in range(settings.workers):
                self._open_slot(slot)
            self._check_cgroups()
            self._probe()
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------------------

    def _check_bwrap(self) -> None:
        if shutil.which(self.settings.bwrap) is None:
            raise SandboxUnavailable(
                f"code tasks run untrusted programs in bubblewrap, and `{self.settings.bwrap}` is not on PATH. {FIX_IT}"
            )

    def _open_slot(self, slot: int) -> None:
        box = self._root / f"slot{slot}"
        box.mkdir(mode=0o755)
        box.chmod(0o755)
        shutil.copyfile(HARNESS, box / "harness.py")
        (box / "harness.py").chmod(0o644)
        self._free.put(slot)

    def _check_cgroups(self) -> None:
        """Decide whether executions get a cgroup, by making (and removing) one now."""
        if self.settings.cgroups == "off" or self.settings.unsafe_no_sandbox:
            return
        cgroup, why = self._new_cgroup()
        if cgroup is None:
            if self.settings.cgroups == "required":
                raise SandboxUnavailable(
                    f"sandbox.cgroups is 'required' but no pids+memory cgroup could be made: {why}. "
                    "Run as root, delegate a cgroup v2 subtree to this user, or set "
                    "sandbox.cgroups = 'auto'."
                )
            self.cgroup_note = f"none ({why})"
            return
        cgroup.remove()
        self._use_cgroups = True
        self.cgroup_note = f"v{cgroup.version}"

    def _new_cgroup(self) -> tuple[SlotCgroup | None, str]:
        return open_slot_cgroup(
            f"swarmrl-{os.getpid()}-{id(self):x}-{next(self._runs)}",
            max_procs=self.settings.max_procs,
            memory_bytes=self.settings.memory_bytes + self.settings.tmp_bytes,
        )

    def _probe(self) -> None:
        result = self.run("print(6 * 7)\n", mode="stdio", stdin=b"", timeout_s=10.0)
        if result.status != "ok" or result.stdout.strip() != b"42":
            detail = result.last_error_line() or f"status {result.status}, exit code {result.exit_code}"
            raise SandboxUnavailable(
                f"code tasks run untrusted programs in bubblewrap, and a trivial program failed "
                f"in it: {detail}. {FIX_IT}"
            )

    def describe(self) -> str:
        """One line for logs: how programs are isolated here."""
        if self.settings.unsafe_no_sandbox:
            return "NO SANDBOX (sandbox.unsafe_no_sandbox)"
        uids = self._uids.uids if self._uids is not None else []
        user = f"uids {uids[0]}-{uids[-1]}" if uids else "a user namespace"
        return f"bubblewrap, {self.settings.workers} slots, as {user}, cgroups {self.cgroup_note}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for cgroup in self._stale_cgroups:
            for _ in range(100):
                if cgroup.remove():
                    break
                time.sleep(0.02)
        shutil.rmtree(self._root, ignore_errors=True)
        if self._uids is not None:
            self._uids.release()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- one execution -------------------------------------------------------------------------

    @property
    def uids(self) -> list[int]:
        """The host uids this pool's slots run as (claimed for this pool alone); [] when they run as this user."""
        return list(self._uids.uids) if self._uids is not None else []

    def slot_uid(self, slot: int) -> int | None:
        """The host uid a slot's programs run as, or None when they run as this user."""
        return self._uids.uids[slot] if self._uids is not None else None

    def _command(self, slot: int, mode: str, limits: dict, cgroup: SlotCgroup | None) -> list[str]:
        box = self._root / f"slot{slot}"
        inner = [self.python, "-I", "-S", "-B", "-X", "utf8"]
        if self.settings.unsafe_no_sandbox:
            return inner + [str(box / "harness.py"), mode, _limits_arg(limits)]
        inner += ["/box/harness.py", mode, _limits_arg(limits)]
        prefix = self._prefix
        args = [
            self.settings.bwrap,
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            *_system_binds(),
        ]
        if not str(prefix).startswith("/usr/") and str(prefix) != "/usr":
            args += ["--ro-bind", str(prefix), str(prefix)]
        args += [
            "--ro-bind",
            str(box),
            "/box",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--size",
            str(self.settings.tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--chdir",
            "/tmp",
            "--clearenv",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "LANG",
            "C.UTF-8",
        ]
        uid = self.slot_uid(slot)
        if uid is not None:
            # Root: mounts are made as root, then the program drops to an unprivileged uid
            # with no capabilities left (bounding set included) and no way to gain them back.
            args += [
                "--cap-add",
                "CAP_SETUID",
                "--cap-add",
                "CAP_SETGID",
                "--cap-add",
                "CAP_SETPCAP",
                "/usr/bin/setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                "--",
            ]
        else:
            args[1:1] = ["--unshare-user", "--disable-userns"]
        args += inner
        if cgroup is not None:
            files = [str(p) for p in cgroup.procs_files]
            args = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", str(len(files)), *files, *args]
        return args

    def run(self, program: str, *, mode: str, stdin: bytes, timeout_s: float) -> ExecResult:
        """Run ``program`` once (``mode`` "stdio", "call" or "assert"; see harness.py) in a free slot."""
        if self._closed:
            raise RuntimeError("this Sandbox is closed; create a new one")
        slot = self._free.get()
        try:
            return self._run_in_slot(slot, program, mode, stdin, timeout_s)
        finally:
            self._free.put(slot)

    def _run_in_slot(self, slot: int, program: str, mode: str, stdin: bytes, timeout_s: float) -> ExecResult:
        settings = self.settings
        box = self._root / f"slot{slot}"
        prog = box / "prog.py"
        prog.write_text(program, encoding="utf-8", errors="surrogatepass")
        prog.chmod(0o644)
        limits = {
            "cpu_s": max(1, int(timeout_s + 0.999)) + 1,
            "memory_bytes": settings.memory_bytes,
            "max_procs": settings.max_procs,
            "max_file_bytes": settings.max_file_bytes,
            "max_open_files": settings.max_open_files,
        }
        if settings.unsafe_no_sandbox:
            limits["max_procs"] = None  # counts all of this user's processes: would break the host's
        cgroup = None
        if self._use_cgroups:
            cgroup, why = self._new_cgroup()
            if cgroup is None:
                return ExecResult("sandbox_error", None, b"", f"no cgroup: {why}".encode(), 0.0)
        started = time.monotonic()
        try:
            process = subprocess.Popen(
                self._command(slot, mode, limits, cgroup),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                cwd=str(box) if settings.unsafe_no_sandbox else "/",
            )
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            return ExecResult("sandbox_error", None, b"", f"could not start the sandbox: {exc}".encode(), 0.0)
        oom_kills = 0
        try:
            status, stdout, stderr = self._pump(process, stdin, started + timeout_s + settings.startup_grace_s)
        finally:
            self._kill(process)
            if cgroup is not None:
                oom_kills = cgroup.oom_kills()
                self._release(cgroup)
        seconds = time.monotonic() - started
        code = process.returncode
        if code is not None and 128 < code <= 128 + 64 and not settings.unsafe_no_sandbox:
            code = -(code - 128)  # bwrap exits with 128 + N when the program died of signal N
        if status is None:
            if code == 0:
                status = "ok"
            elif oom_kills:
                status = "memory_limit"
            elif code == _EXIT_NO_CGROUP and not stdout:
                status = "sandbox_error"
            elif code is not None and code < 0:
                status = "signal"
            else:
                status = "exit"
        return ExecResult(status, code, stdout, stderr, seconds)

    def _release(self, cgroup: SlotCgroup) -> None:
        """Remove a finished execution's cgroup, and any earlier ones that were still busy."""
        with self._stale_lock:
            stale, self._stale_cgroups = self._stale_cgroups + [cgroup], []
        busy = [c for c in stale if not c.remove()]
        if busy:
            with self._stale_lock:
                self._stale_cgroups += busy

    def _pump(self, process: subprocess.Popen, stdin: bytes, deadline: float):
        """Feed stdin and collect capped stdout/stderr until exit, the deadline or the cap.

        Returns ``(status or None, stdout, stderr)``; a status is set only when the host had
        to kill the process.
        """
        cap = self.settings.max_output_bytes
        buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
        pending = memoryview(stdin)
        with selectors.DefaultSelector() as selector:
            for stream in (process.stdout, process.stderr):
                os.set_blocking(stream.fileno(), False)
                selector.register(stream, selectors.EVENT_READ)
            if pending:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin, selectors.EVENT_WRITE)
            else:
                process.stdin.close()
            open_readers = 2
            while open_readers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout", bytes(buffers[process.stdout]), bytes(buffers[process.stderr])
                for key, _ in selector.select(min(remaining, 0.5)):
                    stream = key.fileobj
                    if stream is process.stdin:
                        try:
                            written = os.write(stream.fileno(), pending[:65536])
                            pending = pending[written:]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:  # it stopped reading; what it read is its input
                            pending = pending[:0]
                        if not pending or process.poll() is not None:
                            selector.unregister(stream)
                            stream.close()
                        continue
                    try:
                        chunk = os.read(stream.fileno(), 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(stream)
                        open_readers -= 1
                        continue
                    buffers[stream] += chunk
                    if len(buffers[stream]) > cap:
                        out, err = (bytes(buffers[s][:cap]) for s in (process.stdout, process.stderr))
                        return "output_limit", out, err
        remaining = max(0.0, deadline - time.monotonic())
        try:
            process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            return "timeout", bytes(buffers[process.stdout]), bytes(buffers[process.stderr])
        return None, bytes(buffers[process.stdout]), bytes(buffers[process.stderr])

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        """SIGKILL the sandbox's process group (bwrap takes its pid namespace down with it)."""
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None and not stream.closed:
                stream.close()
