"""What the broadcast modules share: size limits, request-path patterns, temp-folder names and
the small file helpers (atomic writes, hashing, removing folders that may be in use, cleaning up
temp folders and old versions)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from swarmrl.protocol.manifest import BroadcastError, version_name

CHUNK = 1 << 18  # 256 KiB: the unit of disk reads and socket writes
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~100 bytes per shard: room for ~500k shards
MAX_LISTING_BYTES = 1 << 20  # GET /versions: a few version numbers (kept versions, incoming, progress)
MIN_RATE = 32 << 10  # bytes/s: a source slower than this over a whole shard is treated as failing
INSTALLED_MANIFEST = ".broadcast-manifest.json"  # kept in each folder fetch_version installs (a dotfile:
VERSION_DIR = re.compile(r"v([0-9]{6})", re.ASCII)  # a version's folder: v000003
# Request paths, matched against the raw path and never URL-decoded: '..', '%2e%2e', query
# strings and anything else fail, so no request can leave the root.
PATH_MANIFEST = re.compile(r"/v([0-9]{6})/manifest\.json", re.ASCII)
PATH_SHARD = re.compile(r"/v([0-9]{6})/shards/([0-9]{5})", re.ASCII)
PATH_PATCH = re.compile(r"/v([0-9]{6})/(patch\.json|patch\.bin)", re.ASCII)
RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)", re.ASCII)  # a request's Range header
CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)", re.ASCII)  # a reply's Content-Range header
# Temp folders: .tmp-v000003-<pid>-<hex> (being written) and .old-v000003-<pid>-<hex> (moved aside
# before deletion). The pid tells a crashed process's leftovers from work still in progress.
TEMP_DIR = re.compile(r"\.(?:tmp|old)-v[0-9]{6}-([0-9]+)-[0-9a-f]+", re.ASCII)

# The temp folders a thread of this process is writing now. A partial mirror (.tmp-vNNNNNN-<pid>-<hex>
# holding .digest and shards/) outlives a failed call so that the next call resumes it; only the
# ones not in this set may be claimed or cleaned up.
_ACTIVE: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


@contextmanager
def active_temp_dirs() -> Iterator[set[Path]]:
    """The set of temp folders this process is writing now, held under its lock for the `with`
    block: add a folder before writing into it and discard it when done; claiming or removing a
    folder not in the set happens inside the block, so no other thread adds it meanwhile."""
    with _ACTIVE_LOCK:
        yield _ACTIVE


class SourceFailure(Exception):
    """One source failed one request; `corrupt` when it served data contradicting the signed manifest,
    `late` when the caller's deadline cut the request before the source had its timeout_s (not
    the source's fault: it is not marked bad for it)."""

    def __init__(self, msg: str, corrupt: bool = False, late: bool = False):
        super().__init__(msg)
        self.corrupt, self.late = corrupt, late


def check_sources(sources, who: str) -> list[str]:
    """`sources` as a list of distinct http(s)://host:port URLs without trailing '/'; BroadcastError,
    the message starting with `who`, for anything else."""
    if isinstance(sources, str) or not sources:
        raise BroadcastError(f"{who}: sources must be a non-empty list of URLs like http://host:port, got {sources!r}")
    out = []
    for s in sources:
        ok = isinstance(s, str)
        if ok:
            try:
                u = urlsplit(s)
                ok = u.scheme in ("http", "https") and bool(u.hostname) and not u.query and not u.fragment
                u.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                ok = False
        if not ok:
            raise BroadcastError(f"{who}: bad source URL {s!r}; sources look like http://host:port (ShardServer.url)")
        s = s.rstrip("/")
        if s not in out:
            out.append(s)
    return out


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # ours: maybe another thread's work in progress; callers decide
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_name(prefix: str, vname: str) -> str:
    """A fresh temp folder name for version `vname`, owned by this process (see TEMP_DIR)."""
    return f".{prefix}-{vname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_dir(path: Path) -> bool:
    """Rename aside, then delete: a reader sees the whole folder or none of it."""
    old = path.parent / temp_name("old", path.name if VERSION_DIR.fullmatch(path.name) else "v000000")
    try:
        os.replace(path, old)
    except FileNotFoundError:
        return False
    shutil.rmtree(old, ignore_errors=True)
    return True


def hash_file(path: Path) -> tuple[int, hashlib._Hash]:
    """Size and sha256 state of a file (a state, so a resumed download can keep hashing)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 hex of a file."""
    size, h = hash_file(path)
    return size, h.hexdigest()


def manifest_bytes(manifest: dict) -> bytes:
    """A manifest as written to manifest.json (sorted keys, indented: the signature covers the canonical form)."""
    return json.dumps(manifest, sort_keys=True, indent=1).encode() + b"\n"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file and a rename: readers see the old or the new bytes."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, path)


def load_manifest_file(path: Path) -> dict:
    """A manifest read from disk (not verified); BroadcastError saying to delete its folder if unreadable."""
    try:
        m = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise BroadcastError(f"cannot read {path}: {e}; delete {path.parent} so the version is fetched again") from e
    if not isinstance(m, dict):
        raise BroadcastError(f"{path} is not a JSON object; delete {path.parent} so the version is fetched again")
    return m


def clean_temps(root: Path, below: int | None = None) -> None:
    """Remove temp folders of processes that are gone (a crash's leftovers) and, when `below` is
    given, this process's idle ones (partial downloads kept for a resume) of versions below it."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        m = TEMP_DIR.fullmatch(p.name)
        if m is None or not p.is_dir():
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            if below is None or int(p.name[6:12]) >= below:
                continue
            with active_temp_dirs() as active:  # claimed under the lock (a rename), deleted outside it
                if p in active:
                    continue
                gone = p.parent / temp_name("old", p.name[5:12])
                try:
                    os.rename(p, gone)
                except OSError:
                    continue
            shutil.rmtree(gone, ignore_errors=True)
        elif not pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def remove_old_versions(root: Path, versions: list[int], keep: int, in_use) -> None:
    """Remove root's version folders but the newest `keep` of `versions` (sorted) and those `in_use(version)`."""
    for v in versions[: max(len(versions) - keep, 0)]:
        if in_use(v):
            continue
        remove_dir(root / version_name(v))


class ShardWriter:
    """Cuts a byte stream into shards; with `folder` None it only hashes (a dry run)."""

    def __init__(self, folder: Path | None, shard_size: int):
        self.folder, self.shard_size = folder, shard_size
        self.shards: list[dict] = []
        self._f = None
        self._h = hashlib.sha256()
        self._size = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = min(len(view), self.shard_size - self._size)
            piece = view[:n]
            if self.folder is not None:
                if self._f is None:
                    self._f = open(self.folder / f"{len(self.shards):05d}", "wb")
                self._f.write(piece)
            self._h.update(piece)
            self._size += n
            view = view[n:]
            if self._size == self.shard_size:
                self._finish()

    def _finish(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self.shards.append({"size": self._size, "sha256": self._h.hexdigest()})
        self._h, self._size = hashlib.sha256(), 0

    def close(self) -> None:
        if self._size:
            self._finish()
        elif self._f is not None:
            self._f.close()
