"""Handing out work: which problems (a seeded permutation per epoch, reissues first), how much
(back-pressure against the async bound and the informative rate), to whom (each key's earned
allowance, and the new keys' caps per source address and in all: admission.py), and expiring
leases nobody submitted (counted against their keys, and an unproven key's against its address)."""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from swarmrl.config import Config
from swarmrl.envs import registry as envs
from swarmrl.orchestrator import curriculum
from swarmrl.orchestrator.admission import (
    Standing,
    UnprovenLimits,
    allowance,
    is_proven,
    lease_size,
    lease_timeout,
    unproven_lease,
)
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.errors import WAITING, ApiError
from swarmrl.orchestrator.gate import Gate
from swarmrl.orchestrator.store import Store
from swarmrl.protocol import EPISODES_SINCE
from swarmrl.protocol.messages import Lease, LeasedPrompt, ProofSpec
from swarmrl.protocol.reasons import FRAUD_REASONS
from swarmrl.tasks.source import episode_spec, model_input


def max_outstanding(cfg: Config) -> int:
    """Groups leased or waiting unconsumed before leasing pauses. In steady state workers and
    trainer run at the same rate, so a deeper queue adds staleness, not throughput: about one
    batch ahead keeps both busy (two batches of groups, since online filtering drops some)."""
    return cfg.async_.max_pending_groups or cfg.sampling.prompts_per_step * min(cfg.async_.bound + 1, 2)


def wants_more_work(
    batches: int, prompts_per_step: int, queued: int, open_slots: int, informative_rate: float | None
) -> bool:
    """Whether one more lease for a policy version is useful. That version can still feed
    `batches` batches of `prompts_per_step` informative groups; `queued` informative groups wait
    already and `open_slots` are leased, of which `informative_rate` are expected to survive
    online filtering (0.5 before anything was scored, floored at 0.2)."""
    rate = 0.5 if informative_rate is None else max(0.2, informative_rate)
    return queued + open_slots * rate < batches * prompts_per_step


@dataclass(frozen=True)
class Unproven:
    """What unproven keys (trusted ones aside) hold now: by lease source, their open slots, and
    their groups awaiting the validator."""

    by_source: dict[str, int]
    open_slots: int
    awaiting: int


class Leasing:
    """Leases: which problems go out, how many, to whom, and their expiry.

    Owns `_perms` (the task order of the current epoch), touched only inside a store
    transaction and so guarded by the store's lock, and `_refused` (keys refused leases a
    moment ago, with until when), a dict without a lock: each access is one dict operation
    (atomic under the GIL), and a race at worst forgets a refusal, which costs a transaction.
    The leases, slots, task cursor and reissued problems are in the store. Calls the gate
    (`is_trusted`); `expire` is called by the validation queue (bans) and batches (a trainer
    going back a version)."""

    def __init__(self, store: Store, cfg: Config, rows: Sequence[dict], tokenizer, counters: Counters, gate: Gate):
        self.store, self.cfg, self.rows, self.tokenizer = store, cfg, rows, tokenizer
        curriculum.ensure_table(store)  # problems retired for giving no signal (tasks.retire_after)
        self.counters, self.gate = counters, gate
        self._perms: dict[int, list[int]] = {}
        self._refused: dict[str, tuple[float, ApiError]] = {}
        # Environments by name for the run's episode rows (a name no process registered stops the
        # orchestrator here, at start, with the registry's message).
        self.environments = sorted({e.name for r in rows if (e := envs.for_task_type(r.get("task_type")))})

    def check_refusal(self, key: str) -> None:
        """A key refused leases a moment ago (its allowance is used up) is refused again from
        memory until its Retry-After has passed: one that ignores Retry-After costs a dict lookup,
        not a nonce write and two transactions. Only leases: it may still submit and ask /me."""
        boxed = self._refused.get(key)
        if boxed is None:
            return
        until, error = boxed
        left = until - time.monotonic()
        if left <= 0:
            self._refused.pop(key, None)
            return
        self.counters.count("refused/remembered")
        raise ApiError(error.status, error.code, error.message, retry_after=left)

    def _remember_refusal(self, key: str, error: ApiError) -> None:
        if len(self._refused) >= 100_000:
            self._refused.clear()  # bounded memory; forgetting only costs a transaction per key
        self._refused[key] = (time.monotonic() + error.retry_after, error)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(len(self.rows)))
            random.Random(f"{self.cfg.seed}-tasks-{epoch}").shuffle(order)
            self._perms = {epoch: order}
        return self._perms[epoch]

    def _next_problems(self, db, n: int) -> list[tuple[int, int | None]]:
        out = self.store.take_reissued(db, n)
        cursor = Store.get_meta(db, "task_cursor", 0)
        length = self.cfg.length
        # Problems retired for giving no signal are skipped (never all of them: curriculum.py).
        skip = curriculum.retired(db) if self.cfg.tasks.retire_after else set()
        while len(out) < n:
            epoch, i = divmod(cursor, len(self.rows))
            target = (
                random.Random(f"{self.cfg.seed}-target-{cursor}").choice(length.targets) if length.enabled else None
            )
            if self._perm(epoch)[i] not in skip:
                out.append((self._perm(epoch)[i], target))
            cursor += 1
        Store.set_meta(db, "task_cursor", cursor)
        return out

    def expire(self, db, now: float) -> None:
        """Inside the caller's transaction: expire the leases past their time (their open slots'
        problems go back to the pool), counting unsubmitted slots against their keys."""
        expired = self.store.expire_leases(db, now)
        if expired:
            self.counters.count("leases_expired", len(expired))
        o = self.cfg.orchestrator
        for _, worker, slots, ran_out, source in expired:
            if ran_out and slots:
                # Unsubmitted work counts against its key's allowance (admission.py): holding a
                # lease must cost a key that never submits. An unproven key's also counts against
                # its address, or a hoarder would just lease again with a fresh key.
                row = self.store.worker(worker)
                unproven = not (row and is_proven(row["validated"], o)) and not self.gate.is_trusted(worker)
                self.store.penalise(db, worker, slots, now, source if unproven else None)
                self.counters.count("slots_expired", slots)

    def _unproven(self, db) -> Unproven:
        trusted = self.gate.trusted_keys()  # count as proven (docs/engines.md)
        by_source: dict[str, int] = {}
        open_slots = awaiting = 0
        for source, worker, leased, scoring, waiting in self.store.unproven_held(
            db, self.cfg.orchestrator.proven_after
        ):
            if worker not in trusted:
                by_source[source] = by_source.get(source, 0) + leased + scoring + waiting
                open_slots += leased
                awaiting += waiting
        return Unproven(by_source, open_slots, awaiting)

    def _admit(self, db, key: str, source: str, unproven: Unproven, now: float) -> tuple[int, dict | None, bool]:
        """How many prompts `key` may lease now (admission.py), or why none: (0, a no-lease reply)
        while it waits for its own work or the new workers' caps (of its source, of all), 429 once
        its allowance is used up; and whether the key is proven (or trusted)."""
        o, s = self.cfg.orchestrator, self.cfg.sampling
        standing = Standing(*self.store.standing(db, key, now - o.penalty_window_s, sorted(FRAUD_REASONS)))
        allowed = allowance(standing, o, s.worker_batch_prompts)
        if allowed == 0:
            raise ApiError(
                429,
                "allowance_exhausted",
                f"this key let {standing.expired_recent} leased prompts expire and had "
                f"{standing.fraud_recent} groups fail validation in the last {o.penalty_window_s:.0f} s, "
                "which used up its lease allowance: submit what you lease before it expires "
                f"(leases last {o.lease_timeout_s:.0f} s), or lease again later",
                retry_after=min(60.0, o.penalty_window_s),
            )
        trusted = self.gate.is_trusted(key)  # counts as proven (docs/engines.md)
        held = standing.leased if trusted else standing.held(o)
        n = lease_size(allowed - held, s.worker_batch_prompts, allowed)
        mine = self.store.open_lease_count(db, key)
        if n == 0 or mine >= o.max_open_leases:
            return (
                0,
                {
                    "lease": None,
                    "retry_after_s": 0.5,
                    "reason": f"this worker holds {held} prompts ({standing.leased} leased in {mine} leases, "
                    f"{held - standing.leased} awaiting validation; its allowance is {allowed}): "
                    "submit them first, or wait for the validator",
                },
                False,
            )
        proven = trusted or is_proven(standing.validated, o)
        if not proven:
            limits = UnprovenLimits.of(o, max(max_outstanding(self.cfg), s.prompts_per_step), s.worker_batch_prompts)
            expired = self.store.source_expired(db, source, now - o.penalty_window_s)
            n, why = unproven_lease(n, source, unproven.by_source, expired, limits)
            if why is not None:
                return (
                    0,
                    {
                        "lease": None,
                        "retry_after_s": 1.0,
                        "reason": f"{why}; a key is proven after {o.proven_after} groups passed validation",
                    },
                    False,
                )
        return n, None, proven

    def _informative_rate(self, db, window: int = 256) -> float | None:
        rate, n = self.store.recent_informative(db, window)
        return rate if n >= 16 else None

    def lease(self, key: str, policy_version: int, source: str = "local", protocol_version: int = 2) -> dict:
        """A lease for `key`, asked from `source` (transport/connlimit.py source_of: its address, an IPv6 /64)
        by a worker speaking `protocol_version`."""
        if self.environments and protocol_version < EPISODES_SINCE:
            # Such a worker would answer each episode's first turn and stop: work the replay
            # refuses as fraud. Refused before any lease, with what to do.
            raise ApiError(
                409,
                "protocol_too_old",
                f"this run's tasks are multi-turn episodes ({', '.join(self.environments)}), which workers "
                f"speaking protocol v{EPISODES_SINCE} or newer play; this worker speaks v{protocol_version}: "
                "upgrade swarmrl",
            )
        now = time.time()
        with self.store.tx() as db:
            # Its own transaction: the refusals below roll theirs back, expiries must stay done.
            self.expire(db, now)
        try:
            return self._lease(key, policy_version, source, now)
        except ApiError as e:
            if e.code == "allowance_exhausted":
                self._remember_refusal(key, e)
            raise

    def _lease(self, key: str, policy_version: int, source: str, now: float) -> dict:
        cfg, s = self.cfg, self.cfg.sampling
        with self.store.tx() as db:
            next_step, latest, finished = Store.progress(db)
            if finished:
                raise ApiError(409, "run_finished", "the run is finished; nothing more to sample")
            lo = max(0, next_step - cfg.async_.bound)
            if latest is None or lo > latest:
                return {
                    "lease": None,
                    "retry_after_s": 0.2,
                    "reason": f"waiting for policy version {lo} to be published",
                }
            if not lo <= policy_version <= latest:
                raise ApiError(
                    409,
                    "version_not_allowed",
                    f"policy version {policy_version} is outside the allowed range [{lo}, {latest}]: "
                    f"fetch version {latest} (GET /v1/status says where)",
                )
            unproven = self._unproven(db)
            n, no_lease, proven = self._admit(db, key, source, unproven, now)
            if no_lease is not None:
                return no_lease
            # A lease costs a free key nothing to hold, nor does garbage it submits: counted here,
            # hoarders would take that much capacity from proven workers (as would a flood of
            # unproven groups awaiting the validator: CI saw honest workers refused with "16 groups
            # wait for the trainer and 0 are leased"), and keys from a few addresses would keep a
            # newcomer from another out. Unproven keys' slots and groups awaiting the validator
            # have their own caps (_admit), so back-pressure counts proven work only (the total may
            # exceed the limit by the unproven share and reserve).
            queued = self.store.count_groups(db, WAITING) - unproven.awaiting
            open_slots = self.store.open_slot_count(db) - unproven.open_slots
            # Lease while below the limit (not "if the lease fits"): with fewer informative groups
            # queued than a batch needs and nothing leased, a lease must always be possible.
            outstanding = queued + open_slots
            if outstanding >= max(max_outstanding(cfg), s.prompts_per_step):
                validating = self.store.count_groups(db, ("pending", "validating")) - unproven.awaiting
                return {
                    "lease": None,
                    "retry_after_s": 0.1,
                    "reason": f"{queued} groups wait for the trainer ({validating} of them for the validator) "
                    f"and {open_slots} are leased",
                }
            # Work sampled with version v can only feed batches up to v + k. Once what is queued or
            # leased covers those batches (at the informative rate seen lately), more work with v
            # would be dropped as stale: wait for a newer version instead.
            batches = policy_version + cfg.async_.bound - next_step + 1
            if not wants_more_work(batches, s.prompts_per_step, queued, open_slots, self._informative_rate(db)):
                return {
                    "lease": None,
                    "retry_after_s": 0.1,
                    "reason": f"{queued} groups queued and {open_slots} leased already cover the batches "
                    f"version {policy_version} can still feed; waiting for a newer version",
                }
            lease_id = secrets.token_hex(16)
            expires = now + lease_timeout(cfg.orchestrator.lease_timeout_s, n, s.worker_batch_prompts)
            self.store.create_lease(db, lease_id, key, now, expires, lo, latest, n, source)
            prompts = []
            for slot, (problem, target) in enumerate(self._next_problems(db, n)):
                row = self.rows[problem]
                seeds = [secrets.randbits(63) for _ in range(s.group_size)]
                self.store.add_slot(db, lease_id, slot, problem, target, json.dumps(seeds))
                prompt, ids = model_input(self.tokenizer, row["prompt"], target)
                prompts.append(
                    {
                        "slot": slot,
                        "problem_id": row["problem_id"],
                        "task_type": row["task_type"],
                        "prompt": prompt,
                        "prompt_ids": ids,
                        "target_length": target,
                        "seeds": seeds,
                        "environment": episode_spec(cfg, row, seeds),
                    }
                )
        self.counters.count("leases_issued")
        lease = Lease(
            lease_id=lease_id,
            expires_at=expires,
            expires_in_s=expires - now,
            min_version=lo,
            max_version=latest,
            group_size=s.group_size,
            temperature=s.temperature,
            max_new_tokens=s.max_new_tokens,
            dtype=s.dtype,
            proof=ProofSpec(chunk_size=cfg.validator.chunk_size, topk=cfg.validator.topk),
            prompts=[LeasedPrompt(**p) for p in prompts],
        )
        return {"lease": lease.model_dump()}
