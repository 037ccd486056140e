"""Host uids for sandbox slots, claimed so that no two sandbox pools on one machine share one.

Why: run as root, a slot's programs run as an unprivileged uid, and RLIMIT_NPROC counts every
process of that uid on the host. The slots of one pool have distinct uids, but two pools (the
orchestrator's code grader and a validator's, two scorers, two test runs) that both counted from
``sandbox.uid_base`` would run their slots as the same uids, and a fork bomb in one pool's slot
would use up the process limit of a program in the other, which would then fail.

So each pool claims its uids: an exclusive ``flock`` on one file per uid under a root-only
runtime directory, held for the pool's life. The kernel drops a lock when its holder exits,
however it exits, so a crashed pool never leaks its uids (the empty lock files stay, one per
uid ever used, and are reused).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from swarmrl.errors import SwarmrlError

# Where the lock files live: under /run (a tmpfs, root's, emptied at boot) when it is there.
DEFAULT_LOCK_DIR = Path("/run/swarmrl/sandbox-uids") if os.path.isdir("/run") else Path("/tmp/swarmrl-sandbox-uids")
# How far above uid_base a pool looks for free uids: room for 4096 slots in use at once.
SCAN = 4096


class UidsUnavailable(SwarmrlError, RuntimeError):
    """No range of free uids could be claimed; the message says why and what to do."""


def _lock_dir(path: Path) -> Path:
    """The lock directory, created root-only; refused if someone else could write into it
    (they could then hold every lock, or plant a link where a lock file goes)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise UidsUnavailable(
            f"cannot create the sandbox uid lock directory {path}: {exc}; only root runs "
            "sandbox slots as other uids, so run as root (or check that /run is writable)"
        ) from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UidsUnavailable(
            f"the sandbox uid lock directory {path} is not a directory owned by uid {os.geteuid()} "
            "and writable only by it; remove it (it is recreated) or choose another one"
        )
    return path


def _try_lock(directory: Path, uid: int) -> int | None:
    """An fd holding the lock of `uid`, or None when another pool holds it."""
    fd = os.open(directory / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


class UidRange:
    """`count` consecutive uids from `uid_base` up, none held by another pool on this machine,
    held until `release` (or this process's exit)."""

    def __init__(self, uid_base: int, count: int, lock_dir: str | Path | None = None):
        directory = _lock_dir(Path(lock_dir) if lock_dir else DEFAULT_LOCK_DIR)
        self.lock_dir = directory
        self._fds: list[int] = []
        start = uid_base
        try:
            while start + count <= uid_base + SCAN:
                for uid in range(start, start + count):
                    fd = _try_lock(directory, uid)
                    if fd is None:  # taken: drop what we hold and start again just above it
                        self._drop()
                        start = uid + 1
                        break
                    self._fds.append(fd)
                else:
                    self.uids = list(range(start, start + count))
                    return
        except OSError as exc:
            self._drop()
            raise UidsUnavailable(f"cannot claim sandbox uids in {directory}: {exc}") from exc
        raise UidsUnavailable(
            f"no {count} consecutive free sandbox uids between {uid_base} and {uid_base + SCAN}: other sandbox "
            f"pools on this machine hold them (lock files in {directory}); close some, or set sandbox.uid_base "
            "to another range"
        )

    def _drop(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the only fd of an open file drops its flock
        self._fds = []

    def release(self) -> None:
        self._drop()
