"""Moving policy versions (Hugging Face model folders) from the trainer to inference workers over HTTP.

The trainer publishes each version as a complete folder ``<policies_dir>/vNNNNNN/`` (see
``filesystem.RunDir``). When workers run on other machines they cannot read that folder, so:

* the trainer runs a ``PolicyServer``, which serves those folders read-only over plain HTTP, and
  announces each version together with its ``folder_manifest`` (file names, sizes, sha256);
* a worker calls ``fetch_policy``, which downloads the files, checks every byte against the
  manifest while streaming, and renames the finished folder into place whole.

The manifest, not the server, is the source of truth: a file that changed on the server, a
truncated transfer or a proxy that rewrites bytes is caught by the hash check instead of silently
loading wrong weights. The manifest's own ``sha256`` names the whole version in one digest.

This is the first, simple version: one flat folder per version, whole files, no signatures.
Standard library only (``http.server`` / ``urllib.request``), so it adds no dependencies.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # 1 MiB: large enough for throughput, small enough to keep memory flat

# A "plain" file name: what HF writes (config.json, model-00001-of-00002.safetensors, ...).
# A conservative character set means a name is safe as a path component and needs no URL quoting,
# and the server and the manifest check agree on exactly which names exist.
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", re.ASCII)
_VERSION_DIR = re.compile(r"v([0-9]{6})", re.ASCII)
_REQUEST_PATH = re.compile(r"/(v[0-9]{6})/([A-Za-z0-9_-][A-Za-z0-9._-]*)", re.ASCII)
_SHA256 = re.compile(r"[0-9a-fA-F]{64}", re.ASCII)
# Temp folders of fetch_policy: .tmp-v000003-<pid>-<hex> (download in progress) and
# .old-v000003-<pid>-<hex> (a folder moved aside before deletion). The pid lets prune_cache tell
# a crashed fetch's leftovers from a download that another process is still running.
_TEMP_DIR = re.compile(r"\.(?:tmp|old)-v[0-9]{6}-([0-9]+)-[0-9a-f]+", re.ASCII)


class WeightsError(RuntimeError):
    """A policy version could not be published, served or fetched; the message says why."""


def _is_plain_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and ".." not in name


def _files_digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def folder_manifest(folder: str | Path) -> dict:
    """{"files": {name: {"sha256": hex, "size": int}}, "sha256": hex} for one policy folder.

    Only regular files directly inside ``folder`` whose names do not start with '.' are listed
    (HF folders are flat; dotfiles are editor/OS litter). The top-level "sha256" is the sha256 of
    ``json.dumps(files, sort_keys=True, separators=(",", ":"))``: one digest naming the version.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightsError(f"cannot build a manifest: {folder} is not a directory (expected a saved HF model folder)")
    files: dict[str, dict] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        if not _is_plain_name(path.name):
            # Refuse here, at publish time, rather than letting every worker fail to fetch it later.
            raise WeightsError(
                f"cannot publish {path}: file names may only use letters, digits, '.', '_' and '-'; rename the file"
            )
        h = hashlib.sha256()
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
        files[path.name] = {"sha256": h.hexdigest(), "size": size}
    return {"files": files, "sha256": _files_digest(files)}


# ---- server -------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    # An idle or stalled client must not hold a thread forever.
    timeout = 60

    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        # The default writes one line per request to stderr; workers fetch often, so stay quiet.
        pass

    def do_GET(self):
        self._serve(send_body=True)

    def do_HEAD(self):
        self._serve(send_body=False)

    def _not_found(self, send_body: bool) -> None:
        body = b"not found\n"
        self.send_response(404)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _serve(self, send_body: bool) -> None:
        try:
            # Match the raw path exactly and never URL-decode it: '..', '%2e%2e', dotfiles, query
            # strings and directories all fail this one check, so no path can leave a version folder.
            m = _REQUEST_PATH.fullmatch(self.path)
            if m is None or ".." in m.group(2):
                return self._not_found(send_body)
            version_dir = self.server.policies_dir / m.group(1)
            path = version_dir / m.group(2)
            if not version_dir.is_dir() or not path.is_file():
                return self._not_found(send_body)
            try:
                f = open(path, "rb")
            except OSError:  # deleted (pruned) between the check and the open
                return self._not_found(send_body)
            with f:
                size = os.fstat(f.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if send_body:
                    # Stream in chunks: model files are gigabytes and many workers fetch at once.
                    while chunk := f.read(CHUNK):
                        self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away mid-download (it will retry or has given up): nothing to do.
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung client must never keep the trainer process alive

    def __init__(self, address, policies_dir: Path):
        self.policies_dir = policies_dir
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address):
        # The default prints a traceback to stderr. Disconnects are routine; anything else is a bug
        # worth a log line, but never a traceback on the terminal or in a response.
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        log.warning("policy server: error serving %s", client_address, exc_info=True)


class PolicyServer:
    """Serves <policies_dir>/vNNNNNN/<file> read-only over HTTP (GET and HEAD), one thread per request."""

    def __init__(self, policies_dir: str | Path, host: str = "127.0.0.1", port: int = 0):
        self.policies_dir = Path(policies_dir)
        self.host = host
        self.port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "PolicyServer":
        if self._server is not None:
            raise WeightsError("PolicyServer is already started; create another instance to serve again")
        if not self.policies_dir.is_dir():
            raise WeightsError(
                f"policies dir {self.policies_dir} does not exist; create it (the trainer publishes versions there)"
            )
        try:
            self._server = _Server((self.host, self.port), self.policies_dir)
        except OSError as e:
            raise WeightsError(
                f"PolicyServer cannot listen on {self.host}:{self.port}: {e}; choose another host or port"
            ) from e
        # A short poll interval keeps close() quick; the cost is a few idle wake-ups per second.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="policy-server", daemon=True
        )
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise WeightsError("PolicyServer has no URL until start() is called")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return  # never started or already closed: closing twice is harmless
        server.shutdown()  # stops serve_forever; requests in flight finish on their daemon threads
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "PolicyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# ---- client -------------------------------------------------------------------------------------


class _Transient(Exception):
    """A failure worth retrying (network trouble, server error, truncated transfer)."""


def _checked_files(version: int, manifest: dict) -> dict[str, dict]:
    """Validate a manifest and return its files with normalised (lowercase) digests."""
    where = f"manifest for policy v{version:06d}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise WeightsError(f"{where} must be a dict with a 'files' dict; build it with folder_manifest()")
    files = manifest["files"]
    if not files:
        raise WeightsError(f"{where} lists no files; was the version published from an empty folder?")
    out = {}
    for name, entry in files.items():
        if not isinstance(name, str) or not _is_plain_name(name):
            raise WeightsError(
                f"{where}: bad file name {name!r}; names must be plain (no '/', no '..', not starting with '.')"
            )
        if not isinstance(entry, dict):
            raise WeightsError(f"{where}: entry for {name!r} must be a dict with 'sha256' and 'size'")
        size, digest = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise WeightsError(f"{where}: size of {name!r} must be a non-negative int, got {size!r}")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise WeightsError(f"{where}: sha256 of {name!r} must be 64 hex characters, got {digest!r}")
        out[name] = {"sha256": digest.lower(), "size": size}
    # The top-level digest must describe these files: catches a manifest edited or mixed up in transit.
    if manifest.get("sha256") != _files_digest(files):
        raise WeightsError(
            f"{where}: top-level sha256 {manifest.get('sha256')!r} does not match its files; "
            "send the manifest exactly as folder_manifest() returned it"
        )
    return out


def check_manifest(manifest: dict, version: int = 0) -> None:
    """Raise WeightsError unless `manifest` is well formed (what the orchestrator accepts)."""
    _checked_files(version, manifest)


def _matches(folder: Path, files: dict[str, dict]) -> bool:
    # Re-hashing costs a read of the folder, but it also catches a folder damaged after it was
    # written (a crash before the data reached disk, a stray edit), which then gets re-downloaded.
    try:
        return folder_manifest(folder)["files"] == files
    except (WeightsError, OSError):
        return False


def _download(url: str, target: Path, size: int, digest: str, timeout_s: float, what: str) -> None:
    """One attempt at one file. Raises _Transient for retryable failures, WeightsError otherwise."""
    try:
        resp = urllib.request.urlopen(url, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code >= 500:
            raise _Transient(f"HTTP {e.code}") from e
        hint = " (version not published yet, or already pruned on the server?)" if e.code == 404 else ""
        raise WeightsError(f"{what}: HTTP {e.code} from {url}{hint}") from e
    except (ValueError, http.client.InvalidURL) as e:  # malformed URL: retrying cannot help
        raise WeightsError(f"{what}: bad URL {url!r} ({e}); base_url must look like http://host:port") from e
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise _Transient(str(getattr(e, "reason", e))) from e

    with resp:
        announced = resp.headers.get("Content-Length")
        if announced is not None and announced.isdigit() and int(announced) != size:
            # The server holds a different file than the manifest describes: retrying cannot help.
            raise WeightsError(
                f"{what}: size mismatch at {url}: expected {size} bytes, server has {announced}; "
                "the file changed after the manifest was made (re-publish the version)"
            )
        h = hashlib.sha256()
        got = 0
        with open(target, "wb") as f:
            while True:
                try:
                    chunk = resp.read(CHUNK)
                except (OSError, http.client.HTTPException) as e:  # reset, timeout, ...
                    raise _Transient(f"connection lost after {got} bytes: {e!r}") from e
                if not chunk:
                    break
                got += len(chunk)
                if got > size:
                    raise WeightsError(
                        f"{what}: size mismatch at {url}: expected {size} bytes, got more; "
                        "the file changed after the manifest was made (re-publish the version)"
                    )
                h.update(chunk)
                try:
                    f.write(chunk)
                except OSError as e:  # a local problem (disk full, ...): retrying the download won't help
                    raise WeightsError(f"{what}: cannot write {target}: {e}; check free space in dest_root") from e
    if got < size:
        if announced is not None:
            # The server promised the right size but the stream ended early: a broken transfer.
            raise _Transient(f"transfer ended after {got} of {size} bytes")
        raise WeightsError(f"{what}: size mismatch at {url}: expected {size} bytes, got {got}")
    if h.hexdigest() != digest:
        raise WeightsError(
            f"{what}: sha256 mismatch at {url}: expected {digest}, got {h.hexdigest()}; "
            "the file changed after the manifest was made (re-publish the version)"
        )


def fetch_policy(
    base_url: str,
    version: int,
    manifest: dict,
    dest_root: str | Path,
    *,
    timeout_s: float = 30.0,
    retries: int = 3,
    backoff_s: float = 0.2,
) -> Path:
    """Download policy ``version`` (the files in ``manifest``) into ``dest_root/vNNNNNN`` and return it.

    Files come from ``base_url + f"/v{version:06d}/{name}"`` and are checked against the manifest's
    size and sha256 while streaming. If the destination already matches the manifest, returns at
    once. Everything is written into a temp folder under ``dest_root`` (name starting with '.') and
    renamed into place whole, so a reader never sees a partial version.

    Transient errors (connection refused/reset, timeouts, HTTP 5xx, truncated transfers) are retried
    up to ``retries`` times per file with exponential backoff. A 404 or other 4xx, a size or hash
    mismatch, or an invalid manifest raises ``WeightsError`` at once.
    """
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= 999_999:
        raise WeightsError(f"policy version must be an int in 0..999999, got {version!r}")
    if not isinstance(retries, int) or retries < 0:
        raise WeightsError(f"retries must be a non-negative int, got {retries!r}")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise WeightsError(f"base_url must look like http://host:port (PolicyServer.url), got {base_url!r}")
    files = _checked_files(version, manifest)
    vname = f"v{version:06d}"
    dest_root = Path(dest_root)
    dest = dest_root / vname
    if dest.is_dir() and _matches(dest, files):
        return dest

    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = dest_root / f".tmp-{vname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    base = base_url.rstrip("/")
    try:
        for name, entry in sorted(files.items()):
            url = f"{base}/{vname}/{name}"
            what = f"fetching policy {vname} file {name!r}"
            for attempt in range(retries + 1):
                try:
                    _download(url, tmp / name, entry["size"], entry["sha256"], timeout_s, what)
                    break
                except _Transient as e:
                    if attempt == retries:
                        raise WeightsError(
                            f"{what} from {url} failed after {retries + 1} attempts: {e}; "
                            "is the policy server running and reachable from this machine?"
                        ) from e
                    time.sleep(backoff_s * 2**attempt)
        if dest.exists():
            # A stale or damaged copy: move it aside first (one rename), so the swap below is atomic.
            old = dest_root / f".old-{vname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.replace(dest, old)
            except FileNotFoundError:
                pass  # someone else removed it meanwhile
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            # Another fetcher of the same version finished first; its copy is as good as ours.
            if dest.is_dir() and _matches(dest, files):
                return dest
            raise
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        # Our own temp folders are removed by fetch_policy itself; one still present may belong to
        # a fetch running in another thread right now, so leave it.
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def prune_cache(dest_root: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` vNNNNNN folders under ``dest_root``; delete older ones and stale temp folders.

    A temp folder is stale when the process that made it (its pid is in the name) is gone.
    """
    if not isinstance(keep, int) or keep < 0:
        raise WeightsError(f"keep must be a non-negative int, got {keep!r}")
    dest_root = Path(dest_root)
    if not dest_root.is_dir():
        return
    versions = []
    for p in dest_root.iterdir():
        if (m := _VERSION_DIR.fullmatch(p.name)) and p.is_dir():
            versions.append((int(m.group(1)), p))
        elif (m := _TEMP_DIR.fullmatch(p.name)) and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
    versions.sort()
    for v, p in versions[: max(len(versions) - keep, 0)]:
        # Rename first, then delete: a reader sees the whole folder or none of it, never half.
        old = dest_root / f".old-v{v:06d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(p, old)
        except FileNotFoundError:
            continue
        shutil.rmtree(old, ignore_errors=True)
