"""The client: measure sources (`SourceScores`), fetch and verify a version's manifest from the
first source that has it, and download its shards in parallel from the fastest sources, checking
each shard's sha256 as it arrives."""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from swarmrl.protocol.manifest import (
    BroadcastError,
    check_manifest_shape,
    check_public_key,
    check_version,
    describe_manifest,
    is_int,
    manifest_digest,
    verify_manifest,
    version_name,
)
from swarmrl.transport.broadcast.common import (
    CHUNK,
    CONTENT_RANGE,
    MAX_LISTING_BYTES,
    MAX_MANIFEST_BYTES,
    MIN_RATE,
    SourceFailure,
    check_sources,
    hash_file,
    sha256_file,
)

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
            self._s[url] = {
                "ema_bps": None,
                "successes": 0,
                "failures": 0,
                "bad_shards": 0,
                "strikes": 0,
                "penalized_until": 0.0,
                "last_error": None,
            }
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

    def penalized(self, url: str) -> bool:
        """Whether `url` failed recently and is still being held back for it."""
        with self._lock:
            e = self._s.get(url.rstrip("/"))
            return e is not None and time.monotonic() < e["penalized_until"]

    def delivered(self, url: str) -> bool:
        """Whether `url` has served this process a verified shard or patch."""
        with self._lock:
            e = self._s.get(url.rstrip("/"))
            return e is not None and e["successes"] > 0

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
            return {
                url: {
                    **{k: v for k, v in e.items() if k != "penalized_until"},
                    "score": self._score(e, now),
                    "penalized_for_s": max(0.0, e["penalized_until"] - now),
                }
                for url, e in self._s.items()
            }


# ---- client -------------------------------------------------------------------------------------


def _connect(source: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(source)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout_s), u.path.rstrip("/")


class _Deadline:
    """Shuts a connection's socket down at a monotonic time `at` (moved earlier with `move`), from
    a thread of its own: a socket timeout bounds only the wait for each byte, so a source that
    trickles its answer (headers or body, one byte a second) would otherwise hold a read for as
    long as it likes. `fired` says the deadline passed; the blocked read then ends with an error
    or an early end, which the caller reports as too slow."""

    def __init__(self, conn: http.client.HTTPConnection, at: float):
        self.conn, self.at, self.fired = conn, at, False
        self.sock: socket.socket | None = None  # the connection's (it drops it when the answer will close it)
        self._cond = threading.Condition()
        self._done = False
        threading.Thread(target=self._run, name="http-deadline", daemon=True).start()

    def _run(self) -> None:
        with self._cond:
            while not self._done:
                left = self.at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.fired = True
                sock = self.sock or self.conn.sock
                if sock is not None:
                    try:  # the plain socket's shutdown, under TLS too: the blocked read sees its end
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                self._cond.wait(0.05)  # still connecting (bounded by the socket timeout)

    def connect(self) -> None:
        """Connect now, and hold the socket to shut down."""
        self.conn.connect()
        with self._cond:
            self.sock = self.conn.sock

    def move(self, at: float) -> None:
        with self._cond:
            if at < self.at:
                self.at = at
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()


def _get(
    source: str, path: str, timeout_s: float, limit: int, sink, deadline: float | None = None, flat: bool = False
) -> int:
    """GET source+path, 200 only, body at most `limit` bytes passed to `sink` a chunk at a time;
    the body's length. SourceFailure for anything the source did wrong, and when the answer is
    not in by timeout_s + its length (or `limit`) / MIN_RATE (`flat`: by timeout_s), or by
    `deadline` (monotonic) if that is earlier: a hard bound however the bytes trickle in (_Deadline)."""
    conn, prefix = _connect(source, timeout_s)
    t0 = time.monotonic()
    rate = math.inf if flat else MIN_RATE
    dog = _Deadline(conn, min(t0 + timeout_s + limit / rate, math.inf if deadline is None else deadline))
    got = 0

    def too_slow() -> SourceFailure:
        late = deadline is not None and deadline - t0 < timeout_s
        return SourceFailure(f"too slow: {got} bytes in {time.monotonic() - t0:.1f} s", late=late)

    try:
        try:
            dog.connect()
            conn.request("GET", prefix + path)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            if dog.fired:
                raise too_slow() from None
            raise SourceFailure(f"no answer ({e!r})") from e
        if resp.status != 200:
            hint = " (not published there yet, or pruned)" if resp.status == 404 else ""
            raise SourceFailure(f"HTTP {resp.status} {resp.reason}{hint}")
        cl = resp.getheader("Content-Length")
        announced = int(cl) if cl and cl.isdigit() else None
        if announced is not None and announced > limit:
            raise SourceFailure(f"answer of {announced} bytes is larger than the {limit} allowed")
        dog.move(t0 + timeout_s + (announced or limit) / rate)
        while True:
            try:
                chunk = resp.read(min(CHUNK, limit + 1 - got))
            except (OSError, http.client.HTTPException) as e:
                if dog.fired:
                    raise too_slow() from None
                raise SourceFailure(f"connection lost after {got} bytes ({e!r})") from e
            if dog.fired:
                raise too_slow()
            if not chunk:
                break
            got += len(chunk)
            if got > limit:
                raise SourceFailure(f"answer larger than the {limit} bytes allowed")
            sink(chunk)
        if announced is not None and got != announced:
            raise SourceFailure(f"transfer ended after {got} of {announced} bytes")
        return got
    finally:
        dog.stop()
        conn.close()


def get_small(
    source: str, path: str, timeout_s: float, limit: int, deadline: float | None = None, flat: bool = False
) -> bytes:
    """GET source+path, 200 only, body at most `limit` bytes, in by `deadline` (monotonic) if
    given (and by timeout_s if `flat`); SourceFailure otherwise."""
    body = bytearray()
    _get(source, path, timeout_s, limit, body.extend, deadline, flat)
    return bytes(body)


def parse_json(raw: bytes, what: str):
    """A source's answer parsed as JSON; SourceFailure (corrupt) for anything else, whatever the
    parser raises: deeply nested input ('[' * 60000) makes json.loads raise RecursionError, not
    ValueError, and a source must not be able to raise anything but a source failure."""
    try:
        return json.loads(raw)
    except Exception as e:  # noqa: BLE001 - untrusted bytes: every failure is the source's
        raise SourceFailure(f"{what} is not JSON ({type(e).__name__})", corrupt=True) from None


def get_file(source: str, path: str, timeout_s: float, size: int, dest: Path, progress=None) -> str:
    """GET source+path into the file `dest` (replaced), a chunk at a time: exactly `size` bytes
    (SourceFailure, corrupt, for fewer), 200 only. The body's sha256 hex, computed on the way.
    `progress(n)` is called with each chunk's length; OSError when `dest` cannot be written."""
    h = hashlib.sha256()
    with open(dest, "wb") as f:

        def sink(chunk: bytes) -> None:
            f.write(chunk)
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))

        got = _get(source, path, timeout_s, size, sink)
    if got != size:
        raise SourceFailure(f"{path}: {got} bytes, the signed size is {size}", corrupt=True)
    return h.hexdigest()


def _get_listing(source: str, timeout_s: float, deadline: float | None = None) -> bytes:
    """GET {source}/versions: a few versions, so at most MAX_LISTING_BYTES, all of it within
    timeout_s (and by `deadline` if given), however slowly it comes."""
    return get_small(source, "/versions", timeout_s, MAX_LISTING_BYTES, deadline, flat=True)


def list_versions(source: str, timeout_s: float = 10.0) -> list[int]:
    """GET {source}/versions: the complete versions a ShardServer says it holds, sorted.

    Entries that are not version numbers (ints in 0..999999) are dropped, not an error: a source
    is untrusted, and one garbage entry must not hide the real versions listed beside it. What is
    listed is only a claim; each version is believed once its signed manifest verifies."""
    (source,) = check_sources([source], "list_versions")
    try:
        raw = _get_listing(source, timeout_s)
    except SourceFailure as e:
        raise BroadcastError(
            f"cannot list versions at {source}: {e}; is a ShardServer (origin or relay) running "
            "there and reachable from this machine?"
        ) from None
    try:
        data = parse_json(raw, "the answer")
    except SourceFailure:
        raise BroadcastError(
            f"cannot list versions at {source}: the answer is not JSON; is that URL a swarmrl broadcast server?"
        ) from None
    versions = data.get("versions") if isinstance(data, dict) else None
    if not isinstance(versions, list):
        raise BroadcastError(
            f'cannot list versions at {source}: expected {{"versions": [ints]}}; is that URL a '
            "swarmrl broadcast server?"
        )
    return sorted({v for v in versions if is_int(v) and 0 <= v <= 999_999})


def incoming(
    source: str, timeout_s: float = 10.0, deadline: float | None = None, scores: SourceScores | None = None
) -> dict[int, int | None]:
    """The versions `source` says it is mirroring now (GET /versions, "incoming"), each with the
    bytes of it the source says it holds so far ("progress", by version as a string; None where
    it gives no figure, as relays before this one did). Empty for a source that does not say, or
    does not answer. Claims only: a worker waits for them while the figures grow
    (install._prefer_relays). Within timeout_s, and by `deadline` (monotonic) if given; a source
    that fails to answer is marked bad in `scores` when given."""
    try:
        data = parse_json(_get_listing(source, timeout_s, deadline), "the answer")
    except SourceFailure as e:
        if scores is not None and not e.late:
            scores.bad(source, f"GET /versions: {e}", corrupt=e.corrupt)
        return {}
    listed = data.get("incoming") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        return {}
    figures = data.get("progress")
    figures = figures if isinstance(figures, dict) else {}
    out: dict[int, int | None] = {}
    for v in listed:
        if is_int(v) and 0 <= v <= 999_999:
            n = figures.get(str(v))
            out[v] = n if is_int(n) and n >= 0 else None
    return out


def fetch_manifest(
    version: int,
    sources: list[str],
    *,
    public_key: str | None,
    timeout_s: float = 10.0,
    expected_digest: str | None = None,
    scores: SourceScores | None = None,
    deadline: float | None = None,
    limit: int = MAX_MANIFEST_BYTES,
) -> dict:
    """The manifest of `version` from the first source (in order) whose answer verifies: signed by
    `public_key` when given, well formed and for `version` otherwise; and with manifest digest
    `expected_digest` when given (to skip copies of a version number that was republished).
    Each answer at most `limit` bytes, in by `deadline` (monotonic) if given; a source that fails
    otherwise than by not holding it (404) is marked bad in `scores` when given."""
    check_version(version)
    vname = version_name(version)
    sources = check_sources(sources, f"fetching the manifest of {vname}")
    if public_key is not None:
        check_public_key(public_key, f"fetching {vname}")
    errors = []
    for src in sources:
        try:
            manifest = parse_json(get_small(src, f"/{vname}/manifest.json", timeout_s, limit, deadline), "the manifest")
            if public_key is not None:
                verify_manifest(manifest, public_key, version)
            else:
                check_manifest_shape(manifest, f"manifest of policy {vname}")
                if manifest["version"] != version:
                    raise SourceFailure(f"the manifest is for {version_name(manifest['version'])}")
            if expected_digest is not None and manifest_digest(manifest) != expected_digest:
                raise SourceFailure(
                    f"it holds another {vname} (manifest digest {manifest_digest(manifest)[:16]}..., "
                    f"expected {expected_digest[:16]}...): a stale copy from before the trainer "
                    "republished it"
                )
            return manifest
        except (SourceFailure, BroadcastError) as e:
            errors.append(f"{src}: {e}")
            if scores is not None and "HTTP 404" not in str(e) and not getattr(e, "late", False):
                scores.bad(src, f"manifest of {vname}: {e}", corrupt=isinstance(e, SourceFailure) and e.corrupt)
    raise BroadcastError(
        f"cannot get a valid manifest of policy {vname} from any source: "
        + "; ".join(errors)
        + ". Check that the sources are running and hold this version (GET <source>/versions), and that the "
        "configured trainer key is right"
    )


def _download_shard(
    src: str, vname: str, index: int, size: int, digest: str, part: Path, final: Path, timeout_s: float, progress=None
) -> int:
    """One attempt at one shard from one source, resuming `part` with a Range request.
    Returns the bytes transferred; SourceFailure (source's fault) or BroadcastError (local).
    `progress(n)`, if given, is called with each chunk's length as it is written."""
    have, h = 0, hashlib.sha256()
    if part.exists():
        try:
            have, h = hash_file(part)
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
    dog = _Deadline(conn, deadline)  # the bound holds however slowly the bytes trickle in
    try:
        try:
            dog.connect()
            conn.request(
                "GET", f"{prefix}/{vname}/shards/{index:05d}", headers={"Range": f"bytes={have}-"} if have else {}
            )
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            if dog.fired:
                raise SourceFailure(f"{what}: too slow (no answer after {time.monotonic() - t0:.1f} s)") from None
            raise SourceFailure(f"no answer for {what} ({e!r})") from e
        if resp.status == 206 and have:
            cr = resp.getheader("Content-Range", "")
            m = CONTENT_RANGE.fullmatch(cr.strip())
            if m is None or tuple(map(int, m.groups())) != (have, size - 1, size):
                raise SourceFailure(
                    f"{what}: Content-Range {cr!r} for bytes={have}-, expected 'bytes {have}-{size - 1}/{size}'",
                    corrupt=True,
                )
            mode = "ab"
        elif resp.status == 200:
            have, h, mode = 0, hashlib.sha256(), "wb"  # no Range, or the source ignored it: start over
            cl = resp.getheader("Content-Length")
            if cl and cl.isdigit() and int(cl) != size:
                raise SourceFailure(f"{what} is {cl} bytes there, the signed manifest says {size}", corrupt=True)
        elif resp.status == 416:
            raise SourceFailure(
                f"{what}: 416 for bytes={have}-: its copy is shorter than the signed manifest says", corrupt=True
            )
        elif resp.status == 404:
            raise SourceFailure(f"{what}: 404 (the source does not hold {vname}: not mirrored yet, or pruned)")
        else:
            raise SourceFailure(f"{what}: HTTP {resp.status} {resp.reason}")
        got, too_long = 0, False
        try:
            f = open(part, mode)
        except OSError as e:
            raise BroadcastError(
                f"fetching {vname} {what}: cannot write {part}: {e}; check free space and "
                "permissions of the destination"
            ) from e
        with f:
            while True:
                try:
                    chunk = resp.read(min(CHUNK, size - have - got + 1))
                except (OSError, http.client.HTTPException) as e:
                    if dog.fired:
                        chunk = b""
                    else:
                        raise SourceFailure(
                            f"{what}: connection lost after {have + got} of {size} bytes ({e!r})"
                        ) from e
                if not chunk:
                    if dog.fired:
                        raise SourceFailure(
                            f"{what}: too slow ({have + got} of {size} bytes after {time.monotonic() - t0:.1f} s)"
                        )
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
                if progress is not None:
                    progress(len(chunk))
                if time.monotonic() > deadline:
                    raise SourceFailure(
                        f"{what}: too slow ({have + got} of {size} bytes after {time.monotonic() - t0:.1f} s)"
                    )
        if too_long:
            part.unlink(missing_ok=True)
            raise SourceFailure(f"{what}: more than the {size} bytes the signed manifest says", corrupt=True)
        if have + got < size:
            raise SourceFailure(f"{what}: transfer ended after {have + got} of {size} bytes")
        if h.hexdigest() != digest:
            part.unlink(missing_ok=True)
            raise SourceFailure(
                f"{what}: sha256 mismatch (got {h.hexdigest()[:16]}..., the signed manifest says {digest[:16]}...)",
                corrupt=True,
            )
        os.replace(part, final)
        return got
    finally:
        dog.stop()
        conn.close()


def download_shards(
    manifest: dict,
    sources: list[str],
    shard_dir,
    *,
    scores: SourceScores | None = None,
    parallel: int = 4,
    timeout_s: float = 10.0,
    tries_per_shard: int | None = None,
    log=lambda msg: None,
    progress=None,
) -> None:
    """Fetch every shard of `manifest` (verified by the caller) into shard_dir/NNNNN, each checked
    against its sha256; see the module doc. BroadcastError after `tries_per_shard` failures of one
    shard. `progress(n)` is called (from the download threads) with the length of each chunk
    written: a relay reports the sum to its clients as it mirrors."""
    where = describe_manifest(manifest, None)
    check_manifest_shape(manifest, where)
    vname = version_name(manifest["version"])
    sources = check_sources(sources, f"fetching {vname}")
    if not is_int(parallel) or parallel < 1:
        raise BroadcastError(f"parallel must be a positive int, got {parallel!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise BroadcastError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    tries = 3 * len(sources) if tries_per_shard is None else tries_per_shard
    if not is_int(tries) or tries < 1:
        raise BroadcastError(f"tries_per_shard must be a positive int, got {tries_per_shard!r}")
    scores = SourceScores() if scores is None else scores
    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)

    todo = []
    for i, s in enumerate(manifest["shards"]):
        final = shard_dir / f"{i:05d}"
        if final.is_file():
            try:
                if sha256_file(final) == (s["size"], s["sha256"]):
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
        for _attempt in range(tries):
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
                n = _download_shard(src, vname, i, s["size"], s["sha256"], part, final, timeout_s, progress)
            except SourceFailure as e:
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
            "source: "
            + "; ".join(f"{u}: {last_error.get(u, 'not tried')}" for u in sources)
            + ". Check that the sources are running, reachable and hold this version (GET <source>/versions); "
            "drop sources that serve corrupt data"
        )

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

    threads = [
        threading.Thread(target=worker, name=f"fetch-{vname}-{k}", daemon=True) for k in range(min(parallel, len(todo)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    missing = [i for i in todo if not (shard_dir / f"{i:05d}").is_file()]
    if missing:  # cannot happen without an error above; never report success for a partial version
        raise BroadcastError(f"fetching {vname}: shards {missing[:5]} missing after the download; try again")
