"""The orchestrator's logic, independent of HTTP: leases, submissions, batches, policies.

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
  * rejections an honest worker cannot get (FRAUD_REASONS) count against the worker; after
    `validator.ban_after` of them its key is refused, its open leases are expired and its
    queued groups go back to the validator for a full check;
  * batch n takes queued groups first in, first out, drops (and counts) those from a policy
    older than n - k, and is frozen in SQLite the moment it is complete.
"""

from __future__ import annotations

import json
import random
import secrets
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmrl.algorithm.advantages import is_informative
from swarmrl.config import Config
from swarmrl.orchestrator.scoring import score_groups
from swarmrl.orchestrator.store import Store
from swarmrl.proofs.toploc import check_format
from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.messages import Lease, LeasedPrompt, ProofSpec
from swarmrl.protocol.reasons import FRAUD_REASONS
from swarmrl.protocol.rollouts import Group, Sample
from swarmrl.protocol.rules import termination_problem
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import open_graders
from swarmrl.tasks.source import model_input, task_rows


# Group states that will (most likely) become queued: back-pressure counts them as queued.
WAITING = ("queued", "pending", "validating")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


def max_outstanding(cfg: Config) -> int:
    """Groups leased or waiting unconsumed before leasing pauses. In steady state workers and
    trainer run at the same rate, so a deeper queue adds staleness, not throughput: about one
    batch ahead keeps both busy (two batches of groups, since online filtering drops some)."""
    return cfg.async_.max_pending_groups or cfg.sampling.prompts_per_step * min(cfg.async_.bound + 1, 2)


def wants_more_work(batches: int, prompts_per_step: int, queued: int, open_slots: int,
                    informative_rate: float | None) -> bool:
    """Whether one more lease for a policy version is useful. That version can still feed
    `batches` batches of `prompts_per_step` informative groups; `queued` informative groups wait
    already and `open_slots` are leased, of which `informative_rate` are expected to survive
    online filtering (0.5 before anything was scored, floored at 0.2)."""
    rate = 0.5 if informative_rate is None else max(0.2, informative_rate)
    return queued + open_slots * rate < batches * prompts_per_step


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


@dataclass
class SlotCheck:
    slot: int
    group: Group | None = None
    reason: str | None = None
    detail: str = ""
    proofs: list | None = None  # per completion, its TOPLOC proofs (base64), kept for the validator


def batch_metrics(step: int, taken: list[Group], resolved: list[Group], stale: int, cfg: Config) -> dict:
    """Training-batch metrics: `taken` are the batch's groups, `resolved` the scored groups this
    batch settled (taken and uninformative), so accuracy is measured before filtering; `stale`
    counts groups dropped for the async bound."""
    rewards = [r for g in taken for r in g.rewards]
    lengths = [len(s.token_ids) for g in taken for s in g.samples]
    staleness = [step - g.policy_version for g in taken]
    scored = [g for g in resolved if g.task_rewards]
    all_task = [r for g in scored for r in g.task_rewards]
    m = {
        "time/generation": sum(g.gen_seconds for g in resolved),
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        # Accuracy over everything sampled (before filtering), the honest training signal.
        "reward/task_mean_all": statistics.fmean(all_task) if all_task else float("nan"),
        "reward/task_mean": statistics.fmean(r for g in taken for r in g.task_rewards),
        "length/mean": statistics.fmean(lengths),
        "length/max": float(max(lengths)),
        "length/truncated_frac": statistics.fmean(float(s.finish_reason == "length") for g in taken for s in g.samples),
        "off_policy/max": float(max(staleness)),
        "off_policy/mean": statistics.fmean(staleness),
        "off_policy/dropped": float(stale),
        "batch/uninformative_groups": float(len(resolved) - len(taken)),
        "batch/scored_groups": float(len(scored)),
        "batch/generated_tokens": float(sum(lengths)),
    }
    if cfg.length.enabled:
        targets = [g.target_length for g in taken for _ in g.samples]
        m["length/target_mean"] = statistics.fmean(targets)
        m["length/abs_error_mean"] = statistics.fmean(abs(n - t) for n, t in zip(lengths, targets))
    return m


class Orchestrator:
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
        self.pool = pool or VerifierPool(cfg.rewards.verify_workers, cfg.rewards.verify_timeout_s)
        self.score_lock = threading.Lock()  # the verifier pool serves one caller at a time
        o = cfg.orchestrator
        self.limiter = RateLimiter(o.rate_per_s, o.rate_burst)
        self.registrations = RateLimiter(o.registrations_per_min / 60.0, o.registrations_per_min)
        self._perms: dict[int, list[int]] = {}
        self.counters: dict[str, float] = {}  # in-process totals for /metrics
        self._counters_lock = threading.Lock()

    def close(self) -> None:
        self.pool.close()
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
        with self.store.lock:
            db = self.store.db
            next_step, latest, finished = self._progress(db)
            policy = None
            if latest is not None:
                row = db.execute("SELECT * FROM policies WHERE version = ?", (latest,)).fetchone()
                policy = {"version": latest, "url": row["url"], "manifest": json.loads(row["manifest"])}
        k = self.cfg.async_.bound
        return {"next_step": next_step, "latest_version": latest, "async_bound": k,
                "min_version": max(0, next_step - k), "finished": finished, "policy": policy,
                "total_steps": self.cfg.trainer.steps, "protocol_version": PROTOCOL_VERSION}

    # ---- workers -----------------------------------------------------------------------------
    def authenticate(self, key: str, nonce: str, ts: float, *, registering: bool = False,
                     allow_banned: bool = False) -> dict:
        """After the signature checked out: replay, rate, registration and ban checks."""
        wait = self.limiter.take(key)
        if wait:
            raise ApiError(429, "rate_limited", f"too many requests from this key; retry in {wait:.2f} s",
                           retry_after=wait)
        skew = self.cfg.orchestrator.max_clock_skew_s
        if not self.store.use_nonce(key, nonce, ts, forget_before=time.time() - 2 * skew):
            raise ApiError(401, "replayed_nonce", "this nonce was already used by this key: sign every request afresh")
        worker = self.store.worker(key)
        if worker is None and not registering:
            raise ApiError(403, "not_registered", "unknown worker key: POST /v1/workers/register first")
        if worker is not None and worker["banned"] and not allow_banned:
            raise ApiError(403, "banned", "this worker key is banned for submitting work that failed validation "
                                          "(POST /v1/workers/me says why)")
        return worker or {}

    def register(self, key: str, name: str) -> dict:
        if self.store.worker(key) is None:
            wait = self.registrations.take("all")
            if wait:
                raise ApiError(429, "rate_limited", f"too many new workers; retry in {wait:.1f} s", retry_after=wait)
        w = self.store.register(key, name)
        self._count("workers_registered")
        return {"worker": key, "name": w["name"], "accepted": w["accepted"], "rejected": w["rejected"]}

    # ---- leases ------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(len(self.rows)))
            random.Random(f"{self.cfg.seed}-tasks-{epoch}").shuffle(order)
            self._perms = {epoch: order}
        return self._perms[epoch]

    def _next_problems(self, db, n: int) -> list[tuple[int, int | None]]:
        out = [(r["problem"], r["target_length"]) for r in
               db.execute("SELECT * FROM reissue ORDER BY id LIMIT ?", (n,)).fetchall()]
        if out:
            db.execute("DELETE FROM reissue WHERE id IN (SELECT id FROM reissue ORDER BY id LIMIT ?)", (len(out),))
        cursor = Store.get_meta(db, "task_cursor", 0)
        length = self.cfg.length
        while len(out) < n:
            epoch, i = divmod(cursor, len(self.rows))
            target = random.Random(f"{self.cfg.seed}-target-{cursor}").choice(length.targets) if length.enabled else None
            out.append((self._perm(epoch)[i], target))
            cursor += 1
        Store.set_meta(db, "task_cursor", cursor)
        return out

    def _expire(self, db, now: float) -> None:
        expired = db.execute("SELECT id FROM leases WHERE state = 'open' AND expires < ?", (now,)).fetchall()
        for (lease_id,) in expired:
            for row in db.execute("SELECT * FROM slots WHERE lease_id = ? AND state = 'open'", (lease_id,)).fetchall():
                db.execute("INSERT INTO reissue (problem, target_length) VALUES (?, ?)",
                           (row["problem"], row["target_length"]))
            db.execute("UPDATE slots SET state = 'expired' WHERE lease_id = ? AND state = 'open'", (lease_id,))
            db.execute("UPDATE leases SET state = 'expired' WHERE id = ?", (lease_id,))
        if expired:
            self._count("leases_expired", len(expired))

    @staticmethod
    def _informative_rate(db, window: int = 256) -> float | None:
        row = db.execute("SELECT AVG(informative), COUNT(*) FROM (SELECT informative FROM groups "
                         "ORDER BY id DESC LIMIT ?)", (window,)).fetchone()
        return row[0] if row[1] >= 16 else None

    def lease(self, key: str, policy_version: int) -> dict:
        cfg, s = self.cfg, self.cfg.sampling
        now = time.time()
        with self.store.tx() as db:
            self._expire(db, now)
            next_step, latest, finished = self._progress(db)
            if finished:
                raise ApiError(409, "run_finished", "the run is finished; nothing more to sample")
            lo = max(0, next_step - cfg.async_.bound)
            if latest is None or lo > latest:
                return {"lease": None, "retry_after_s": 0.2,
                        "reason": f"waiting for policy version {lo} to be published"}
            if not lo <= policy_version <= latest:
                raise ApiError(409, "version_not_allowed",
                               f"policy version {policy_version} is outside the allowed range [{lo}, {latest}]: "
                               f"fetch version {latest} (GET /v1/status says where)")
            queued = db.execute("SELECT COUNT(*) FROM groups WHERE state IN (?, ?, ?)", WAITING).fetchone()[0]
            open_slots = db.execute("SELECT COUNT(*) FROM slots JOIN leases ON slots.lease_id = leases.id "
                                    "WHERE slots.state = 'open' AND leases.state = 'open'").fetchone()[0]
            n = s.worker_batch_prompts
            # Lease while below the limit (not "if the lease fits"): with fewer informative groups
            # queued than a batch needs and nothing leased, a lease must always be possible.
            outstanding = queued + open_slots
            if outstanding >= max(max_outstanding(cfg), s.prompts_per_step):
                return {"lease": None, "retry_after_s": 0.1,
                        "reason": f"{queued} groups wait for the trainer and {open_slots} are leased"}
            # Work sampled with version v can only feed batches up to v + k. Once what is queued or
            # leased covers those batches (at the informative rate seen lately), more work with v
            # would be dropped as stale: wait for a newer version instead.
            batches = policy_version + cfg.async_.bound - next_step + 1
            if not wants_more_work(batches, s.prompts_per_step, queued, open_slots, self._informative_rate(db)):
                return {"lease": None, "retry_after_s": 0.1,
                        "reason": f"{queued} groups queued and {open_slots} leased already cover the batches "
                                  f"version {policy_version} can still feed; waiting for a newer version"}
            mine = db.execute("SELECT COUNT(*) FROM leases WHERE worker = ? AND state = 'open'", (key,)).fetchone()[0]
            if mine >= cfg.orchestrator.max_open_leases:
                return {"lease": None, "retry_after_s": 0.5,
                        "reason": f"this worker holds {mine} open leases; submit them first"}
            lease_id = secrets.token_hex(16)
            expires = now + cfg.orchestrator.lease_timeout_s
            db.execute("INSERT INTO leases (id, worker, created, expires, min_version, max_version, slots, state) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, 'open')", (lease_id, key, now, expires, lo, latest, n))
            prompts = []
            for slot, (problem, target) in enumerate(self._next_problems(db, n)):
                row = self.rows[problem]
                seeds = [secrets.randbits(63) for _ in range(s.group_size)]
                db.execute("INSERT INTO slots (lease_id, slot, problem, target_length, seeds, state) "
                           "VALUES (?, ?, ?, ?, ?, 'open')", (lease_id, slot, problem, target, json.dumps(seeds)))
                prompt, ids = model_input(self.tokenizer, row["prompt"], target)
                prompts.append({"slot": slot, "problem_id": row["problem_id"], "task_type": row["task_type"],
                                "prompt": prompt, "prompt_ids": ids, "target_length": target, "seeds": seeds})
        self._count("leases_issued")
        lease = Lease(lease_id=lease_id, expires_at=expires, expires_in_s=expires - now, min_version=lo,
                      max_version=latest, group_size=s.group_size, temperature=s.temperature,
                      max_new_tokens=s.max_new_tokens,
                      proof=ProofSpec(chunk_size=cfg.validator.chunk_size, topk=cfg.validator.topk),
                      prompts=[LeasedPrompt(**p) for p in prompts])
        return {"lease": lease.model_dump()}

    # ---- submissions -------------------------------------------------------------------------
    def _check_group(self, g, lease, slot_rows: dict, seen: set, next_step: int) -> SlotCheck:
        s, k = self.cfg.sampling, self.cfg.async_.bound
        if g.slot not in slot_rows:
            return SlotCheck(g.slot, reason="bad_slot", detail=f"lease has slots 0..{len(slot_rows) - 1}, not {g.slot}")
        state = slot_rows[g.slot]["state"]
        if g.slot in seen or state == "submitted":
            return SlotCheck(g.slot, reason="duplicate", detail=f"slot {g.slot} was already submitted")
        if state == "scoring":
            seen.add(g.slot)
            return SlotCheck(g.slot, reason="in_progress", detail=f"slot {g.slot} is being scored from another request")
        seen.add(g.slot)
        if state != "open":
            return SlotCheck(g.slot, reason="slot_closed", detail=f"slot {g.slot} is {state}")
        if not lease["min_version"] <= g.policy_version <= lease["max_version"]:
            return SlotCheck(g.slot, reason="version_not_in_lease",
                             detail=f"policy version {g.policy_version} is outside this lease's "
                                    f"[{lease['min_version']}, {lease['max_version']}]")
        if g.policy_version < next_step - k:
            return SlotCheck(g.slot, reason="stale", detail=f"policy version {g.policy_version} is older than "
                                                            f"the async bound allows now ({next_step - k})")
        if len(g.samples) != s.group_size:
            return SlotCheck(g.slot, reason="group_size",
                             detail=f"{len(g.samples)} completions, the lease asked for {s.group_size}")
        for i, smp in enumerate(g.samples):
            n = len(smp.token_ids)
            if not 1 <= n <= s.max_new_tokens:
                return SlotCheck(g.slot, reason="length",
                                 detail=f"completion {i} has {n} tokens; allowed 1..{s.max_new_tokens}")
            if len(smp.logprobs) != n:
                return SlotCheck(g.slot, reason="logprobs_length",
                                 detail=f"completion {i}: {len(smp.logprobs)} logprobs for {n} tokens")
            if max(smp.token_ids) >= self.vocab_size:
                return SlotCheck(g.slot, reason="token_out_of_range",
                                 detail=f"completion {i} has token id {max(smp.token_ids)} >= vocab size {self.vocab_size}")
            if max(smp.logprobs) > 1e-4 or min(smp.logprobs) < -1e4:
                return SlotCheck(g.slot, reason="bad_logprob",
                                 detail=f"completion {i} has a logprob outside [-1e4, 0]")
            claims = [k for k in (smp.model_extra or {}) if "reward" in k.lower()]
            if claims:
                return SlotCheck(g.slot, reason="claimed_reward",
                                 detail=f"completion {i} carries {claims[0]!r}: rewards are computed by the "
                                        "orchestrator, a worker never sends one")
            problem = termination_problem(list(smp.token_ids), smp.finish_reason, self.stop_ids, s.max_new_tokens)
            if problem:
                return SlotCheck(g.slot, reason="termination", detail=f"completion {i}: {problem}")
            v = self.cfg.validator
            if not smp.proofs:
                return SlotCheck(g.slot, reason="proofs_missing", detail=f"completion {i} has no TOPLOC proofs")
            problem = check_format(smp.proofs, n, self.hidden_size, chunk_size=v.chunk_size, topk=v.topk)
            if problem:
                return SlotCheck(g.slot, reason="proofs_malformed", detail=f"completion {i}: {problem}")
        claims = [k for k in (g.model_extra or {}) if "reward" in k.lower()]
        if claims:
            return SlotCheck(g.slot, reason="claimed_reward",
                             detail=f"the group carries {claims[0]!r}: rewards are computed by the orchestrator")
        row = self.rows[slot_rows[g.slot]["problem"]]
        seeds = json.loads(slot_rows[g.slot]["seeds"])
        prompt, ids = model_input(self.tokenizer, row["prompt"], slot_rows[g.slot]["target_length"])
        samples = [Sample(list(x.token_ids), [float(v) for v in x.logprobs], x.finish_reason, seed)
                   for x, seed in zip(g.samples, seeds)]
        group = Group(row["problem_id"], row["task_type"], prompt, row["verification_info"], ids, samples,
                      g.policy_version, lease["worker"], self.cfg.sampling.temperature,
                      slot_rows[g.slot]["target_length"])
        return SlotCheck(g.slot, group=group, proofs=[list(x.proofs) for x in g.samples])

    def submit(self, key: str, lease_id: str, groups: list) -> dict:
        now = time.time()
        foreign = False
        with self.store.tx() as db:
            lease = db.execute("SELECT * FROM leases WHERE id = ?", (lease_id,)).fetchone()
            if lease is None:
                raise ApiError(404, "unknown_lease", f"no lease {lease_id}")
            if lease["worker"] != key:
                fraud = self.store.count_rejection(db, key, lease_id, None, "foreign_lease", "lease of another worker",
                                                   fraud=True)
                self._maybe_ban(db, key, fraud)
                foreign = True
            elif lease["state"] == "expired" or lease["expires"] < now:
                self._count("rejected/late")
                raise ApiError(410, "lease_expired",
                               f"lease {lease_id} expired {now - lease['expires']:.1f} s ago; its problems were "
                               "reissued to other workers. Lease again.")
            elif len(groups) > lease["slots"]:
                raise ApiError(422, "too_many_groups", f"{len(groups)} groups for a lease of {lease['slots']} slots")
            else:
                slot_rows = {r["slot"]: r for r in db.execute("SELECT * FROM slots WHERE lease_id = ?", (lease_id,))}
                next_step, _, _ = self._progress(db)
                seen: set[int] = set()
                checks = [self._check_group(g, lease, slot_rows, seen, next_step) for g in groups]
                # Claim the slots before the (slow) scoring, so a concurrent copy of this request is
                # refused at once instead of being scored again.
                for c in checks:
                    if c.group is not None:
                        db.execute("UPDATE slots SET state = 'scoring' WHERE lease_id = ? AND slot = ?",
                                   (lease_id, c.slot))
        if foreign:
            self._count("rejected/foreign_lease")
            raise ApiError(403, "foreign_lease", f"lease {lease_id} belongs to another worker")
        good = [c.group for c in checks if c.group is not None]
        try:
            if good:
                with self.score_lock:
                    score_groups(good, tokenizer=self.tokenizer, pool=self.pool, cfg=self.cfg, graders=self.graders)
        except BaseException:
            with self.store.tx() as db:  # give the slots back: the worker may retry
                for c in checks:
                    if c.group is not None:
                        db.execute("UPDATE slots SET state = 'open' WHERE lease_id = ? AND slot = ? AND "
                                   "state = 'scoring'", (lease_id, c.slot))
            raise
        turnaround = (now - lease["created"]) / max(1, lease["slots"])
        accepted, rejected = [], []
        with self.store.tx() as db:
            for c in checks:
                if c.group is None and c.reason not in ("duplicate", "in_progress"):
                    # A refused slot is closed and its problem goes back to the pool: it must not
                    # hold back-pressure capacity until the lease expires.
                    closed = db.execute("UPDATE slots SET state = 'rejected' WHERE lease_id = ? AND slot = ? "
                                        "AND state = 'open'", (lease_id, c.slot)).rowcount
                    if closed:
                        db.execute("INSERT INTO reissue (problem, target_length) SELECT problem, target_length "
                                   "FROM slots WHERE lease_id = ? AND slot = ?", (lease_id, c.slot))
                if c.reason == "duplicate" and slot_rows[c.slot]["state"] == "submitted":
                    # A resubmission after a lost reply (the lease is this worker's): answer with
                    # what was stored, and do not count it against an honest worker.
                    row = db.execute("SELECT payload, informative FROM groups WHERE lease_id = ? AND slot = ?",
                                     (lease_id, c.slot)).fetchone()
                    if row is not None:
                        accepted.append({"slot": c.slot, "rewards": json.loads(row[0])["rewards"],
                                         "informative": bool(row[1]), "already_accepted": True})
                        continue
                if c.reason is not None:
                    fraud = self.store.count_rejection(db, key, lease_id, c.slot, c.reason, c.detail,
                                                       fraud=c.reason in FRAUD_REASONS)
                    rejected.append({"slot": c.slot, "reason": c.reason, "detail": c.detail})
                    self._count(f"rejected/{c.reason}")
                    if c.reason in FRAUD_REASONS:
                        self._log_rejection(db, key, c.reason, c.detail)
                        self._maybe_ban(db, key, fraud)
                    continue
                db.execute("UPDATE slots SET state = 'submitted' WHERE lease_id = ? AND slot = ?", (lease_id, c.slot))
                g = c.group
                g.created, g.gen_seconds = now, turnaround
                informative = bool(is_informative(torch.tensor([g.rewards]))[0])
                full = self.rng.random() < self.cfg.validator.rate
                db.execute("INSERT INTO groups (lease_id, slot, worker, policy_version, accepted, payload, "
                           "informative, state, proofs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (lease_id, c.slot, key, g.policy_version, now, g.to_json(), int(informative),
                            "pending" if full else "queued" if informative else "uninformative",
                            json.dumps(c.proofs, separators=(",", ":"))))
                if not full:
                    self._settled(db, key, informative)
                accepted.append({"slot": c.slot, "rewards": g.rewards, "informative": informative,
                                 "validation": "pending" if full else "cheap checks only"})
            fresh = [a for a in accepted if not a.get("already_accepted")]
            if not db.execute("SELECT 1 FROM slots WHERE lease_id = ? AND state IN ('open', 'scoring')",
                              (lease_id,)).fetchone():
                db.execute("UPDATE leases SET state = 'done' WHERE id = ? AND state = 'open'", (lease_id,))
        self._count("groups_accepted", len(fresh))
        return {"accepted": accepted, "rejected": rejected}

    # ---- validation --------------------------------------------------------------------------
    def _settled(self, db, key: str, informative: bool) -> None:
        """A group passed every check it was given: it counts for its worker and the streak."""
        db.execute("UPDATE workers SET accepted = accepted + 1 WHERE key = ?", (key,))
        streak = 0 if informative else Store.get_meta(db, "uninformative_streak", 0) + 1
        Store.set_meta(db, "uninformative_streak", streak)

    def _name(self, db, key: str) -> str:
        row = db.execute("SELECT name FROM workers WHERE key = ?", (key,)).fetchone()
        return f"{row[0] if row else '?'} ({key[:12]}…)"

    def _log_rejection(self, db, key: str, reason: str, detail: str) -> None:
        self.log(f"rejected: worker {self._name(db, key)}: {reason}: {detail}")

    def _maybe_ban(self, db, key: str, fraud: int) -> None:
        """Ban a worker once its fraud count reaches the limit: refuse its key from now on, give
        its open leases' problems to others, and send its not-yet-trained groups back to the
        validator for a full check (groups that got only the cheap checks included)."""
        if fraud < self.cfg.validator.ban_after:
            return
        if not db.execute("UPDATE workers SET banned = 1 WHERE key = ? AND banned = 0", (key,)).rowcount:
            return
        db.execute("UPDATE leases SET expires = 0 WHERE worker = ? AND state = 'open'", (key,))
        self._expire(db, time.time())
        # Everything not yet trained or counted in a batch's metrics; each was counted as accepted,
        # and is again only if it passes.
        recheck = db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE worker = ? AND "
                             "(state = 'queued' OR (state = 'uninformative' AND resolved_step IS NULL))",
                             (key,)).rowcount
        db.execute("UPDATE workers SET accepted = accepted - ? WHERE key = ?", (recheck, key))
        self._count("workers_banned")
        self.log(f"banned: worker {self._name(db, key)} after {fraud} fraudulent groups; "
                 f"{recheck} of its queued groups go back to the validator")

    @staticmethod
    def _validation_metrics(db) -> dict[str, float]:
        m = {f"rejected/{reason}": float(n) for reason, n in
             db.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason").fetchall()}
        m["workers/banned"] = float(db.execute("SELECT COUNT(*) FROM workers WHERE banned = 1").fetchone()[0])
        m["validator/pending"] = float(db.execute("SELECT COUNT(*) FROM groups WHERE state IN ('pending', 'validating')")
                                       .fetchone()[0])
        return m

    def claim_validation(self, max_groups: int) -> dict:
        """Up to `max_groups` pending groups for a validator, with the policies they claim."""
        cfg = self.cfg
        now = time.time()
        with self.store.tx() as db:
            next_step, _, _ = self._progress(db)
            lo = max(0, next_step - cfg.async_.bound)
            # Claims of a validator that died go back to the queue.
            db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE state = 'validating' AND claimed < ?",
                       (now - cfg.validator.claim_timeout_s,))
            # Work too old to be trained now needs no check: it is dropped like any stale group.
            stale = db.execute("UPDATE groups SET state = 'stale', resolved_step = ? WHERE state = 'pending' "
                               "AND policy_version < ?", (next_step, lo)).rowcount
            if stale:
                self._count("off_policy_dropped", stale)
            rows = db.execute("SELECT id, worker, policy_version, payload, proofs FROM groups WHERE state = 'pending' "
                              "ORDER BY id LIMIT ?", (max_groups,)).fetchall()
            if rows:
                marks = ",".join("?" * len(rows))
                db.execute(f"UPDATE groups SET state = 'validating', claimed = ? WHERE id IN ({marks})",
                           (now, *[r["id"] for r in rows]))
            versions = sorted({r["policy_version"] for r in rows})
            policies = {}
            for v in versions:
                prow = db.execute("SELECT url, manifest FROM policies WHERE version = ?", (v,)).fetchone()
                if prow is not None:
                    policies[str(v)] = {"url": prow["url"], "manifest": json.loads(prow["manifest"])}
        items = []
        for r in rows:
            g = json.loads(r["payload"])
            proofs = json.loads(r["proofs"] or "[]")
            items.append({"id": r["id"], "worker": r["worker"], "policy_version": r["policy_version"],
                          "temperature": g["temperature"], "prompt_ids": g["prompt_ids"],
                          "samples": [{"token_ids": smp["token_ids"], "logprobs": smp["logprobs"], "seed": smp["seed"],
                                       "proofs": proofs[i] if i < len(proofs) else []}
                                      for i, smp in enumerate(g["samples"])]})
        self._count("validator/claimed", len(items))
        return {"items": items, "policies": policies, "min_version": lo, "config": cfg.validator.model_dump()}

    def record_verdicts(self, verdicts: list[dict], retry: list[int] = ()) -> dict:
        """Apply a validator's verdicts: passed groups join the queue, failed ones are rejected
        (fraud) against their worker; `retry` ids go back to pending (their policy could not be
        loaded just now)."""
        recorded = 0
        with self.store.tx() as db:
            for v in verdicts:
                row = db.execute("SELECT worker, lease_id, slot, informative, state FROM groups WHERE id = ?",
                                 (v["id"],)).fetchone()
                if row is None or row["state"] not in ("validating", "pending"):
                    continue  # a verdict for a group already settled (e.g. a second validator's)
                recorded += 1
                verdict = json.dumps({"ok": v["ok"], "reason": v.get("reason"), "stats": v.get("stats", {})})
                if v["ok"]:
                    state = "queued" if row["informative"] else "uninformative"
                    db.execute("UPDATE groups SET state = ?, verdict = ? WHERE id = ?", (state, verdict, v["id"]))
                    self._settled(db, row["worker"], bool(row["informative"]))
                    self._count("validator/passed")
                    continue
                reason = v.get("reason") or "validation"
                db.execute("UPDATE groups SET state = 'rejected', verdict = ? WHERE id = ?", (verdict, v["id"]))
                # The problem goes back to the pool, as for a slot refused at submission.
                db.execute("INSERT INTO reissue (problem, target_length) SELECT problem, target_length "
                           "FROM slots WHERE lease_id = ? AND slot = ?", (row["lease_id"], row["slot"]))
                fraud = self.store.count_rejection(db, row["worker"], row["lease_id"], row["slot"], reason,
                                                   v.get("detail", ""), fraud=True)
                self._count(f"rejected/{reason}")
                self._log_rejection(db, row["worker"], reason, v.get("detail", ""))
                self._maybe_ban(db, row["worker"], fraud)
            for gid in retry:
                db.execute("UPDATE groups SET state = 'pending', claimed = NULL WHERE id = ? AND state = 'validating'",
                           (gid,))
        return {"recorded": recorded}

    def worker_record(self, key: str) -> dict:
        """What the orchestrator holds against (and for) a worker key."""
        with self.store.lock:
            db = self.store.db
            w = db.execute("SELECT * FROM workers WHERE key = ?", (key,)).fetchone()
            reasons = dict(db.execute("SELECT reason, COUNT(*) FROM rejections WHERE worker = ? GROUP BY reason",
                                      (key,)).fetchall())
            waiting = db.execute("SELECT COUNT(*) FROM groups WHERE worker = ? AND state IN ('pending', 'validating')",
                                 (key,)).fetchone()[0]
        return {"worker": key, "name": w["name"], "accepted": w["accepted"], "rejected": w["rejected"],
                "fraud": w["fraud"], "banned": bool(w["banned"]), "awaiting_validation": waiting,
                "rejections": reasons}

    # ---- trainer -----------------------------------------------------------------------------
    def build_batch(self, step: int) -> dict:
        """Batch `step`: the frozen batch if it exists, else build it now if enough informative
        groups wait, else report what is missing (the trainer polls)."""
        cfg = self.cfg
        want, k = cfg.sampling.prompts_per_step, cfg.async_.bound
        with self.store.tx() as db:
            row = db.execute("SELECT * FROM batches WHERE step = ?", (step,)).fetchone()
            if row is not None:
                return self._batch_response(db, row)
            next_step, _, _ = self._progress(db)
            if step != next_step:
                raise ApiError(409, "wrong_step", f"batch {step} cannot be built: the next batch is {next_step}")
            streak = Store.get_meta(db, "uninformative_streak", 0)
            if streak >= cfg.sampling.uninformative_limit:
                rows = db.execute("SELECT payload FROM groups WHERE state = 'uninformative' ORDER BY id DESC LIMIT ?",
                                  (streak,)).fetchall()
                rewards = [r for (p,) in rows for r in json.loads(p)["task_rewards"]]
                mean = statistics.fmean(rewards) if rewards else float("nan")
                raise ApiError(409, "no_signal",
                               f"the last {streak} groups all had equal rewards (mean task reward {mean:.2f}), "
                               "so GRPO has no signal: the policy solves none (or all) of these tasks. Use a "
                               "stronger base model (model.path, or more sft.steps), easier/harder tasks, or a "
                               "larger group_size.")
            oldest = step - k
            stale = db.execute("UPDATE groups SET state = 'stale', resolved_step = ? WHERE state = 'queued' "
                               "AND policy_version < ?", (step, oldest)).rowcount
            if stale:
                self._count("off_policy_dropped", stale)
            ids = [r[0] for r in db.execute("SELECT id FROM groups WHERE state = 'queued' ORDER BY id LIMIT ?",
                                            (want,)).fetchall()]
            if len(ids) < want:
                return {"ready": False, "step": step, "queued": len(ids), "needed": want}
            marks = ",".join("?" * len(ids))
            db.execute(f"UPDATE groups SET state = 'consumed', step = ?, resolved_step = ? WHERE id IN ({marks})",
                       (step, step, *ids))
            db.execute("UPDATE groups SET resolved_step = ? WHERE state = 'uninformative' AND resolved_step IS NULL",
                       (step,))
            taken = [Group.from_json(p) for (p,) in db.execute(
                f"SELECT payload FROM groups WHERE id IN ({marks}) ORDER BY id", ids).fetchall()]
            resolved = [Group.from_json(p) for (p,) in db.execute(
                "SELECT payload FROM groups WHERE resolved_step = ? AND state != 'stale'", (step,)).fetchall()]
            n_stale = db.execute("SELECT COUNT(*) FROM groups WHERE resolved_step = ? AND state = 'stale'",
                                 (step,)).fetchone()[0]
            metrics = batch_metrics(step, taken, resolved, n_stale, cfg)
            metrics["off_policy/dropped_total"] = float(
                db.execute("SELECT COUNT(*) FROM groups WHERE state = 'stale'").fetchone()[0])
            metrics.update(self._validation_metrics(db))
            db.execute("INSERT INTO batches (step, group_ids, metrics, created) VALUES (?, ?, ?, ?)",
                       (step, json.dumps(ids), json.dumps(metrics), time.time()))
            Store.set_meta(db, "next_step", step + 1)
            row = db.execute("SELECT * FROM batches WHERE step = ?", (step,)).fetchone()
            self._count("batches_built")
            return self._batch_response(db, row)

    @staticmethod
    def _batch_response(db, row) -> dict:
        ids = json.loads(row["group_ids"])
        marks = ",".join("?" * len(ids))
        payloads = db.execute(f"SELECT id, payload FROM groups WHERE id IN ({marks}) ORDER BY id", ids).fetchall()
        return {"ready": True, "step": row["step"], "group_ids": ids,
                "groups": [json.loads(p) for _, p in payloads], "metrics": json.loads(row["metrics"])}

    def publish(self, version: int, url: str, manifest: dict) -> dict:
        """The trainer announces its current version. It is the authority: a trainer resumed from
        an older checkpoint moves `latest_version` back (its newer versions are being redone)."""
        with self.store.tx() as db:
            db.execute("INSERT INTO policies (version, url, manifest, published) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT(version) DO UPDATE SET url = excluded.url, manifest = excluded.manifest, "
                       "published = excluded.published", (version, url, json.dumps(manifest), time.time()))
            latest = Store.get_meta(db, "latest_version")
            if latest is not None and version < latest:
                # A trainer resumed from an older checkpoint: versions above `version` will be
                # rebuilt with other weights, so work sampled with the old ones is dropped.
                next_step = Store.get_meta(db, "next_step", 0)
                dropped = db.execute("UPDATE groups SET state = 'stale', resolved_step = ? WHERE state IN (?, ?, ?) "
                                     "AND policy_version > ?", (next_step, *WAITING, version)).rowcount
                db.execute("UPDATE leases SET expires = ? WHERE state = 'open' AND max_version > ?", (0.0, version))
                self._expire(db, time.time())
                self.log(f"trainer went back to version {version} (was {latest}): {dropped} queued groups dropped")
            Store.set_meta(db, "latest_version", version)
            Store.set_meta(db, "finished", False)  # a trainer publishing means the run is live (resumed)
            db.execute("DELETE FROM policies WHERE version < ?", (version - self.cfg.async_.bound - 8,))
        self._count("policies_published")
        return {"latest_version": version}

    def reopen(self) -> None:
        """A resumed run: workers started before the trainer's first publication must not see the
        old run's "finished" and leave."""
        with self.store.tx() as db:
            Store.set_meta(db, "finished", False)

    def finish(self) -> dict:
        with self.store.tx() as db:
            Store.set_meta(db, "finished", True)
        return {"finished": True}

    def gauges(self) -> dict[str, float]:
        with self.store.lock:
            db = self.store.db
            next_step, latest, _ = self._progress(db)
            counts = dict(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
            open_leases = db.execute("SELECT COUNT(*) FROM leases WHERE state = 'open'").fetchone()[0]
            workers = db.execute("SELECT COUNT(*) FROM workers").fetchone()[0]
            banned = db.execute("SELECT COUNT(*) FROM workers WHERE banned = 1").fetchone()[0]
        return {"next_step": next_step, "latest_version": -1 if latest is None else latest,
                "open_leases": open_leases, "workers": workers, "workers_banned": banned,
                **{f"groups_{s}": float(counts.get(s, 0)) for s in ("queued", "consumed", "stale", "uninformative",
                                                                      "pending", "validating", "rejected")}}
