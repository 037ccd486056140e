"""`swarmrl relay`: an untrusted HTTP mirror of signed, sharded policy versions.

A relay polls its upstreams (the origin, which is the trainer, or other relays: they form a
tree) for new versions, mirrors each one shard by shard with the same downloader clients use
(verifying every shard's sha256 before it is served, and the trainer's signature when it was
given the trainer's public key), and serves what it holds with a `ShardServer`: HTTP Range
requests, one thread per request, the newest `keep` versions, never deleting a version while a
client is still downloading it.

A relay is untrusted by design: clients check the trainer's signature and every shard
themselves, so a relay that lies only loses its clients' trust (their `SourceScores` drop it).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from swarmrl.transport.broadcast import (
    BroadcastError,
    ShardServer,
    SourceScores,
    list_versions,
    mirror_version,
    prune_versions,
    read_versions,
)


class Relay:
    def __init__(self, upstreams: list[str], cache_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 keep: int = 3, poll_s: float = 0.5, public_key: str | None = None, parallel: int = 4,
                 timeout_s: float = 10.0, max_bytes_per_s: float | None = None, log=print):
        if not upstreams:
            raise BroadcastError("a relay needs at least one upstream URL (the origin or another relay)")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.root = Path(cache_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep, self.poll_s, self.public_key = keep, poll_s, public_key
        self.parallel, self.timeout_s, self.log = parallel, timeout_s, log
        self.server = ShardServer(self.root, host, port, max_bytes_per_s=max_bytes_per_s)
        self.scores = SourceScores()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def upstream_versions(self) -> list[int]:
        """Versions any upstream holds; BroadcastError naming every upstream if none answers."""
        found: set[int] = set()
        errors = []
        for u in self.upstreams:
            try:
                found.update(list_versions(u, timeout_s=self.timeout_s))
            except BroadcastError as e:
                errors.append(f"{u}: {e}")
        if len(errors) == len(self.upstreams):
            raise BroadcastError("no upstream answered: " + "; ".join(errors))
        return sorted(found)

    def sync_once(self) -> list[int]:
        """Mirror the newest `keep` upstream versions not held yet; the versions mirrored."""
        available = self.upstream_versions()
        held = set(read_versions(self.root))
        wanted = [v for v in available[-self.keep:] if v not in held]
        done = []
        for v in wanted:
            t0 = time.monotonic()
            mirror_version(v, self.upstreams, self.root, public_key=self.public_key, scores=self.scores,
                           parallel=self.parallel, timeout_s=self.timeout_s, log=self.log)
            self.log(f"relay: mirrored v{v:06d} in {time.monotonic() - t0:.2f} s")
            done.append(v)
        prune_versions(self.root, self.keep, in_use=self.server.in_use)
        return done

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.sync_once()
                if failing:
                    self.log("relay: upstream reachable again")
                failing, self.last_error = False, None
            except BroadcastError as e:
                # Keep serving what we hold; say so once per outage, not every poll.
                if not failing:
                    self.log(f"relay: {e}; serving the {len(read_versions(self.root))} versions held, retrying")
                failing, self.last_error = True, str(e)
            self._stop.wait(self.poll_s)

    def start(self) -> Relay:
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


def wait_for_upstream(upstreams: list[str], *, tries: int, backoff_s: float = 0.5, timeout_s: float = 5.0,
                      log=print) -> None:
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
    raise BroadcastError(f"no upstream reachable after {tries} tries ({', '.join(upstreams)}); last error: {last}. "
                         "Check the URLs and that the origin (the trainer) or the upstream relay is running")


def run_relay(upstreams: list[str], cache_dir: str, *, host: str, port: int, keep: int, public_key: str | None,
              startup_tries: int = 10, url_file: str | None = None, max_bytes_per_s: float | None = None) -> None:
    """`swarmrl relay`: mirror and serve until interrupted."""
    import json
    import os

    from swarmrl.transport.filesystem import atomic_write_text

    wait_for_upstream(upstreams, tries=startup_tries)
    relay = Relay(upstreams, cache_dir, host=host, port=port, keep=keep, public_key=public_key,
                  max_bytes_per_s=max_bytes_per_s).start()
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
