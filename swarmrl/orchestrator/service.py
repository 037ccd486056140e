"""The orchestrator's logic, independent of HTTP: leases (leasing.py), submissions
(submissions.py), the validation queue (validation.py), batches and policies (batches.py), composed
here with the workers' identities and the run's state.

`app.py` maps requests onto these methods; every refusal is an `ApiError` whose code and message
reach the client as JSON. The rules it enforces:

  * workers never choose problems: a lease names them, with the group size, sampling settings,
    a target length per prompt and a sampling seed per completion, the policy versions allowed,
    and an expiry after which the problems go to someone else;
  * a submission is checked (lease owner, expiry, slot, sizes, token ids, policy version within
    the lease and within the async bound) and then scored here: rewards come only from the
    orchestrator's own verifiers, whatever the worker claims;
  * then it waits for the validator (`validator.rate` of the groups; all of them by default):
    `pending` until a validator claimed it, `validating` while one checks it, and then `queued`
    (or `uninformative`) if it passed, `rejected` if not. Only queued groups reach the trainer;
  * keys in `orchestrator.trusted_keys_file` may submit groups without proofs (an
    OpenAI-compatible server's, docs/engines.md); the validator checks the logprobs of
    `validator.trusted_rate` of those. Every other key's groups must carry proofs;
  * rejections an honest worker cannot get (FRAUD_REASONS) count against the worker; after
    `validator.ban_after` of them its key is refused, its open leases are expired and its
    queued groups go back to the validator for a full check;
  * batch n takes queued groups first in, first out, drops (and counts) those from a policy
    older than n - k, and is frozen in SQLite the moment it is complete.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

from swarmrl.config import Config, read_key_file
from swarmrl.orchestrator.admission import GradingLanes, Standing, allowance, is_proven
from swarmrl.orchestrator.batches import Batches
from swarmrl.orchestrator.errors import ApiError
from swarmrl.orchestrator.leasing import Leasing
from swarmrl.orchestrator.store import Store
from swarmrl.orchestrator.submissions import Submissions
from swarmrl.orchestrator.validation import ValidationQueue
from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.reasons import FRAUD_REASONS
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import open_graders
from swarmrl.tasks.source import task_rows


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


class Orchestrator(Leasing, Submissions, ValidationQueue, Batches):
    """The orchestrator's state and rules; each concern is a mixin in its own module (leasing,
    submissions, validation, batches), all sharing one store, config and set of counters."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, tokenizer, vocab_size: int, hidden_size: int,
                 trainer_token: str, validator_token: str | None = None, pool: VerifierPool | None = None, log=print):
        self.cfg, self.rd = cfg, Path(run_dir)
        self.tokenizer, self.vocab_size, self.hidden_size = tokenizer, vocab_size, hidden_size
        self.trainer_token, self.validator_token = trainer_token, validator_token
        self.stop_ids = [tokenizer.eos_token_id]
        self.rng = random.SystemRandom()  # which groups get the full check: not predictable by workers
        self.log = log
        self.store = Store(self.rd / "orchestrator.sqlite")
        self.rows, _ = task_rows(cfg, log=lambda *_: None)
        # Code tasks need the sandbox: refuse to start (with the fix) rather than score them 0.
        self.graders = open_graders(self.rows, cfg.sandbox, log=log)
        o = cfg.orchestrator
        # Grading lanes: each a verifier pool serving one submission at a time (admission.py).
        pools = [pool] if pool is not None else []
        pools += [VerifierPool(cfg.rewards.verify_workers, cfg.rewards.verify_timeout_s,
                               memory_bytes=cfg.rewards.verify_memory_mb << 20)
                  for _ in range(o.grading_lanes - len(pools))]
        self.lanes = GradingLanes(pools, o.grading_wait_s)
        # A resource grader (the code sandbox) is one object: lanes take turns on it (_grade).
        self.resource_lock = threading.Lock()
        self.run_id = self.store.run_id()
        # Keys refused leases for a while (allowance used up): check_lease_refusal.
        self.refused: dict[str, tuple[float, ApiError]] = {}
        self._allowed: tuple[float, set[str]] | None = None  # (mtime, keys) of allowed_keys_file
        self._trusted: tuple[float, frozenset[str]] = (-1.0, frozenset())  # (mtime, keys) of trusted_keys_file
        if o.trusted_keys_file is not None:
            log(f"trusted keys: {len(self.trusted_keys())} from {o.trusted_keys_file} may submit groups without proofs")
        self.limiter = RateLimiter(o.rate_per_s, o.rate_burst)
        self.sources = RateLimiter(o.requests_per_s_per_source, int(2 * o.requests_per_s_per_source))
        self.registrations = RateLimiter(o.registrations_per_min / 60.0, o.registrations_per_min)
        self.all_registrations = RateLimiter(o.registrations_per_min_total / 60.0, o.registrations_per_min_total)
        self._perms: dict[int, list[int]] = {}
        self.counters: dict[str, float] = {}  # in-process totals for /metrics
        self._counters_lock = threading.Lock()

    def close(self) -> None:
        self.lanes.close()
        self.graders.close()
        self.store.close()

    def _count(self, name: str, by: float = 1.0) -> None:
        with self._counters_lock:
            self.counters[name] = self.counters.get(name, 0.0) + by

    def totals(self) -> dict[str, float]:
        with self._counters_lock:
            return dict(self.counters)

    def trainer_public_key(self) -> str | None:
        """The trainer's broadcast signing key, once the trainer has written it to the run directory."""
        try:
            return (self.rd / "trainer.pub").read_text().strip() or None
        except OSError:
            return None

    # ---- state -------------------------------------------------------------------------------
    def _progress(self, db) -> tuple[int, int | None, bool]:
        return (Store.get_meta(db, "next_step", 0), Store.get_meta(db, "latest_version"),
                Store.get_meta(db, "finished", False))

    def status(self) -> dict:
        with self.store.read() as db:
            next_step, latest, finished = self._progress(db)
            policy = None
            if latest is not None:
                row = self.store.policy(db, latest)
                policy = {"version": latest, "url": row["url"], "manifest": json.loads(row["manifest"])}
        k = self.cfg.async_.bound
        return {"next_step": next_step, "latest_version": latest, "async_bound": k,
                "min_version": max(0, next_step - k), "finished": finished, "policy": policy,
                "total_steps": self.cfg.trainer.steps, "protocol_version": PROTOCOL_VERSION, "run_id": self.run_id}

    # ---- workers -----------------------------------------------------------------------------
    def authenticate(self, key: str, nonce: str, ts: float, *, registering: bool = False,
                     allow_banned: bool = False) -> dict:
        """After the signature checked out: rate, registration, ban and replay checks, cheapest
        first (an unknown or banned key is refused before it can write a nonce row)."""
        wait = self.limiter.take(key)
        if wait:
            raise ApiError(429, "rate_limited", f"too many requests from this key; retry in {wait:.2f} s",
                           retry_after=wait)
        worker = self.store.worker(key)
        if worker is None and not registering:
            raise ApiError(403, "not_registered", "unknown worker key: POST /v1/workers/register first")
        if worker is not None and worker["banned"] and not allow_banned:
            raise ApiError(403, "banned", "this worker key is banned for submitting work that failed validation "
                                          "(POST /v1/workers/me says why)")
        skew = self.cfg.orchestrator.max_clock_skew_s
        if not self.store.use_nonce(key, nonce, ts, forget_before=time.time() - 2 * skew):
            raise ApiError(401, "replayed_nonce", "this nonce was already used by this key: sign every request afresh")
        return worker or {}

    def check_lease_refusal(self, key: str) -> None:
        """A key refused leases a moment ago (its allowance is used up) is refused again from
        memory until its Retry-After has passed: one that ignores Retry-After costs a dict lookup,
        not a nonce write and two transactions. Only leases: it may still submit and ask /me."""
        boxed = self.refused.get(key)
        if boxed is None:
            return
        until, error = boxed
        left = until - time.monotonic()
        if left <= 0:
            self.refused.pop(key, None)
            return
        self._count("refused/remembered")
        raise ApiError(error.status, error.code, error.message, retry_after=left)

    def remember_refusal(self, key: str, error: ApiError) -> None:
        if len(self.refused) >= 100_000:
            self.refused.clear()  # bounded memory; forgetting only costs a transaction per key
        self.refused[key] = (time.monotonic() + error.retry_after, error)

    def admit_source(self, source: str) -> None:
        """Requests per source address, counted before any signature is checked or body parsed."""
        wait = self.sources.take(source)
        if wait:
            self._count("rate_limited/source")
            raise ApiError(429, "rate_limited", f"too many requests from {source}; retry in {wait:.2f} s",
                           retry_after=wait)

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
            self._count("refused/not_invited")
            raise ApiError(403, "not_invited", "this run admits listed keys only (orchestrator.allowed_keys_file); "
                                               f"send your public key {key} to the run's operator")
        if self.store.worker(key) is None:
            # Per source first, so one address flooding fresh keys is stopped before it can use
            # up the bucket every newcomer shares.
            for limiter, bucket, who in ((self.registrations, source, f"from {source}"),
                                         (self.all_registrations, "all", "in all")):
                wait = limiter.take(bucket)
                if wait:
                    self._count("rate_limited/registrations")
                    raise ApiError(429, "rate_limited", f"too many new workers {who}; retry in {wait:.1f} s",
                                   retry_after=wait)

    def register(self, key: str, name: str) -> dict:
        w = self.store.register(key, name)
        self._count("workers_registered")
        return {"worker": key, "name": w["name"], "accepted": w["accepted"], "rejected": w["rejected"]}

    def worker_record(self, key: str) -> dict:
        """What the orchestrator holds against (and for) a worker key."""
        o = self.cfg.orchestrator
        with self.store.read() as db:
            w = self.store.worker(key)
            reasons = self.store.rejection_counts(db, key)
            waiting = self.store.count_groups(db, ("pending", "validating"), worker=key)
            standing = Standing(*self.store.standing(db, key, time.time() - o.penalty_window_s,
                                                     sorted(FRAUD_REASONS)))
        return {"worker": key, "name": w["name"], "accepted": w["accepted"], "rejected": w["rejected"],
                "fraud": w["fraud"], "banned": bool(w["banned"]), "awaiting_validation": waiting,
                "rejections": reasons, "expired_slots": w["expired"],
                "proven": is_proven(w["validated"], o) or self.is_trusted(key), "trusted": self.is_trusted(key),
                "lease_allowance": allowance(standing, o, self.cfg.sampling.worker_batch_prompts)}

    def gauges(self) -> dict[str, float]:
        with self.store.read() as db:
            next_step, latest, _ = self._progress(db)
            counts = self.store.group_state_counts(db)
            open_leases = self.store.open_lease_count(db)
            workers = self.store.worker_count(db)
            banned = self.store.worker_count(db, banned=True)
        return {"next_step": next_step, "latest_version": -1 if latest is None else latest,
                "open_leases": open_leases, "workers": workers, "workers_banned": banned,
                **{f"groups_{s}": float(counts.get(s, 0)) for s in ("queued", "consumed", "stale", "uninformative",
                                                                      "pending", "validating", "rejected")}}
