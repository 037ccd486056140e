"""`swarmrl relay`: an untrusted HTTP mirror of signed, sharded policy versions.

A relay polls its upstreams (the origin, which is the trainer, or other relays: they form a
tree) for new versions, mirrors each one shard by shard with the same downloader clients use
(the manifest verified against the trainer's public key, every shard's sha256 before it is
served), and serves what it holds with a `ShardServer`: HTTP Range requests, a bounded number of
connections, the newest `keep` versions, never deleting a version while a client is still
downloading it.

A relay is untrusted by design: clients check the trainer's signature and every shard
themselves, so a relay that lies only loses its clients' trust (their `SourceScores` drop it).
Its upstreams are untrusted too: a version one of them lists is only a claim. A listed version
whose manifest does not verify, or that cannot be fetched, is skipped (logged once) and asked
of that upstream again only after a backoff, and each upstream may cost a poll at most
`failures_per_poll` failed versions; so bogus version numbers (a huge one nobody can serve, a
forged manifest) never stop the relay from mirroring the real versions.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from swarmrl.protocol.manifest import check_public_key, verify_manifest, version_name
from swarmrl.transport.broadcast import (
    BroadcastError,
    ShardServer,
    SourceScores,
    list_versions,
    mirror_version,
    prune_versions,
    read_versions,
)
from swarmrl.transport.broadcast.common import load_manifest_file, remove_dir

NEED_KEY = (
    "a relay mirrors only versions the trainer signed, so it needs the trainer's public key: pass "
    "--trainer-key <run-dir>/trainer.pub (the file, or the 64 hex characters in it; the trainer writes it "
    "into its run directory), or Relay(..., public_key=...) in code"
)


def require_trainer_key(public_key) -> str:
    """The trainer's public key, checked; BroadcastError saying where to find it when missing."""
    if public_key is None or public_key == "":
        raise BroadcastError(NEED_KEY)
    return check_public_key(public_key, "relay --trainer-key")


class Relay:
    """Mirror `upstreams` into `cache_dir` and serve it (see the module doc). `public_key` (the
    trainer's, 64 hex) is required. A version that failed from an upstream is asked of it again
    after `retry_s`, doubling with each failure up to `max_retry_s`; `max_connections` bounds the
    clients served at once and `max_connections_per_source` those from one address (`ShardServer`)."""

    def __init__(
        self,
        upstreams: list[str],
        cache_dir: str | Path,
        *,
        public_key: str,
        host: str = "127.0.0.1",
        port: int = 0,
        keep: int = 3,
        poll_s: float = 0.5,
        parallel: int = 4,
        timeout_s: float = 10.0,
        max_bytes_per_s: float | None = None,
        max_connections: int = 128,
        max_connections_per_source: int | None = None,
        client_timeout_s: float = 20.0,
        retry_s: float = 5.0,
        max_retry_s: float = 600.0,
        failures_per_poll: int = 2,
        log=print,
        tls=None,
    ):
        if not upstreams:
            raise BroadcastError("a relay needs at least one upstream URL (the origin or another relay)")
        self.public_key = require_trainer_key(public_key)
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.root = Path(cache_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep, self.poll_s = keep, poll_s
        self.parallel, self.timeout_s, self.log = parallel, timeout_s, log
        self.retry_s, self.max_retry_s, self.failures_per_poll = retry_s, max_retry_s, failures_per_poll
        self.server = ShardServer(
            self.root,
            host,
            port,
            max_bytes_per_s=max_bytes_per_s,
            max_connections=max_connections,
            max_connections_per_source=max_connections_per_source,
            client_timeout_s=client_timeout_s,
            tls=tls,
        )
        self.scores = SourceScores()
        self._stop = threading.Event()
        # Versions being mirrored now -> bytes of them written so far, listed by GET /versions as
        # "incoming" with their "progress": workers wait for a copy only while its bytes grow.
        self.mirroring: dict[int, int] = {}
        self._mirroring_lock = threading.Lock()  # the download threads add to it
        self.server.incoming = self._incoming
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None  # the latest problem: an outage, or a version skipped
        # (upstream, version) -> (failures so far, monotonic time before which it is not asked again)
        self._failed: dict[tuple[str, int], tuple[int, float]] = {}
        self.skipped: dict[int, str] = {}  # version -> why it was skipped (each logged once)

    @property
    def url(self) -> str:
        return self.server.url

    def _incoming(self) -> dict[int, int]:
        with self._mirroring_lock:
            return dict(self.mirroring)

    def _progress(self, v: int):
        def add(n: int) -> None:
            with self._mirroring_lock:
                if v in self.mirroring:
                    self.mirroring[v] += n

        return add

    def advertised(self) -> dict[str, set[int]]:
        """The versions each answering upstream lists; BroadcastError naming every upstream if none answers."""
        found: dict[str, set[int]] = {}
        errors = []
        for u in self.upstreams:
            try:
                found[u] = set(list_versions(u, timeout_s=self.timeout_s))
            except BroadcastError as e:
                errors.append(f"{u}: {e}")
        if len(errors) == len(self.upstreams):
            raise BroadcastError("no upstream answered: " + "; ".join(errors))
        return found

    def upstream_versions(self) -> list[int]:
        """Versions any upstream lists (claims, not yet verified)."""
        return sorted(set().union(*self.advertised().values()))

    def sync_once(self) -> list[int]:
        """Mirror the newest `keep` listed versions not held (those still worth holding), oldest
        of them first; skip those that do not verify (see the module doc). The versions mirrored.

        Oldest first because workers move through the versions in order (a lease names the
        version it needs, often not the newest one), and because a version's patch applies to
        the version before it: a relay that fetched v5 before v4 made the workers needing v4
        fetch it from the origin over the same link, and v5 came in full (the rehearsal in
        docs/scale.md). Versions whose every upstream is backing off from them (they did not
        verify) take no place among the `keep`."""
        advertised = self.advertised()
        self._forget(advertised)
        now = time.monotonic()
        held = set(read_versions(self.root))
        failures = dict.fromkeys(self.upstreams, 0)
        wanted = []
        for v in sorted(set().union(*advertised.values()), reverse=True):
            if len(wanted) >= self.keep or sum(h > v for h in held) >= self.keep:
                break  # older than the versions kept: it would be pruned at once
            backing_off = all(
                self._failed.get((u, v), (0, 0.0))[1] > now for u in self.upstreams if v in advertised.get(u, ())
            )
            if v not in held and not backing_off:
                wanted.append(v)
        done = []
        for v in sorted(wanted):
            if sum(h > v for h in held) < self.keep and self._mirror(v, advertised, failures, now):
                held.add(v)
                done.append(v)
        # A LoRA run's versions are adapters on a base (version 0): held as long as they name it,
        # so workers get the base from relays too, not only from the origin.
        bases = self._bases()
        for v in sorted(bases - held):
            if self._mirror(v, advertised, failures, now):
                done.append(v)
        prune_versions(self.root, self.keep, in_use=lambda v: v in bases or self.server.in_use(v))
        return done

    def _mirror(self, v: int, advertised: dict[str, set[int]], failures: dict[str, int], now: float) -> bool:
        """Mirror version v from the upstreams listing it (not backing off from it); True if held now."""
        sources = [
            u
            for u in self.upstreams
            if v in advertised.get(u, ())
            and self._failed.get((u, v), (0, 0.0))[1] <= now
            and failures[u] < self.failures_per_poll
        ]
        if not sources:
            return False
        t0 = time.monotonic()
        with self._mirroring_lock:
            self.mirroring[v] = 0
        try:
            mirror_version(
                v,
                sources,
                self.root,
                public_key=self.public_key,
                scores=self.scores,
                parallel=self.parallel,
                timeout_s=self.timeout_s,
                log=self.log,
                progress=self._progress(v),
            )
        except BroadcastError as e:
            for u in sources:
                failures[u] += 1
                n = self._failed.get((u, v), (0, 0.0))[0] + 1
                backoff = min(self.max_retry_s, self.retry_s * 2 ** min(n - 1, 30))
                self._failed[(u, v)] = (n, time.monotonic() + backoff)
            self._skip(v, sources, str(e))
            return False
        finally:
            with self._mirroring_lock:
                self.mirroring.pop(v, None)
        self.log(f"relay: mirrored {version_name(v)} in {time.monotonic() - t0:.2f} s")
        self.skipped.pop(v, None)
        return True

    def _bases(self) -> set[int]:
        """The versions the held versions' (verified) manifests name as their LoRA base."""
        out = set()
        for v in read_versions(self.root):
            try:
                base = load_manifest_file(self.root / version_name(v) / "manifest.json").get("base")
            except BroadcastError:
                continue
            if isinstance(base, dict) and isinstance(base.get("version"), int):
                out.add(base["version"])
        return out

    def _skip(self, version: int, sources: list[str], why: str) -> None:
        self.last_error = f"{version_name(version)}: {why}"
        if version not in self.skipped:  # once per version, not every poll
            self.log(
                f"relay: skipping {version_name(version)} listed by {', '.join(sources)}: it does not verify or "
                f"cannot be fetched ({why}); mirroring the other versions, will ask again later"
            )
        self.skipped[version] = why

    def _forget(self, advertised: dict[str, set[int]]) -> None:
        """Drop the failure memory of versions an answering upstream no longer lists (bounded memory)."""
        for u, v in list(self._failed):
            if u in advertised and v not in advertised[u]:
                del self._failed[(u, v)]
        listed = set().union(*advertised.values())
        for v in [v for v in self.skipped if v not in listed]:
            del self.skipped[v]

    def drop_unverified(self) -> list[int]:
        """Remove held versions whose manifest does not verify against the trainer key (a cache
        written by another run, or by a relay of an older swarmrl that mirrored unsigned ones)."""
        dropped = []
        for v in read_versions(self.root):
            vdir = self.root / version_name(v)
            try:
                verify_manifest(load_manifest_file(vdir / "manifest.json"), self.public_key, v)
            except BroadcastError as e:
                self.log(f"relay: removing {vdir}: {e}")
                remove_dir(vdir)
                dropped.append(v)
        return dropped

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.sync_once()
                if failing:
                    self.log("relay: upstream reachable again")
                failing = False
            except BroadcastError as e:
                # Keep serving what we hold; say so once per outage, not every poll.
                if not failing:
                    self.log(f"relay: {e}; serving the {len(read_versions(self.root))} versions held, retrying")
                failing, self.last_error = True, str(e)
            except Exception as e:  # noqa: BLE001 - the upstreams are untrusted: nothing they send ends the mirroring
                why = f"{type(e).__name__}: {e}"
                if not failing or why != self.last_error:
                    self.log(f"relay: mirroring failed ({why}); serving the versions held, retrying")
                failing, self.last_error = True, why
            self._stop.wait(self.poll_s)

    def start(self) -> Relay:
        self.drop_unverified()
        self.server.start()
        self._thread = threading.Thread(target=self._loop, name="relay-mirror", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.server.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for_upstream(
    upstreams: list[str], *, tries: int, backoff_s: float = 0.5, timeout_s: float = 5.0, log=print
) -> None:
    """Bounded retries at start: BroadcastError naming the upstreams if none answers `tries` times."""
    last = None
    for attempt in range(tries):
        for u in upstreams:
            try:
                list_versions(u, timeout_s=timeout_s)
                return
            except BroadcastError as e:
                last = e
        if attempt + 1 < tries:
            time.sleep(min(5.0, backoff_s * 2**attempt))
    raise BroadcastError(
        f"no upstream reachable after {tries} tries ({', '.join(upstreams)}); last error: {last}. "
        "Check the URLs and that the origin (the trainer) or the upstream relay is running"
    )


def run_relay(
    upstreams: list[str],
    cache_dir: str,
    *,
    host: str,
    port: int,
    keep: int,
    public_key: str | None,
    startup_tries: int = 10,
    url_file: str | None = None,
    max_bytes_per_s: float | None = None,
    max_connections: int = 128,
    max_connections_per_source: int | None = None,
    client_timeout_s: float = 20.0,
    tls=None,
) -> None:
    """`swarmrl relay`: mirror and serve until interrupted. BroadcastError at once without the trainer key."""
    import json
    import os

    from swarmrl.transport.filesystem import atomic_write_text

    require_trainer_key(public_key)  # before waiting for upstreams: the fix is on this command line
    wait_for_upstream(upstreams, tries=startup_tries)
    relay = Relay(
        upstreams,
        cache_dir,
        host=host,
        port=port,
        keep=keep,
        public_key=public_key,
        max_bytes_per_s=max_bytes_per_s,
        max_connections=max_connections,
        max_connections_per_source=max_connections_per_source,
        client_timeout_s=client_timeout_s,
        tls=tls,
    ).start()
    print(f"relay listening on {relay.url}, mirroring {', '.join(upstreams)} into {cache_dir}", flush=True)
    if url_file:
        atomic_write_text(Path(url_file), json.dumps({"url": relay.url, "pid": os.getpid()}))
    launcher = os.environ.get("SWARMRL_LAUNCHER_PID")
    try:
        while True:
            time.sleep(1.0)
            if launcher and os.getppid() != int(launcher):
                print("relay: the swarmrl rl launcher is gone; stopping", flush=True)
                return
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()
