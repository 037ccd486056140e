"""Broadcasting policy versions from the trainer, through untrusted relays, to untrusted workers.

A policy version is a Hugging Face model folder (config.json, model.safetensors, tokenizer files:
flat, plain file names). The trainer (the *origin*) publishes it into a broadcast root as

    root/v000003/manifest.json     what the version is, signed with the trainer's ed25519 key
    root/v000003/shards/00000      the folder's files, concatenated in name order and cut into
    root/v000003/shards/00001      fixed-size shards (the last one shorter)
    ...

and serves that root with a `ShardServer` (plain HTTP, Range requests). Relays mirror versions
from the origin or from other relays (`mirror_version`) into the same layout and serve them the
same way, so relays chain. Workers and validators call `fetch_version`, which downloads the
shards from whichever sources are fastest, in parallel, and rebuilds the HF folder.

Nothing between the trainer and the client is trusted: the client accepts only a manifest signed
by the configured trainer public key (`verify_manifest`), checks every shard's sha256 as it
arrives (a relay that serves a bad shard is scored down and the shard is fetched elsewhere), and
renames the rebuilt folder into place whole (a cached folder is re-checked against the files'
sha256 before it is reused).

Everything is written into a temp folder (name starting with '.') and renamed into place, so a
version folder exists only when complete. Standard library HTTP only (`http.server`,
`http.client`); signatures with the `cryptography` package, as in `swarmrl.orchestrator.auth`.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger(__name__)

FORMAT = "swarmrl-broadcast/1"

CHUNK = 1 << 18  # 256 KiB: the unit of disk reads and socket writes
MAX_SHARDS = 100_000  # shard names have five digits
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~100 bytes per shard: room for ~500k shards
MIN_RATE = 32 << 10  # bytes/s: a source slower than this over a whole shard is treated as failing
INSTALLED_MANIFEST = ".broadcast-manifest.json"  # kept in each folder fetch_version installs (a dotfile:
# not part of the HF folder, ignored by from_pretrained and by the file listing)

# A "plain" file name: what HF writes. Safe as a path component, needs no URL quoting.
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", re.ASCII)
_VERSION_DIR = re.compile(r"v([0-9]{6})", re.ASCII)
_HEX64 = re.compile(r"[0-9a-f]{64}", re.ASCII)
_HEX128 = re.compile(r"[0-9a-f]{128}", re.ASCII)
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

_FIELDS = {"format", "version", "parent", "created", "model_config", "files", "shard_size", "total_size", "shards",
           "public_key"}


class BroadcastError(RuntimeError):
    """A version could not be published, served, verified or fetched; the message says why and what to do."""


class _SourceFailure(Exception):
    """One source failed one request; `corrupt` when it served data contradicting the signed manifest."""

    def __init__(self, msg: str, corrupt: bool = False):
        super().__init__(msg)
        self.corrupt = corrupt


# ---- small helpers ------------------------------------------------------------------------------


def _vname(version: int) -> str:
    return f"v{version:06d}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_version(version, what: str = "version") -> None:
    if not _is_int(version) or not 0 <= version <= 999_999:
        raise BroadcastError(f"{what} must be an int in 0..999999, got {version!r}")


def _is_plain_name(name) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and ".." not in name


def _check_public_key(public_key, who: str) -> str:
    if not isinstance(public_key, str) or not _HEX64.fullmatch(public_key):
        raise BroadcastError(
            f"{who}: public_key must be the trainer's ed25519 public key as 64 lowercase hex characters "
            f"(auth.public_key_hex; <run-dir>/trainer.pub), got {str(public_key)[:80]!r}")
    return public_key


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


def _pid_alive(pid: int) -> bool:
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


# ---- manifests ----------------------------------------------------------------------------------


def canonical(manifest: dict) -> bytes:
    """The signed bytes: the manifest without "signature", sorted keys, no spaces, utf-8."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def manifest_digest(manifest: dict) -> str:
    """sha256 hex of canonical(manifest): one digest naming a published version's content."""
    return hashlib.sha256(canonical(manifest)).hexdigest()


def _where(manifest, version: int | None) -> str:
    if version is not None:
        return f"manifest of policy {_vname(version)}"
    v = manifest.get("version") if isinstance(manifest, dict) else None
    return f"manifest of policy {_vname(v)}" if _is_int(v) and 0 <= v <= 999_999 else "manifest"


def _check_shape(manifest, where: str) -> None:
    """Well-formedness only (no signature): every field, types, and internal consistency."""
    def bad(msg: str) -> BroadcastError:
        return BroadcastError(f"{where}: {msg}; the source is misconfigured or malicious, use another source")

    if not isinstance(manifest, dict):
        raise bad(f"not a JSON object ({type(manifest).__name__})")
    if "format" in manifest and manifest["format"] != FORMAT:
        raise BroadcastError(f"{where}: format is {manifest['format']!r}, expected {FORMAT!r}; the sender runs an "
                             "incompatible swarmrl version (upgrade both sides)")
    missing = sorted(_FIELDS - set(manifest))
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}: not a {FORMAT} manifest")
    unknown = sorted(set(manifest) - _FIELDS - {"signature"})
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(str, unknown))}")
    v, parent = manifest["version"], manifest["parent"]
    if not _is_int(v) or not 0 <= v <= 999_999:
        raise bad(f"version must be an int in 0..999999, got {v!r}")
    if parent is not None and (not _is_int(parent) or not 0 <= parent <= 999_999):
        raise bad(f"parent must be null or an int in 0..999999, got {parent!r}")
    created = manifest["created"]
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created):
        raise bad(f"created must be a unix time (a number), got {created!r}")
    if not isinstance(manifest["model_config"], dict):
        raise bad("model_config must be a JSON object (the parsed config.json)")
    if not (isinstance(manifest["public_key"], str) and _HEX64.fullmatch(manifest["public_key"])):
        raise bad("public_key must be 64 lowercase hex characters")
    shard_size, total = manifest["shard_size"], manifest["total_size"]
    if not _is_int(shard_size) or shard_size <= 0:
        raise bad(f"shard_size must be a positive int, got {shard_size!r}")
    if not _is_int(total) or total < 0:
        raise bad(f"total_size must be a non-negative int, got {total!r}")
    files = manifest["files"]
    if not isinstance(files, list) or not files:
        raise bad("files must be a non-empty list")
    offset = 0
    names = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict) or set(f) != {"name", "offset", "size", "sha256"}:
            raise bad(f"files[{i}] must be an object with exactly name, offset, size, sha256")
        if not _is_plain_name(f["name"]):
            raise bad(f"files[{i}] has a bad name {f['name']!r} (plain names only: letters, digits, '.', '_', '-'; "
                      "no '..', not starting with '.')")
        if f["name"] in names:
            raise bad(f"file {f['name']!r} is listed twice")
        names.add(f["name"])
        if not _is_int(f["size"]) or f["size"] < 0:
            raise bad(f"size of {f['name']!r} must be a non-negative int, got {f['size']!r}")
        if f["offset"] != offset or not _is_int(f["offset"]):
            raise bad(f"offset of {f['name']!r} is {f['offset']!r}, expected {offset} (files are contiguous from 0)")
        if not isinstance(f["sha256"], str) or not _HEX64.fullmatch(f["sha256"]):
            raise bad(f"sha256 of {f['name']!r} must be 64 lowercase hex characters")
        offset += f["size"]
    if offset != total:
        raise bad(f"the files add up to {offset} bytes but total_size is {total}")
    shards = manifest["shards"]
    n = -(-total // shard_size)
    if not isinstance(shards, list) or len(shards) != n:
        raise bad(f"shards must be a list of {n} entries ({total} bytes in shards of {shard_size})")
    if n > MAX_SHARDS:
        raise bad(f"{n} shards, more than the {MAX_SHARDS} shard names allow")
    for i, s in enumerate(shards):
        want = shard_size if i < n - 1 else total - (n - 1) * shard_size
        if not isinstance(s, dict) or set(s) != {"size", "sha256"}:
            raise bad(f"shards[{i}] must be an object with exactly size and sha256")
        if s["size"] != want or not _is_int(s["size"]):
            raise bad(f"shards[{i}] has size {s['size']!r}, expected {want}")
        if not isinstance(s["sha256"], str) or not _HEX64.fullmatch(s["sha256"]):
            raise bad(f"sha256 of shards[{i}] must be 64 lowercase hex characters")


def verify_manifest(manifest, public_key: str, version: int | None = None) -> None:
    """BroadcastError unless `manifest` is well formed, names `public_key`, carries a valid signature
    by that key, and (when given) is for `version`."""
    if version is not None:
        _check_version(version)
    where = _where(manifest, version)
    pk = _check_public_key(public_key, f"verifying the {where}")
    _check_shape(manifest, where)
    sig = manifest.get("signature")
    if sig is None or sig == "":
        raise BroadcastError(f"{where}: unsigned (no 'signature' field); only manifests signed by the trainer key "
                             f"{pk[:16]}... are accepted: refuse it, the source is misconfigured or malicious")
    if not isinstance(sig, str) or not _HEX128.fullmatch(sig):
        raise BroadcastError(f"{where}: the signature must be 128 lowercase hex characters; refuse it and use "
                             "another source")
    if manifest["public_key"] != pk:
        raise BroadcastError(f"{where}: signed by key {manifest['public_key']}, not the configured trainer key {pk}; "
                             "if the trainer's key changed, configure the new one (<run-dir>/trainer.pub), "
                             "otherwise the source is forging versions")
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(pk)).verify(bytes.fromhex(sig), canonical(manifest))
    except ValueError:
        raise BroadcastError(f"{where}: the configured trainer key {pk} is not a valid ed25519 public key; "
                             "check <run-dir>/trainer.pub") from None
    except InvalidSignature:
        raise BroadcastError(f"{where}: bad signature: the manifest was altered after the trainer signed it (or "
                             "signed by another key); refuse it and use another source") from None
    if version is not None and manifest["version"] != version:
        raise BroadcastError(f"{where}: the manifest is for {_vname(manifest['version'])}, not {_vname(version)}; "
                             "the source serves the wrong version, use another source")


def _same_content(a: dict, b: dict) -> bool:
    """Same version, same bytes, same signer: all but the time of publishing and the signature."""
    def strip(m):
        return {k: v for k, v in m.items() if k not in ("created", "signature")}
    return json.dumps(strip(a), sort_keys=True) == json.dumps(strip(b), sort_keys=True)


# ---- publishing ---------------------------------------------------------------------------------


def _model_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise BroadcastError(f"cannot publish: {model_dir} is not a directory (expected a saved HF model folder)")
    out = []
    for p in sorted(model_dir.iterdir(), key=lambda p: p.name):
        if p.name.startswith(".") or not p.is_file():
            continue
        if not _is_plain_name(p.name):
            raise BroadcastError(f"cannot publish {p}: file names may only use letters, digits, '.', '_' and '-'; "
                                 "rename the file")
        out.append(p)
    if not out:
        raise BroadcastError(f"cannot publish: {model_dir} holds no files (expected a saved HF model folder)")
    return out


class _ShardWriter:
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


def _split(paths: list[Path], shard_dir: Path | None, shard_size: int) -> tuple[list[dict], list[dict], int]:
    writer = _ShardWriter(shard_dir, shard_size)
    files, offset = [], 0
    try:
        for p in paths:
            h, size = hashlib.sha256(), 0
            with open(p, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    writer.write(chunk)
            files.append({"name": p.name, "offset": offset, "size": size, "sha256": h.hexdigest()})
            offset += size
    finally:
        writer.close()
    return files, writer.shards, offset


def publish_version(model_dir, root, version: int, *, key, parent: int | None = None,
                    shard_size: int = 1 << 20) -> dict:
    """Shard and sign HF folder `model_dir` as root/vNNNNNN (written whole, atomically); return the manifest.

    Versions are immutable: an existing root/vNNNNNN with the same content (same files, shard size,
    parent and key) is returned as is; with other content, BroadcastError (use unpublish_version
    first to replace it on purpose)."""
    _check_version(version)
    if parent is not None:
        _check_version(parent, "parent")
    if not _is_int(shard_size) or shard_size <= 0:
        raise BroadcastError(f"shard_size must be a positive int (bytes), got {shard_size!r}")
    if not isinstance(key, Ed25519PrivateKey):
        raise BroadcastError(f"key must be an Ed25519PrivateKey (auth.load_or_create_key), got {type(key).__name__}")
    model_dir, root, vname = Path(model_dir), Path(root), _vname(version)
    paths = _model_files(model_dir)
    n = -(-sum(p.stat().st_size for p in paths) // shard_size)
    if n > MAX_SHARDS:
        raise BroadcastError(f"cannot publish {vname}: {n} shards of {shard_size} bytes, more than {MAX_SHARDS}; "
                             "use a larger shard_size")
    model_config: dict = {}
    if (model_dir / "config.json").is_file():
        try:
            model_config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise BroadcastError(f"cannot publish {vname}: {model_dir / 'config.json'} is not valid JSON ({e})") from e
        if not isinstance(model_config, dict):
            raise BroadcastError(f"cannot publish {vname}: {model_dir / 'config.json'} is not a JSON object")

    def sign(files, shards, total) -> dict:
        m = {"format": FORMAT, "version": version, "parent": parent, "created": time.time(),
             "model_config": model_config, "files": files, "shard_size": shard_size, "total_size": total,
             "shards": shards, "public_key": key.public_key().public_bytes_raw().hex()}
        m["signature"] = key.sign(canonical(m)).hex()
        return m

    dest = root / vname

    def existing_or_refuse(new: dict) -> dict:
        if not (dest / "manifest.json").is_file():
            raise BroadcastError(f"cannot publish {vname}: {dest} exists but holds no manifest.json (not a complete "
                                 "version); delete it and publish again")
        old = _load_manifest_file(dest / "manifest.json")
        if _same_content(old, new):
            return old
        raise BroadcastError(
            f"cannot publish {vname}: {dest} already holds a different {vname} (manifest digest "
            f"{manifest_digest(old)[:16]}...); versions are immutable: publish under a new version number, or "
            "call unpublish_version first to replace it")

    if dest.exists():  # a dry run: hash only, write nothing
        try:
            return existing_or_refuse(sign(*_split(paths, None, shard_size)))
        except OSError as e:
            raise BroadcastError(f"cannot publish {vname}: cannot read {model_dir}: {e}") from e
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / _temp_name("tmp", vname)
    (tmp / "shards").mkdir(parents=True)
    with _ACTIVE_LOCK:
        _ACTIVE.add(tmp)
    try:
        try:
            manifest = sign(*_split(paths, tmp / "shards", shard_size))
            (tmp / "manifest.json").write_bytes(_manifest_bytes(manifest))
        except OSError as e:
            raise BroadcastError(f"cannot publish {vname} into {root}: {e}; check free space and permissions") from e
        try:
            os.rename(tmp, dest)
        except OSError:
            if dest.exists():  # another publisher finished first
                return existing_or_refuse(manifest)
            raise
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)


def unpublish_version(root, version: int) -> bool:
    """Delete root/vNNNNNN (renamed aside first, so it vanishes whole); True if it was there.
    For a trainer that redoes steps after a resume and must replace a version number."""
    _check_version(version)
    return _remove_dir(Path(root) / _vname(version))


def read_versions(root) -> list[int]:
    """The complete versions under `root` (vNNNNNN folders holding a manifest.json), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if (m := _VERSION_DIR.fullmatch(p.name)) and (p / "manifest.json").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def _clean_temps(root: Path, below: int | None = None) -> None:
    """Remove temp folders of processes that are gone (a crash's leftovers) and, when `below` is
    given, this process's idle ones (partial downloads kept for a resume) of versions below it."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        m = _TEMP_DIR.fullmatch(p.name)
        if m is None or not p.is_dir():
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            if below is None or int(p.name[6:12]) >= below:
                continue
            with _ACTIVE_LOCK:  # claimed under the lock (a rename), deleted outside it
                if p in _ACTIVE:
                    continue
                gone = p.parent / _temp_name("old", p.name[5:12])
                try:
                    os.rename(p, gone)
                except OSError:
                    continue
            shutil.rmtree(gone, ignore_errors=True)
        elif not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, versions: list[int], keep: int, in_use) -> None:
    for v in versions[: max(len(versions) - keep, 0)]:
        if in_use(v):
            continue
        _remove_dir(root / _vname(v))


def prune_versions(root, keep: int, in_use=lambda version: False) -> None:
    """Keep the newest `keep` complete versions under `root`; delete the older ones except those
    `in_use(version)` says are being downloaded; remove temp folders of dead processes."""
    if not _is_int(keep) or keep < 0:
        raise BroadcastError(f"keep must be a non-negative int, got {keep!r}")
    root = Path(root)
    versions = read_versions(root)
    _clean_temps(root, below=versions[-keep] if keep and len(versions) >= keep else None)
    _prune(root, versions, keep, in_use)


# ---- server -------------------------------------------------------------------------------------


class ShardRequestHandler(BaseHTTPRequestHandler):
    """Read-only GET/HEAD of /versions, /vNNNNNN/manifest.json and /vNNNNNN/shards/NNNNN.
    Subclass and set `ShardServer.handler_class` to inject faults in tests."""

    server: "_Server"
    timeout = 60  # an idle or stalled client must not hold a thread forever

    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        pass  # one line per request to stderr is noise: clients fetch many shards

    def do_GET(self):
        self._serve(send_body=True)

    def do_HEAD(self):
        self._serve(send_body=False)

    def _send_small(self, code: int, body: bytes, ctype: str, send_body: bool, extra: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _not_found(self, send_body: bool) -> None:
        self._send_small(404, b"not found\n", "text/plain; charset=utf-8", send_body)

    def _serve(self, send_body: bool) -> None:
        try:
            path = self.path
            if path == "/versions":
                body = json.dumps({"versions": read_versions(self.server.root)}).encode()
                return self._send_small(200, body, "application/json", send_body)
            if m := _PATH_MANIFEST.fullmatch(path):
                v = int(m.group(1))
                return self._send_file(v, self.server.root / _vname(v) / "manifest.json", send_body)
            if m := _PATH_SHARD.fullmatch(path):
                v = int(m.group(1))
                return self._send_file(v, self.server.root / _vname(v) / "shards" / m.group(2), send_body)
            return self._not_found(send_body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; it will retry elsewhere

    def _range(self, size: int):
        """None: whole file; (start, end) inclusive; or "unsatisfiable"."""
        header = self.headers.get("Range")
        if header is None:
            return None
        m = _RANGE.fullmatch(header.strip())
        if m is None or m.group(1) == m.group(2) == "":
            return None  # other units, several ranges, nonsense: ignored, as RFC 9110 allows
        a, b = m.groups()
        if a == "":  # bytes=-n: the last n bytes
            n = int(b)
            return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size - 1)
        start = int(a)
        if b and int(b) < start:
            return None  # syntactically invalid: must be ignored
        end = int(b) if b else size - 1
        if start >= size:
            return "unsatisfiable"
        return start, min(end, size - 1)

    def _send_file(self, version: int, path: Path, send_body: bool) -> None:
        try:
            f = open(path, "rb")
        except OSError:  # absent, or pruned between the listing and now
            return self._not_found(send_body)
        # Counted from the open on: a version pruned after this point is unlinked, but the open
        # file stays readable until this response is done.
        tracker = self.server.owner
        tracker._begin(version)
        try:
            with f:
                size = os.fstat(f.fileno()).st_size
                rng = self._range(size)
                if rng == "unsatisfiable":
                    return self._send_small(416, b"range not satisfiable\n", "text/plain; charset=utf-8", send_body,
                                            {"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"})
                start, end = rng if rng else (0, size - 1)
                length = end - start + 1
                self.send_response(206 if rng else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if send_body and length > 0:
                    f.seek(start)
                    self.write_body(f, length)
        finally:
            tracker._end(version)

    def write_body(self, f, length: int) -> None:
        """Stream `length` bytes of `f` (positioned) to the client, paced by the server's rate cap."""
        owner = self.server.owner
        rate = owner.max_bytes_per_s
        step = CHUNK if not rate else max(1, min(CHUNK, int(rate) // 20))
        sent = 0
        while sent < length:
            chunk = f.read(min(step, length - sent))
            if not chunk:
                break  # the file shrank under us: the client sees a short body and retries
            if rate:
                wait = owner._reserve(len(chunk))
                if wait > 0:
                    time.sleep(wait)
            self.wfile.write(chunk)
            sent += len(chunk)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung client must never keep the process alive
    block_on_close = False  # nor make close() wait for it

    def __init__(self, address, handler, owner: "ShardServer"):
        self.owner = owner
        self.root = owner.root
        super().__init__(address, handler)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return  # disconnects are routine
        log.warning("shard server: error serving %s", client_address, exc_info=True)


class ShardServer:
    """Serves a broadcast root read-only over HTTP, one thread per request (see the module doc).

    `in_use(version)` is True while a response for that version is being written, and for
    `busy_grace_s` seconds after the last one (a client fetches a version's shards one request
    after another), so prune_versions(..., in_use=server.in_use) never deletes a version a client
    is still downloading. `max_bytes_per_s` caps the server's upload rate, all responses together
    (None: no cap)."""

    handler_class = ShardRequestHandler

    def __init__(self, root, host: str = "127.0.0.1", port: int = 0, *, busy_grace_s: float = 30.0,
                 max_bytes_per_s: float | None = None):
        if max_bytes_per_s is not None and not (isinstance(max_bytes_per_s, (int, float)) and max_bytes_per_s > 0):
            raise BroadcastError(f"max_bytes_per_s must be None (no cap) or a positive number, got {max_bytes_per_s!r}")
        self.root = Path(root)
        self.host, self.port = host, port
        self.busy_grace_s = busy_grace_s
        self.max_bytes_per_s = max_bytes_per_s
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}
        self._last: dict[int, float] = {}
        self._next_send = 0.0  # the rate cap's clock: when the next byte may go out
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def _begin(self, version: int) -> None:
        with self._lock:
            self._active[version] = self._active.get(version, 0) + 1
            self._last[version] = time.monotonic()

    def _end(self, version: int) -> None:
        with self._lock:
            n = self._active.get(version, 1) - 1
            if n > 0:
                self._active[version] = n
            else:
                self._active.pop(version, None)
            self._last[version] = time.monotonic()

    def _reserve(self, nbytes: int) -> float:
        """Book `nbytes` of upload under the rate cap; the seconds to wait before sending them."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + nbytes / self.max_bytes_per_s
            return self._next_send - now  # the end of its slot: n bytes take n / rate seconds

    def in_use(self, version: int) -> bool:
        with self._lock:
            if self._active.get(version, 0) > 0:
                return True
            last = self._last.get(version)
            return last is not None and time.monotonic() - last < self.busy_grace_s

    def start(self) -> "ShardServer":
        if self._server is not None:
            raise BroadcastError("ShardServer is already started; create another instance to serve again")
        if not self.root.is_dir():
            raise BroadcastError(f"broadcast root {self.root} does not exist; create it (versions are published there)")
        try:
            self._server = _Server((self.host, self.port), self.handler_class, self)
        except OSError as e:
            raise BroadcastError(f"ShardServer cannot listen on {self.host}:{self.port}: {e}; "
                                 "choose another host or port") from e
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="shard-server", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise BroadcastError("ShardServer has no URL until start() is called")
        host, port = self._server.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "ShardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# ---- source scores ------------------------------------------------------------------------------


class SourceScores:
    """Thread-safe memory of each source's bandwidth (EMA of bytes/s) and recent failures.

    score: +inf for a source never measured (so it is tried early), its EMA bytes/s otherwise;
    after a failure the source is *penalized* for penalty_s * 2**(strikes-1) seconds (at most 32x),
    and while penalized its score is -(1 + strikes): behind every source that is not. A bad shard
    (data contradicting the signed manifest) costs 3 strikes, any other failure 1; each success
    takes one away. `order` sorts best first, ties in the given order."""

    def __init__(self, *, alpha: float = 0.3, penalty_s: float = 30.0):
        self.alpha, self.penalty_s = alpha, penalty_s
        self._lock = threading.Lock()
        self._s: dict[str, dict] = {}

    def _entry(self, url: str) -> dict:
        url = url.rstrip("/")
        if url not in self._s:
            self._s[url] = {"ema_bps": None, "successes": 0, "failures": 0, "bad_shards": 0, "strikes": 0,
                            "penalized_until": 0.0, "last_error": None}
        return self._s[url]

    def good(self, url: str, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-6)
        with self._lock:
            e = self._entry(url)
            e["ema_bps"] = rate if e["ema_bps"] is None else self.alpha * rate + (1 - self.alpha) * e["ema_bps"]
            e["successes"] += 1
            e["strikes"] = max(0, e["strikes"] - 1)

    def bad(self, url: str, reason: str, *, corrupt: bool = False) -> None:
        with self._lock:
            e = self._entry(url)
            e["failures"] += 1
            e["bad_shards"] += int(corrupt)
            e["strikes"] += 3 if corrupt else 1
            e["last_error"] = reason
            e["penalized_until"] = time.monotonic() + self.penalty_s * min(2 ** (e["strikes"] - 1), 32)

    def _score(self, e: dict | None, now: float) -> float:
        if e is None:
            return math.inf
        if now < e["penalized_until"]:
            return -1.0 - e["strikes"]
        return math.inf if e["ema_bps"] is None else e["ema_bps"]

    def order(self, sources: list[str]) -> list[str]:
        now = time.monotonic()
        with self._lock:
            scored = [(-self._score(self._s.get(s.rstrip("/")), now), i, s) for i, s in enumerate(sources)]
        return [s for _, _, s in sorted(scored)]

    def snapshot(self) -> dict[str, dict]:
        now = time.monotonic()
        with self._lock:
            return {url: {**{k: v for k, v in e.items() if k != "penalized_until"},
                          "score": self._score(e, now), "penalized_for_s": max(0.0, e["penalized_until"] - now)}
                    for url, e in self._s.items()}


# ---- client -------------------------------------------------------------------------------------


def _connect(source: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(source)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout_s), u.path.rstrip("/")


def _get_small(source: str, path: str, timeout_s: float, limit: int) -> bytes:
    """GET source+path, 200 only, body at most `limit` bytes; _SourceFailure otherwise."""
    conn, prefix = _connect(source, timeout_s)
    try:
        t0 = time.monotonic()
        try:
            conn.request("GET", prefix + path)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise _SourceFailure(f"no answer ({e!r})") from e
        if resp.status != 200:
            hint = " (not published there yet, or pruned)" if resp.status == 404 else ""
            raise _SourceFailure(f"HTTP {resp.status} {resp.reason}{hint}")
        cl = resp.getheader("Content-Length")
        announced = int(cl) if cl and cl.isdigit() else None
        if announced is not None and announced > limit:
            raise _SourceFailure(f"answer of {announced} bytes is larger than the {limit} allowed")
        deadline = t0 + timeout_s + (announced or limit) / MIN_RATE
        body = bytearray()
        while True:
            try:
                chunk = resp.read(min(CHUNK, limit + 1 - len(body)))
            except (OSError, http.client.HTTPException) as e:
                raise _SourceFailure(f"connection lost after {len(body)} bytes ({e!r})") from e
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                raise _SourceFailure(f"answer larger than the {limit} bytes allowed")
            if time.monotonic() > deadline:
                raise _SourceFailure(f"too slow: {len(body)} bytes in {time.monotonic() - t0:.1f} s")
        if announced is not None and len(body) != announced:
            raise _SourceFailure(f"transfer ended after {len(body)} of {announced} bytes")
        return bytes(body)
    finally:
        conn.close()


def list_versions(source: str, timeout_s: float = 10.0) -> list[int]:
    """GET {source}/versions: the complete versions a ShardServer holds."""
    (source,) = _check_sources([source], "list_versions")
    try:
        data = json.loads(_get_small(source, "/versions", timeout_s, 16 << 20))
    except _SourceFailure as e:
        raise BroadcastError(f"cannot list versions at {source}: {e}; is a ShardServer (origin or relay) running "
                             "there and reachable from this machine?") from None
    except ValueError:
        raise BroadcastError(f"cannot list versions at {source}: the answer is not JSON; is that URL a swarmrl "
                             "broadcast server?") from None
    versions = data.get("versions") if isinstance(data, dict) else None
    if not isinstance(versions, list) or not all(_is_int(v) and 0 <= v <= 999_999 for v in versions):
        raise BroadcastError(f"cannot list versions at {source}: expected {{\"versions\": [ints]}}; is that URL a "
                             "swarmrl broadcast server?")
    return sorted(versions)


def fetch_manifest(version: int, sources: list[str], *, public_key: str | None, timeout_s: float = 10.0,
                   expected_digest: str | None = None) -> dict:
    """The manifest of `version` from the first source (in order) whose answer verifies: signed by
    `public_key` when given, well formed and for `version` otherwise; and with manifest digest
    `expected_digest` when given (to skip copies of a version number that was republished)."""
    _check_version(version)
    vname = _vname(version)
    sources = _check_sources(sources, f"fetching the manifest of {vname}")
    if public_key is not None:
        _check_public_key(public_key, f"fetching {vname}")
    errors = []
    for src in sources:
        try:
            raw = _get_small(src, f"/{vname}/manifest.json", timeout_s, MAX_MANIFEST_BYTES)
            try:
                manifest = json.loads(raw)
            except ValueError:
                raise _SourceFailure("the manifest is not JSON") from None
            if public_key is not None:
                verify_manifest(manifest, public_key, version)
            else:
                _check_shape(manifest, f"manifest of policy {vname}")
                if manifest["version"] != version:
                    raise _SourceFailure(f"the manifest is for {_vname(manifest['version'])}")
            if expected_digest is not None and manifest_digest(manifest) != expected_digest:
                raise _SourceFailure(f"it holds another {vname} (manifest digest {manifest_digest(manifest)[:16]}..., "
                                     f"expected {expected_digest[:16]}...): a stale copy from before the trainer "
                                     "republished it")
            return manifest
        except (_SourceFailure, BroadcastError) as e:
            errors.append(f"{src}: {e}")
    raise BroadcastError(
        f"cannot get a valid manifest of policy {vname} from any source: " + "; ".join(errors)
        + ". Check that the sources are running and hold this version (GET <source>/versions), and that the "
        "configured trainer key is right")


def _download_shard(src: str, vname: str, index: int, size: int, digest: str, part: Path, final: Path,
                    timeout_s: float) -> int:
    """One attempt at one shard from one source, resuming `part` with a Range request.
    Returns the bytes transferred; _SourceFailure (source's fault) or BroadcastError (local)."""
    have, h = 0, hashlib.sha256()
    if part.exists():
        try:
            have, h = _hash_file(part)
        except OSError:
            have, h = 0, hashlib.sha256()
        if have > size:
            part.unlink(missing_ok=True)
            have, h = 0, hashlib.sha256()
        elif have == size:
            if h.hexdigest() == digest:
                os.replace(part, final)
                return 0
            part.unlink(missing_ok=True)
            have, h = 0, hashlib.sha256()
    what = f"shard {index:05d}"
    conn, prefix = _connect(src, timeout_s)
    t0 = time.monotonic()
    deadline = t0 + timeout_s + size / MIN_RATE
    try:
        try:
            conn.request("GET", f"{prefix}/{vname}/shards/{index:05d}",
                         headers={"Range": f"bytes={have}-"} if have else {})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise _SourceFailure(f"no answer for {what} ({e!r})") from e
        if resp.status == 206 and have:
            cr = resp.getheader("Content-Range", "")
            m = _CONTENT_RANGE.fullmatch(cr.strip())
            if m is None or tuple(map(int, m.groups())) != (have, size - 1, size):
                raise _SourceFailure(f"{what}: Content-Range {cr!r} for bytes={have}-, expected "
                                     f"'bytes {have}-{size - 1}/{size}'", corrupt=True)
            mode = "ab"
        elif resp.status == 200:
            have, h, mode = 0, hashlib.sha256(), "wb"  # no Range, or the source ignored it: start over
            cl = resp.getheader("Content-Length")
            if cl and cl.isdigit() and int(cl) != size:
                raise _SourceFailure(f"{what} is {cl} bytes there, the signed manifest says {size}", corrupt=True)
        elif resp.status == 416:
            raise _SourceFailure(f"{what}: 416 for bytes={have}-: its copy is shorter than the signed manifest says",
                                 corrupt=True)
        elif resp.status == 404:
            raise _SourceFailure(f"{what}: 404 (the source does not hold {vname}: not mirrored yet, or pruned)")
        else:
            raise _SourceFailure(f"{what}: HTTP {resp.status} {resp.reason}")
        got, too_long = 0, False
        try:
            f = open(part, mode)
        except OSError as e:
            raise BroadcastError(f"fetching {vname} {what}: cannot write {part}: {e}; check free space and "
                                 "permissions of the destination") from e
        with f:
            while True:
                try:
                    chunk = resp.read(min(CHUNK, size - have - got + 1))
                except (OSError, http.client.HTTPException) as e:
                    raise _SourceFailure(f"{what}: connection lost after {have + got} of {size} bytes ({e!r})") from e
                if not chunk:
                    break
                if have + got + len(chunk) > size:
                    too_long = True
                    break
                try:
                    f.write(chunk)
                except OSError as e:
                    raise BroadcastError(f"fetching {vname} {what}: cannot write {part}: {e}; check free space") from e
                h.update(chunk)
                got += len(chunk)
                if time.monotonic() > deadline:
                    raise _SourceFailure(f"{what}: too slow ({have + got} of {size} bytes after "
                                         f"{time.monotonic() - t0:.1f} s)")
        if too_long:
            part.unlink(missing_ok=True)
            raise _SourceFailure(f"{what}: more than the {size} bytes the signed manifest says", corrupt=True)
        if have + got < size:
            raise _SourceFailure(f"{what}: transfer ended after {have + got} of {size} bytes")
        if h.hexdigest() != digest:
            part.unlink(missing_ok=True)
            raise _SourceFailure(f"{what}: sha256 mismatch (got {h.hexdigest()[:16]}..., the signed manifest says "
                                 f"{digest[:16]}...)", corrupt=True)
        os.replace(part, final)
        return got
    finally:
        conn.close()


def download_shards(manifest: dict, sources: list[str], shard_dir, *, scores: SourceScores | None = None,
                    parallel: int = 4, timeout_s: float = 10.0, tries_per_shard: int | None = None,
                    log=lambda msg: None) -> None:
    """Fetch every shard of `manifest` (verified by the caller) into shard_dir/NNNNN, each checked
    against its sha256; see the module doc. BroadcastError after `tries_per_shard` failures of one shard."""
    where = _where(manifest, None)
    _check_shape(manifest, where)
    vname = _vname(manifest["version"])
    sources = _check_sources(sources, f"fetching {vname}")
    if not _is_int(parallel) or parallel < 1:
        raise BroadcastError(f"parallel must be a positive int, got {parallel!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise BroadcastError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    tries = 3 * len(sources) if tries_per_shard is None else tries_per_shard
    if not _is_int(tries) or tries < 1:
        raise BroadcastError(f"tries_per_shard must be a positive int, got {tries_per_shard!r}")
    scores = SourceScores() if scores is None else scores
    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)

    todo = []
    for i, s in enumerate(manifest["shards"]):
        final = shard_dir / f"{i:05d}"
        if final.is_file():
            try:
                if _sha256_file(final) == (s["size"], s["sha256"]):
                    continue
            except OSError:
                pass
            final.unlink(missing_ok=True)
        todo.append(i)
    if not todo:
        return

    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def fetch(i: int) -> None:
        s = manifest["shards"][i]
        part, final = shard_dir / f"{i:05d}.part", shard_dir / f"{i:05d}"
        failed: dict[str, int] = {}
        last_error: dict[str, str] = {}
        rounds_waited = 0
        for attempt in range(tries):
            if stop.is_set():
                return
            # Every source failed this shard at least once more: back off a little before the next round.
            rnd = min(failed.get(u, 0) for u in sources)
            if rnd > rounds_waited:
                rounds_waited = rnd
                if stop.wait(min(0.05 * 2 ** (rnd - 1), 1.0)):
                    return
            ranked = scores.order(sources)
            src = min(ranked, key=lambda u: (failed.get(u, 0), ranked.index(u)))
            t0 = time.monotonic()
            try:
                n = _download_shard(src, vname, i, s["size"], s["sha256"], part, final, timeout_s)
            except _SourceFailure as e:
                failed[src] = failed.get(src, 0) + 1
                last_error[src] = str(e)
                scores.bad(src, str(e), corrupt=e.corrupt)
                log(f"{vname}: {src}: {e}; trying {'another source' if len(sources) > 1 else 'again'}")
                continue
            if n:
                scores.good(src, n, time.monotonic() - t0)
            return
        raise BroadcastError(
            f"cannot fetch policy {vname} shard {i:05d} ({s['size']} bytes): {tries} tries failed; last error per "
            "source: " + "; ".join(f"{u}: {last_error.get(u, 'not tried')}" for u in sources)
            + ". Check that the sources are running, reachable and hold this version (GET <source>/versions); "
            "drop sources that serve corrupt data")

    queue = list(reversed(todo))

    def worker() -> None:
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                i = queue.pop()
            try:
                fetch(i)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                with lock:
                    errors.append(e)
                stop.set()
                return

    threads = [threading.Thread(target=worker, name=f"fetch-{vname}-{k}", daemon=True)
               for k in range(min(parallel, len(todo)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    missing = [i for i in todo if not (shard_dir / f"{i:05d}").is_file()]
    if missing:  # cannot happen without an error above; never report success for a partial version
        raise BroadcastError(f"fetching {vname}: shards {missing[:5]} missing after the download; try again")


def _claim_partial(root: Path, vname: str, digest: str) -> Path:
    fresh = root / _temp_name("tmp", vname)
    with _ACTIVE_LOCK:
        for p in sorted(root.glob(f".tmp-{vname}-*")):
            m = _TEMP_DIR.fullmatch(p.name)
            if m is None or p in _ACTIVE or not (p / ".digest").is_file():
                continue
            pid = int(m.group(1))
            if pid != os.getpid() and _pid_alive(pid):
                continue  # another live process is working on it
            try:
                os.rename(p, fresh)  # only one claimer wins
            except OSError:
                continue
            try:
                same = (fresh / ".digest").read_text() == digest
            except OSError:
                same = False
            if not same:  # a different publication of this version number
                shutil.rmtree(fresh / "shards", ignore_errors=True)
            break
        (fresh / "shards").mkdir(parents=True, exist_ok=True)
        (fresh / ".digest").write_text(digest)
        _ACTIVE.add(fresh)
    return fresh


def _mirror(version: int, manifest: dict, sources: list[str], root: Path, *, scores, parallel: int,
            timeout_s: float, log) -> dict:
    vname = _vname(version)
    vdir = root / vname
    if (vdir / "manifest.json").is_file():
        return _load_manifest_file(vdir / "manifest.json")
    root.mkdir(parents=True, exist_ok=True)
    digest = manifest_digest(manifest)
    tmp = _claim_partial(root, vname, digest)
    try:
        download_shards(manifest, sources, tmp / "shards", scores=scores, parallel=parallel, timeout_s=timeout_s,
                        log=log)
        (tmp / ".digest").unlink(missing_ok=True)
        for leftover in (tmp / "shards").glob("*.part"):
            leftover.unlink(missing_ok=True)
        (tmp / "manifest.json").write_bytes(_manifest_bytes(manifest))
        # Other fetchers into the same root may finish first, and may remove their copy again
        # (fetch_version deletes the shard copy once the files are rebuilt): a few rounds settle it.
        for _ in range(5):
            try:
                os.rename(tmp, vdir)
                return manifest
            except OSError:
                pass
            try:
                existing = _load_manifest_file(vdir / "manifest.json")
            except (BroadcastError, OSError):
                time.sleep(0.05)  # gone again, or still being moved: try the rename once more
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            if manifest_digest(existing) == digest:
                return existing
            raise BroadcastError(f"cannot mirror {vname} into {root}: it already holds another {vname} "
                                 f"(digest {manifest_digest(existing)[:16]}...); delete {vdir} to replace it")
        raise BroadcastError(f"cannot mirror {vname}: {vdir} exists but is not a complete version; delete it "
                             "and try again")
    except OSError as e:
        raise BroadcastError(f"cannot mirror {vname} into {root}: {e}; check free space and permissions") from e
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)


def mirror_version(version: int, sources: list[str], root, *, public_key: str | None, scores=None,
                   parallel: int = 4, timeout_s: float = 10.0, log=lambda msg: None,
                   expected_digest: str | None = None) -> dict:
    """Mirror `version` from `sources` into root/vNNNNNN (the origin's layout, so a ShardServer on
    `root` serves it: relays chain). The manifest is verified against `public_key` when given,
    every shard against its sha256 always; a failed call leaves its partial shards for the next
    call to resume. Returns the manifest; a complete copy already there is returned at once
    (unless `expected_digest` is given and it differs: then it is replaced)."""
    _check_version(version)
    vname = _vname(version)
    sources = _check_sources(sources, f"mirroring {vname}")
    if public_key is not None:
        _check_public_key(public_key, f"mirroring {vname}")
    root = Path(root)
    vdir = root / vname
    if (vdir / "manifest.json").is_file():
        held = _load_manifest_file(vdir / "manifest.json")
        if expected_digest is None or manifest_digest(held) == expected_digest:
            if public_key is not None:
                verify_manifest(held, public_key, version)
            else:
                _check_shape(held, f"manifest of policy {vname} in {vdir}")
            return held
        _remove_dir(vdir)
    scores = SourceScores() if scores is None else scores
    manifest = fetch_manifest(version, scores.order(sources), public_key=public_key, timeout_s=timeout_s,
                              expected_digest=expected_digest)
    return _mirror(version, manifest, sources, root, scores=scores,
                   parallel=parallel, timeout_s=timeout_s, log=log)


def _listing(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file()), key=lambda p: p.name)


def _folder_matches(folder: Path, manifest: dict) -> bool:
    """The folder holds exactly the manifest's files with their sizes and sha256 (re-hashed)."""
    try:
        paths = _listing(folder)
        if [p.name for p in paths] != sorted(f["name"] for f in manifest["files"]):
            return False
        want = {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]}
        return all(p.stat().st_size == want[p.name][0] and _sha256_file(p) == want[p.name] for p in paths)
    except OSError:
        return False


def _assemble(manifest: dict, shard_dir: Path, out: Path) -> str | None:
    """Rebuild the files from the shards into `out`; None, or the name of a file that could not be
    rebuilt (a shard shorter than the manifest says).

    The files are not hashed again here: every shard was checked against the signed manifest as
    it arrived, and a file is the concatenation of its shards' bytes. (A cached folder is
    re-checked against the files' sha256 before it is reused, in _folder_matches.) The bytes are
    copied inside the kernel where the OS allows (copy_file_range), since on a fast link this
    copy costs as much as the download.
    """
    shard_size = manifest["shard_size"]
    for f in manifest["files"]:
        pos, end = f["offset"], f["offset"] + f["size"]
        with open(out / f["name"], "wb") as dst:
            while pos < end:
                i = pos // shard_size
                n = min(end, (i + 1) * shard_size) - pos
                with open(shard_dir / f"{i:05d}", "rb") as src:
                    if os.fstat(src.fileno()).st_size < pos - i * shard_size + n:
                        return f["name"]
                    _copy_range(src, dst, pos - i * shard_size, n)
                pos += n
    return None


def _copy_range(src, dst, offset: int, n: int) -> None:
    """Append n bytes of src from offset to dst."""
    copy = getattr(os, "copy_file_range", None)
    if copy is not None:
        dst.flush()
        left, off = n, offset
        try:
            while left:
                done = copy(src.fileno(), dst.fileno(), left, off)
                if done <= 0:
                    break
                left -= done
                off += done
            if not left:
                dst.seek(0, os.SEEK_END)
                return
        except OSError:
            pass  # not supported between these files: fall back to a plain copy of what is left
        offset, n = off, left
        dst.seek(0, os.SEEK_END)
    src.seek(offset)
    while n:
        chunk = src.read(min(CHUNK, n))
        if not chunk:
            raise OSError(f"shard {src.name} ended early")
        dst.write(chunk)
        n -= len(chunk)


def fetch_version(version: int, sources: list[str], dest_root, *, public_key: str, scores=None,
                  keep: int = 2, parallel: int = 4, timeout_s: float = 10.0, log=lambda msg: None,
                  expected_digest: str | None = None) -> Path:
    """Fetch policy `version` from `sources` (relays and/or the origin) into dest_root/vNNNNNN, an
    HF folder ready for from_pretrained, and return that path.

    The manifest must be signed by `public_key` (the trainer's; required). Shards are mirrored into
    dest_root/.shards/ (a failed call leaves them there for the next call to resume), the files
    rebuilt in a temp folder and checked against the manifest's sha256, the folder renamed into
    place whole, the shard copy deleted, and only the newest `keep` versions (plus this one) kept.
    A folder already there with the manifest's file hashes is returned without downloading.
    `expected_digest` (manifest_digest of the manifest the orchestrator announced) skips sources
    holding another publication of the same version number."""
    _check_version(version)
    vname = _vname(version)
    if public_key is None:
        raise BroadcastError(f"fetching {vname}: public_key is required (the trainer's key, <run-dir>/trainer.pub): "
                             "workers never accept unsigned versions")
    _check_public_key(public_key, f"fetching {vname}")
    sources = _check_sources(sources, f"fetching {vname}")
    if not _is_int(keep) or keep < 0:
        raise BroadcastError(f"keep must be a non-negative int, got {keep!r}")
    scores = SourceScores() if scores is None else scores
    dest_root = Path(dest_root)
    dest = dest_root / vname

    def finish() -> Path:
        _clean_temps(dest_root)
        _clean_temps(dest_root / ".shards", below=version)  # partials of older versions will not be resumed
        versions = sorted(int(m.group(1)) for p in dest_root.iterdir()
                          if (m := _VERSION_DIR.fullmatch(p.name)) and p.is_dir())
        _prune(dest_root, versions, keep, lambda v: v == version)
        return dest

    # A version number can be republished with other weights (a trainer resumed from an older
    # checkpoint), so a folder already here is trusted without asking the sources only when the
    # caller names the publication it wants (expected_digest) and the folder is that one.
    if expected_digest is not None and (dest / INSTALLED_MANIFEST).is_file():
        try:
            held_manifest = _load_manifest_file(dest / INSTALLED_MANIFEST)
            verify_manifest(held_manifest, public_key, version)
            if manifest_digest(held_manifest) == expected_digest and _folder_matches(dest, held_manifest):
                return finish()
        except BroadcastError:
            pass
    # Otherwise the sources' current signed manifest says what the version is.
    manifest = fetch_manifest(version, scores.order(sources), public_key=public_key, timeout_s=timeout_s,
                              expected_digest=expected_digest)
    if dest.is_dir() and _folder_matches(dest, manifest):
        try:
            _atomic_write(dest / INSTALLED_MANIFEST, _manifest_bytes(manifest))
        except OSError:
            pass
        return finish()

    shard_root = dest_root / ".shards"
    held = shard_root / vname
    if held.is_dir():  # a complete shard copy from an interrupted call: usable only if it is this publication
        try:
            same = manifest_digest(_load_manifest_file(held / "manifest.json")) == manifest_digest(manifest)
        except BroadcastError:
            same = False
        if not same:
            _remove_dir(held)
    _mirror(version, manifest, sources, shard_root, scores=scores, parallel=parallel, timeout_s=timeout_s, log=log)

    tmp = dest_root / _temp_name("tmp", vname)
    tmp.mkdir()
    try:
        try:
            bad = _assemble(manifest, held / "shards", tmp)
        except FileNotFoundError:
            # Another fetcher of this version in dest_root finished and deleted the shard copy.
            if dest.is_dir() and _folder_matches(dest, manifest):
                return finish()
            raise BroadcastError(f"fetching {vname}: the shard copy in {held} vanished while rebuilding the files "
                                 "(a concurrent fetch into the same dest_root?); try again") from None
        except OSError as e:
            raise BroadcastError(f"fetching {vname}: cannot rebuild the files in {dest_root}: {e}; check free space "
                                 "and permissions") from e
        if bad is not None:
            _remove_dir(held)
            raise BroadcastError(f"fetching {vname}: file {bad!r} rebuilt from verified shards has the wrong sha256 "
                                 "(the shard copy was damaged on disk, or the trainer published an inconsistent "
                                 "manifest); the shard copy was deleted, try again")
        (tmp / INSTALLED_MANIFEST).write_bytes(_manifest_bytes(manifest))
        if dest.is_dir() and _folder_matches(dest, manifest):
            # A concurrent fetch installed it meanwhile: keep that one (its caller may be loading it).
            _remove_dir(held)
            return finish()
        if dest.exists():
            _remove_dir(dest)  # a stale or damaged copy: moved aside whole, then the new one goes in
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest.is_dir() and _folder_matches(dest, manifest)):  # else: another fetcher won the race
                raise BroadcastError(f"fetching {vname}: cannot rename the rebuilt folder to {dest}; "
                                     "remove it and try again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_dir(held)
    log(f"{vname}: installed in {dest}")
    return finish()
