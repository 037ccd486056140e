"""What the broadcast modules share: size limits, request-path patterns, temp-folder names and
the small file helpers (atomic writes, hashing, removing folders that may be in use)."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from swarmrl.protocol.manifest import BroadcastError


CHUNK = 1 << 18  # 256 KiB: the unit of disk reads and socket writes
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~100 bytes per shard: room for ~500k shards
MIN_RATE = 32 << 10  # bytes/s: a source slower than this over a whole shard is treated as failing
INSTALLED_MANIFEST = ".broadcast-manifest.json"  # kept in each folder fetch_version installs (a dotfile:
_VERSION_DIR = re.compile(r"v([0-9]{6})", re.ASCII)
# Request paths, matched against the raw path and never URL-decoded: '..', '%2e%2e', query
# strings and anything else fail, so no request can leave the root.
_PATH_MANIFEST = re.compile(r"/v([0-9]{6})/manifest\.json", re.ASCII)
_PATH_SHARD = re.compile(r"/v([0-9]{6})/shards/([0-9]{5})", re.ASCII)
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)", re.ASCII)
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)", re.ASCII)
# Temp folders: .tmp-v000003-<pid>-<hex> (being written) and .old-v000003-<pid>-<hex> (moved aside
# before deletion). The pid tells a crashed process's leftovers from work still in progress.
_TEMP_DIR = re.compile(r"\.(?:tmp|old)-v[0-9]{6}-([0-9]+)-[0-9a-f]+", re.ASCII)

# The temp folders a thread of this process is writing now. A partial mirror (.tmp-vNNNNNN-<pid>-<hex>
# holding .digest and shards/) outlives a failed call so that the next call resumes it; only the
# ones not in this set may be claimed or cleaned up.
_ACTIVE: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


class _SourceFailure(Exception):
    """One source failed one request; `corrupt` when it served data contradicting the signed manifest."""

    def __init__(self, msg: str, corrupt: bool = False):
        super().__init__(msg)
        self.corrupt = corrupt


def _check_sources(sources, who: str) -> list[str]:
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


def _temp_name(prefix: str, vname: str) -> str:
    return f".{prefix}-{vname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_dir(path: Path) -> bool:
    """Rename aside, then delete: a reader sees the whole folder or none of it."""
    old = path.parent / _temp_name("old", path.name if _VERSION_DIR.fullmatch(path.name) else "v000000")
    try:
        os.replace(path, old)
    except FileNotFoundError:
        return False
    shutil.rmtree(old, ignore_errors=True)
    return True


def _hash_file(path: Path) -> tuple[int, "hashlib._Hash"]:
    """Size and sha256 state of a file (a state, so a resumed download can keep hashing)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h


def _sha256_file(path: Path) -> tuple[int, str]:
    size, h = _hash_file(path)
    return size, h.hexdigest()


def _manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=1).encode() + b"\n"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_manifest_file(path: Path) -> dict:
    try:
        m = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise BroadcastError(f"cannot read {path}: {e}; delete {path.parent} so the version is fetched again") from e
    if not isinstance(m, dict):
        raise BroadcastError(f"{path} is not a JSON object; delete {path.parent} so the version is fetched again")
    return m
