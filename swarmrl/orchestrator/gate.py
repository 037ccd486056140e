"""Who gets in: request rates per source address and per key, registration (the invitation list
of a closed run, the new keys' rates), the checks after a signature (registered, not banned, a
fresh nonce), the trusted keys, and what the orchestrator holds against a key (POST /v1/workers/me).
docs/security.md says why each limit exists."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from swarmrl.config import Config, read_key_file
from swarmrl.orchestrator.admission import Standing, allowance, is_proven
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.errors import ApiError
from swarmrl.orchestrator.store import Store
from swarmrl.protocol.reasons import FRAUD_REASONS


class RateLimiter:
    """Token bucket per key, in memory (a restart forgives everyone, which is harmless)."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.buckets: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def take(self, key: str, now: float | None = None) -> float:
        """0 if allowed, else seconds until the next request would be."""
        now = time.monotonic() if now is None else now
        with self.lock:
            tokens, last = self.buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens < 1.0:
                self.buckets[key] = (tokens, now)
                return (1.0 - tokens) / self.rate
            if len(self.buckets) >= self.max_keys and key not in self.buckets:
                self.buckets.clear()  # bounded memory under a flood of fresh keys
            self.buckets[key] = (tokens - 1.0, now)
            return 0.0


class Gate:
    """The door checks and the key lists.

    Owns four rate limiters (per key, per source, registrations per source and in all), each
    guarded by its own lock, and the cached contents of `orchestrator.allowed_keys_file` and
    `orchestrator.trusted_keys_file` (`_allowed`, `_trusted`: (mtime, keys), replaced whole,
    without a lock: two threads racing only read the file twice). Workers, nonces and ban
    state are in the store, under its lock."""

    def __init__(self, store: Store, cfg: Config, counters: Counters, log: Callable[[str], None]):
        self.store, self.cfg, self.counters, self.log = store, cfg, counters, log
        o = cfg.orchestrator
        self.limiter = RateLimiter(o.rate_per_s, o.rate_burst)
        self.sources = RateLimiter(o.requests_per_s_per_source, int(2 * o.requests_per_s_per_source))
        self.registrations = RateLimiter(o.registrations_per_min / 60.0, o.registrations_per_min)
        self.all_registrations = RateLimiter(o.registrations_per_min_total / 60.0, o.registrations_per_min_total)
        self._allowed: tuple[float, set[str]] | None = None  # (mtime, keys) of allowed_keys_file
        self._trusted: tuple[float | None, frozenset[str]] = (-1.0, frozenset())  # (mtime, keys) of trusted_keys_file

    def authenticate(
        self, key: str, nonce: str, ts: float, *, registering: bool = False, allow_banned: bool = False
    ) -> dict:
        """After the signature checked out: rate, registration, ban and replay checks, cheapest
        first (an unknown or banned key is refused before it can write a nonce row)."""
        wait = self.limiter.take(key)
        if wait:
            raise ApiError(
                429, "rate_limited", f"too many requests from this key; retry in {wait:.2f} s", retry_after=wait
            )
        worker = self.store.worker(key)
        if worker is None and not registering:
            raise ApiError(403, "not_registered", "unknown worker key: POST /v1/workers/register first")
        if worker is not None and worker["banned"] and not allow_banned:
            raise ApiError(
                403,
                "banned",
                "this worker key is banned for submitting work that failed validation (POST /v1/workers/me says why)",
            )
        skew = self.cfg.orchestrator.max_clock_skew_s
        if not self.store.use_nonce(key, nonce, ts, forget_before=time.time() - 2 * skew):
            raise ApiError(401, "replayed_nonce", "this nonce was already used by this key: sign every request afresh")
        return worker or {}

    def admit_source(self, source: str) -> None:
        """Requests per source address, counted before any signature is checked or body parsed."""
        wait = self.sources.take(source)
        if wait:
            self.counters.count("rate_limited/source")
            raise ApiError(
                429, "rate_limited", f"too many requests from {source}; retry in {wait:.2f} s", retry_after=wait
            )

    def _invited(self, key: str) -> bool:
        """Whether `key` is in orchestrator.allowed_keys_file (always, when there is none)."""
        path = self.cfg.orchestrator.allowed_keys_file
        if path is None:
            return True
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return False  # a closed run whose list is missing admits no one new
        if self._allowed is None or self._allowed[0] != mtime:
            lines = Path(path).read_text().splitlines()
            self._allowed = (mtime, {line.split("#")[0].strip().lower() for line in lines} - {""})
        return key in self._allowed[1]

    def trusted_keys(self) -> frozenset[str]:
        """The keys of orchestrator.trusted_keys_file, read again when the file changes. A file
        gone or broken meanwhile trusts nobody (the safe side) and says so in the log."""
        path = self.cfg.orchestrator.trusted_keys_file
        if path is None:
            return frozenset()
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = None
        if mtime != self._trusted[0]:
            try:
                keys = frozenset(read_key_file(path))
            except ValueError as e:
                self.log(f"trusted keys: {e}; trusting no key until the file is fixed")
                keys = frozenset()
            self._trusted = (mtime, keys)
        return self._trusted[1]

    def is_trusted(self, key: str) -> bool:
        return key in self.trusted_keys()

    def admit_registration(self, key: str, source: str = "local") -> None:
        """Before a registration writes anything (even its nonce): the invitation list of a
        closed run, and for a new key the per-source and total registration rates."""
        if not self._invited(key):
            self.counters.count("refused/not_invited")
            raise ApiError(
                403,
                "not_invited",
                "this run admits listed keys only (orchestrator.allowed_keys_file); "
                f"send your public key {key} to the run's operator",
            )
        if self.store.worker(key) is None:
            # Per source first, so one address flooding fresh keys is stopped before it can use
            # up the bucket every newcomer shares.
            for limiter, bucket, who in (
                (self.registrations, source, f"from {source}"),
                (self.all_registrations, "all", "in all"),
            ):
                wait = limiter.take(bucket)
                if wait:
                    self.counters.count("rate_limited/registrations")
                    raise ApiError(
                        429, "rate_limited", f"too many new workers {who}; retry in {wait:.1f} s", retry_after=wait
                    )

    def register(self, key: str, name: str) -> dict:
        w = self.store.register(key, name)
        self.counters.count("workers_registered")
        return {"worker": key, "name": w["name"], "accepted": w["accepted"], "rejected": w["rejected"]}

    def worker_record(self, key: str) -> dict:
        """What the orchestrator holds against (and for) a worker key."""
        o = self.cfg.orchestrator
        with self.store.read() as db:
            w = self.store.worker(key)
            reasons = self.store.rejection_counts(db, key)
            waiting = self.store.count_groups(db, ("pending", "validating"), worker=key)
            standing = Standing(*self.store.standing(db, key, time.time() - o.penalty_window_s, sorted(FRAUD_REASONS)))
        return {
            "worker": key,
            "name": w["name"],
            "accepted": w["accepted"],
            "rejected": w["rejected"],
            "fraud": w["fraud"],
            "banned": bool(w["banned"]),
            "awaiting_validation": waiting,
            "rejections": reasons,
            "expired_slots": w["expired"],
            "proven": is_proven(w["validated"], o) or self.is_trusted(key),
            "trusted": self.is_trusted(key),
            "lease_allowance": allowance(standing, o, self.cfg.sampling.worker_batch_prompts),
        }
