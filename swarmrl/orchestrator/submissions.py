"""Taking work back: each group's cheap checks (slot, version, sizes, token ids, logprobs,
termination, proofs' format; refusal codes in swarmrl/protocol/reasons.py), trusted scoring, and
recording accepted groups for validation.

Groups without proofs are accepted from trusted keys only (`orchestrator.trusted_keys_file`:
an OpenAI-compatible server cannot build proofs, docs/engines.md); they go to the validator at
`validator.trusted_rate` for a logprob check, the one check such work allows."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmrl.algorithm.advantages import is_informative
from swarmrl.config import Config
from swarmrl.envs import registry as envs
from swarmrl.envs.base import Environment, Reply
from swarmrl.envs.episode import Episode, EpisodeRejected, Responses, chat_framing, replay, respond_here, runs
from swarmrl.model.tokenizer import decode_completion
from swarmrl.orchestrator import curriculum
from swarmrl.orchestrator.admission import (
    Busy,
    GradingLanes,
    Metered,
    Spent,
    extended_expiry,
    is_proven,
    out_of_time,
)
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.errors import ApiError
from swarmrl.orchestrator.gate import Gate
from swarmrl.orchestrator.scoring import score_groups
from swarmrl.orchestrator.store import Store
from swarmrl.orchestrator.validation import ValidationQueue
from swarmrl.proofs.toploc import check_format
from swarmrl.protocol.reasons import FRAUD_REASONS
from swarmrl.protocol.rollouts import Group, Sample
from swarmrl.protocol.rules import termination_problem
from swarmrl.rewards.pool import sendable
from swarmrl.rewards.registry import Graders
from swarmrl.tasks.source import episode_spec, model_input

# How long a lease is kept after its submission was refused for a busy grading lane (429
# grading_busy, Retry-After 1 s): the worker is back well within it, and each refusal moves it on
# (admission.extended_expiry), up to twice the lease time from the lease's start.
BUSY_GRACE_S = 15.0


def check_turn_proofs(smp, hidden_size: int, *, chunk_size: int, topk: int) -> str | None:
    """`check_format` of a sample's proofs: a completion's over its tokens, an episode's turn by
    turn (each model turn has its own chunks, in order; observations have none)."""
    if smp.model_mask is None:
        return check_format(smp.proofs, len(smp.token_ids), hidden_size, chunk_size=chunk_size, topk=topk)
    at = 0
    for k, (start, end, _) in enumerate(r for r in runs(list(smp.model_mask)) if r[2]):
        want = -(-(end - start) // chunk_size)
        problem = check_format(smp.proofs[at : at + want], end - start, hidden_size, chunk_size=chunk_size, topk=topk)
        if problem:
            return f"turn {k}: {problem}"
        at += want
    if at != len(smp.proofs):
        return f"{len(smp.proofs)} proofs; the episode's turns need {at}"
    return None


@dataclass
class EpisodeCheck:
    """What replaying an episode group needs (done in the grading lane, not in the cheap checks)."""

    env: Environment
    task: dict
    seed: int
    max_turns: int
    max_tokens: int


@dataclass
class SlotCheck:
    slot: int
    group: Group | None = None
    reason: str | None = None
    detail: str = ""
    proofs: list | None = None  # per completion, its TOPLOC proofs (base64), kept for the validator
    proofless: bool = False  # a trusted key's group without proofs (logprob checks only)
    episodes: EpisodeCheck | None = None  # an episode group, to replay before it is graded
    claimed: bool = False  # its slot was marked "scoring" (so a refusal after the cheap checks frees it)

    def refuse(self, reason: str, detail: str) -> None:
        self.group, self.reason, self.detail = None, reason, detail


class Submissions:
    """Submissions: the cheap checks, grading, storing accepted groups.

    Owns `_resource_lock`, which serialises the resource graders (the code sandbox is one
    object the grading lanes take turns on), and `_rng` (SystemRandom, safe across threads:
    which groups get the validator's full check, not predictable by workers). The grading lanes
    and graders are handed in (the orchestrator opens and closes them); the lanes have their own
    lock. Slots and groups are in the store: the slots are claimed in one transaction, graded
    outside the store's lock, stored in another. Calls the gate (`is_trusted`) and the
    validation queue (`settled`, `record_fraud`)."""

    def __init__(
        self,
        store: Store,
        cfg: Config,
        rows: Sequence[dict],
        tokenizer,
        counters: Counters,
        gate: Gate,
        validation: ValidationQueue,
        lanes: GradingLanes,
        graders: Graders,
        *,
        vocab_size: int,
        hidden_size: int,
    ):
        self.store, self.cfg, self.rows, self.tokenizer = store, cfg, rows, tokenizer
        self.counters, self.gate, self.validation = counters, gate, validation
        self.lanes, self.graders = lanes, graders
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.stop_ids = [tokenizer.eos_token_id]
        self._rng = random.SystemRandom()
        self._resource_lock = threading.Lock()
        self._framings: dict[str, object] = {}  # observation role -> encoder (a race builds one twice)

    def _check_group(self, g, lease, slot_rows: dict, seen: set, next_step: int, trusted: bool = False) -> SlotCheck:
        s, k = self.cfg.sampling, self.cfg.async_.bound
        # A trusted key may leave out the proofs of a whole group, never some of them.
        proofless = trusted and not any(smp.proofs for smp in g.samples)
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
            return SlotCheck(
                g.slot,
                reason="version_not_in_lease",
                detail=f"policy version {g.policy_version} is outside this lease's "
                f"[{lease['min_version']}, {lease['max_version']}]",
            )
        if g.policy_version < next_step - k:
            return SlotCheck(
                g.slot,
                reason="stale",
                detail=f"policy version {g.policy_version} is older than the async bound allows now ({next_step - k})",
            )
        if len(g.samples) != s.group_size:
            return SlotCheck(
                g.slot, reason="group_size", detail=f"{len(g.samples)} completions, the lease asked for {s.group_size}"
            )
        row = self.rows[slot_rows[g.slot]["problem"]]
        seeds = json.loads(slot_rows[g.slot]["seeds"])
        env = envs.for_task_type(row["task_type"])
        for i, smp in enumerate(g.samples):
            n = len(smp.token_ids)
            if not 1 <= n <= s.max_new_tokens:
                return SlotCheck(
                    g.slot, reason="length", detail=f"completion {i} has {n} tokens; allowed 1..{s.max_new_tokens}"
                )
            if len(smp.logprobs) != n:
                return SlotCheck(
                    g.slot,
                    reason="logprobs_length",
                    detail=f"completion {i}: {len(smp.logprobs)} logprobs for {n} tokens",
                )
            if max(smp.token_ids) >= self.vocab_size:
                return SlotCheck(
                    g.slot,
                    reason="token_out_of_range",
                    detail=f"completion {i} has token id {max(smp.token_ids)} >= vocab size {self.vocab_size}",
                )
            if max(smp.logprobs) > 1e-4 or min(smp.logprobs) < -1e4:
                return SlotCheck(g.slot, reason="bad_logprob", detail=f"completion {i} has a logprob outside [-1e4, 0]")
            claims = [k for k in (smp.model_extra or {}) if "reward" in k.lower()]
            if claims:
                return SlotCheck(
                    g.slot,
                    reason="claimed_reward",
                    detail=f"completion {i} carries {claims[0]!r}: rewards are computed by the "
                    "orchestrator, a worker never sends one",
                )
            if env is not None:
                problem = self._check_episode_shape(i, smp)
                if problem:
                    return SlotCheck(g.slot, reason=problem[0], detail=problem[1])
            elif smp.model_mask is not None:
                return SlotCheck(
                    g.slot,
                    reason="malformed_episode",
                    detail=f"completion {i}: a single-turn prompt takes no model_mask",
                )
            else:
                problem = termination_problem(list(smp.token_ids), smp.finish_reason, self.stop_ids, s.max_new_tokens)
                if problem:
                    return SlotCheck(g.slot, reason="termination", detail=f"completion {i}: {problem}")
            v = self.cfg.validator
            if proofless:
                continue
            refusal = self.validation.engine_refusal(g.engine)
            if refusal:
                return SlotCheck(g.slot, reason="engine_refused", detail=refusal)
            if not smp.proofs:
                detail = f"completion {i} has no TOPLOC proofs"
                if g.engine != "builtin":
                    detail += (
                        f" (groups of the {g.engine!r} engine go without proofs only from keys in the run's "
                        "orchestrator.trusted_keys_file)"
                    )
                return SlotCheck(g.slot, reason="proofs_missing", detail=detail)
            problem = check_turn_proofs(smp, self.hidden_size, chunk_size=v.chunk_size, topk=v.topk)
            if problem:
                return SlotCheck(g.slot, reason="proofs_malformed", detail=f"completion {i}: {problem}")
        claims = [k for k in (g.model_extra or {}) if "reward" in k.lower()]
        if claims:
            return SlotCheck(
                g.slot,
                reason="claimed_reward",
                detail=f"the group carries {claims[0]!r}: rewards are computed by the orchestrator",
            )
        prompt, ids = model_input(self.tokenizer, row["prompt"], slot_rows[g.slot]["target_length"])
        samples = [
            Sample(
                token_ids=list(x.token_ids),
                logprobs=[float(v) for v in x.logprobs],
                finish_reason=x.finish_reason,
                seed=seed,
                model_mask=None if x.model_mask is None else list(x.model_mask),
            )
            for x, seed in zip(g.samples, seeds)
        ]
        group = Group(
            problem_id=row["problem_id"],
            task_type=row["task_type"],
            prompt=prompt,
            verification_info=row["verification_info"],
            prompt_ids=ids,
            samples=samples,
            policy_version=g.policy_version,
            worker=lease["worker"],
            temperature=self.cfg.sampling.temperature,
            target_length=slot_rows[g.slot]["target_length"],
            engine=g.engine,
            engine_dtype=g.dtype,
            env_seed=seeds[0] if env is not None else None,
        )
        episodes = None
        if env is not None:
            spec = episode_spec(self.cfg, row, [seeds[0]])
            episodes = EpisodeCheck(env, spec["task"], seeds[0], spec["max_turns"], spec["max_tokens"])
        return SlotCheck(
            g.slot, group=group, proofs=[list(x.proofs) for x in g.samples], proofless=proofless, episodes=episodes
        )

    def _check_episode_shape(self, i: int, smp) -> tuple[str, str] | None:
        """An episode's mask and termination, cheap enough for the store's transaction: (reason,
        detail) for the first thing wrong. The environment's replay comes later, in the grading
        lane (`_replay`), where its time is bounded and charged."""
        n, mask = len(smp.token_ids), smp.model_mask
        if mask is None:
            return "malformed_episode", f"completion {i}: an episode needs model_mask (protocol v3)"
        if len(mask) != n:
            return "malformed_episode", f"completion {i}: {len(mask)} model_mask entries for {n} tokens"
        if any(lp != 0.0 for lp, m in zip(smp.logprobs, mask) if not m):
            return "malformed_episode", f"completion {i}: an observation token has a logprob (they are 0)"
        want = "stop" if smp.token_ids[-1] in self.stop_ids else "length"
        if smp.finish_reason != want:
            return "termination", f"completion {i}: its last turn ends {want!r}, finish_reason is {smp.finish_reason!r}"
        return None

    def _replay(self, c: SlotCheck, pool) -> None:
        """Replay an episode group's environment on its model turns, in the grading lane: the
        environment's calls run in the lane's pool (its per-call timeout, its memory limit, and for
        an unproven key its metered seconds, checked between calls) when the environment's
        functions can be sent there, else here between checks of the same meter. Any failure
        refuses the group (`c.refuse`); a clean replay fills in each sample's ending."""
        assert c.group is not None and c.episodes is not None
        e = c.episodes
        decode = lambda ids: decode_completion(self.tokenizer, ids, self.stop_ids)  # noqa: E731
        for i, smp in enumerate(c.group.samples):
            assert smp.model_mask is not None
            try:
                done = replay(
                    e.env,
                    e.task,
                    e.seed,
                    Episode(smp.token_ids, smp.model_mask, 0, False),
                    self._framing(e.env),
                    decode,
                    stop_ids=self.stop_ids,
                    max_turns=e.max_turns,
                    max_tokens=e.max_tokens,
                    responses=self._responses(e, pool),
                )
            except EpisodeRejected as err:
                c.refuse(err.reason, f"completion {i}: {err}")
                return
            smp.ended_by_env, smp.tool_errors = done.done, done.tool_errors

    def _responses(self, e: EpisodeCheck, pool) -> Responses:
        """The environment's answers for an episode's turns, from the grading lane's pool when its
        `respond` can be sent there by reference (a module-level function), else in this process."""
        if not sendable(e.env.respond):
            return respond_here(e.env, e.task, e.seed, out_of_time=lambda: out_of_time(pool))

        def responses(prefixes: list[list[str]]) -> list[Reply | EpisodeRejected]:
            outcomes = pool.map(e.env.respond, [(e.task, p, e.seed) for p in prefixes])
            out: list[Reply | EpisodeRejected] = []
            for prefix, o in zip(prefixes, outcomes):
                if o.ok and isinstance(o.value, Reply):
                    out.append(o.value)
                elif o.error is not None and o.error == getattr(pool, "reason", None):
                    out.append(EpisodeRejected("not_graded", o.error))
                else:
                    what = o.error if not o.ok else f"returned {type(o.value).__name__}, not a Reply"
                    detail = f"turn {len(prefix)}: environment {e.env.name!r}: {what}"[:300]
                    out.append(EpisodeRejected("environment_error", detail))
            return out

        return responses

    def _framing(self, env):
        """The observation encoder for `env`'s role, made once (chat_framing renders a template)."""
        role = env.observation_role
        if role not in self._framings:
            self._framings[role] = chat_framing(self.tokenizer, role)
        return self._framings[role]

    def _check_rate(self, db, key: str, proofless: bool) -> float:
        """Chance that a group of `key` gets the full check: trusted keys' proofless groups at
        `trusted_rate`; a key on a clean streak (its last `sample_after` full checks passed,
        no fraud since) at `sampled_rate`; every other key at `rate`. Drawn after the group is
        accepted, from the orchestrator's own generator: a worker cannot tell in advance which
        of its groups will be checked. A key whose evidence leans towards a cheat (validation.py,
        `suspect`) is on no streak: its groups are what the sequential test needs."""
        v = self.cfg.validator
        if proofless:
            return v.trusted_rate
        if self.store.clean_streak(db, key) >= v.sample_after and not self.validation.suspect(db, key):
            return min(v.rate, v.sampled_rate)
        return v.rate

    def _proven(self, key: str) -> bool:
        validated = (self.store.worker(key) or {}).get("validated", 0)
        return is_proven(validated, self.cfg.orchestrator) or self.gate.is_trusted(key)

    def _grade(self, key: str, checks: list[SlotCheck], proven: bool, source: str) -> None:
        """Replay the episode groups among `checks` and score every group still accepted, in a
        grading lane (admission.py: one submission per key at a time, new keys share one lane, and
        their time in it is charged to them and their address); Busy when no lane comes free in
        time, Spent when an unproven key's grading time is used up."""
        with self.lanes.lane(key, proven, source) as pool:
            started = time.monotonic()
            # A resource grader (the code sandbox) is one object the lanes take turns on; only
            # submissions that need it wait for it, and no longer than for a lane. Taken before the
            # replay: a Busy after it would give back slots whose refusals the replay had decided.
            shared = any(c.group is not None and self.graders.get(c.group.task_type) is not None for c in checks)
            if shared and not self._resource_lock.acquire(timeout=self.cfg.orchestrator.grading_wait_s):
                raise Busy("the code sandbox is busy grading another submission")
            try:
                for c in checks:
                    if c.group is not None and c.episodes is not None:
                        self._replay(c, pool)
                groups = [c.group for c in checks if c.group is not None]
                if groups:
                    score_groups(groups, tokenizer=self.tokenizer, pool=pool, cfg=self.cfg, graders=self.graders)
            finally:
                if shared:
                    self._resource_lock.release()
                self.counters.count(f"grading_seconds/{'proven' if proven else 'unproven'}", time.monotonic() - started)
                if isinstance(pool, Metered) and pool.skipped:
                    self.counters.count("grading/not_graded", pool.skipped)

    def _keep_lease(self, db, lease, now: float) -> None:
        """A submission that arrived in time and waits (or waited in vain) for a grading lane keeps
        its lease for BUSY_GRACE_S from `now` (admission.extended_expiry)."""
        longest = 2 * self.cfg.orchestrator.lease_timeout_s
        expires = extended_expiry(lease["expires"], lease["created"], now, BUSY_GRACE_S, longest)
        self.store.extend_lease(db, lease["id"], expires)

    def submit(self, key: str, lease_id: str, groups: list) -> dict:
        now = time.time()
        proven = self._proven(key)
        with self.store.tx() as db:
            lease = self.store.lease_row(db, lease_id)
            if lease is None:
                raise ApiError(404, "unknown_lease", f"no lease {lease_id}")
            if lease["worker"] != key:
                # Not counted against the key: a lease id can reach an honest worker from a
                # malicious orchestrator or a tampered connection, so this proves nothing.
                self.counters.count("rejected/foreign_lease")
                raise ApiError(403, "foreign_lease", f"lease {lease_id} belongs to another worker")
            if lease["state"] == "expired" or lease["expires"] < now:
                self.counters.count("rejected/late")
                raise ApiError(
                    410,
                    "lease_expired",
                    f"lease {lease_id} expired {now - lease['expires']:.1f} s ago; its problems were "
                    "reissued to other workers. Lease again.",
                )
            elif len(groups) > lease["slots"]:
                raise ApiError(422, "too_many_groups", f"{len(groups)} groups for a lease of {lease['slots']} slots")
            else:
                source = lease["source"] or ""
                try:
                    self.lanes.check(key, source, proven)
                except Spent as e:
                    self.counters.count("grading_spent")
                    raise ApiError(
                        429, "grading_spent", f"{e}; retry in {e.retry_after:.0f} s", retry_after=e.retry_after
                    ) from None
                slot_rows = self.store.lease_slots(db, lease_id)
                next_step, _, _ = Store.progress(db)
                seen: set[int] = set()
                trusted = self.gate.is_trusted(key)
                checks = [self._check_group(g, lease, slot_rows, seen, next_step, trusted) for g in groups]
                # Claim the slots before the (slow) scoring, so a concurrent copy of this request is
                # refused at once instead of being scored again.
                for c in checks:
                    if c.group is not None:
                        self.store.mark_slot(db, lease_id, c.slot, "scoring")
                        c.claimed = True
                if any(c.group is not None for c in checks):
                    # It arrived in time: waiting for a lane must not let the lease run out.
                    self._keep_lease(db, lease, now + self.cfg.orchestrator.grading_wait_s)
        try:
            if any(c.claimed for c in checks):
                self._grade(key, checks, proven, source)
        except BaseException as e:
            with self.store.tx() as db:  # give the slots back: the worker may retry
                if isinstance(e, Busy):
                    self._keep_lease(db, lease, time.time())
                current = self.store.lease_row(db, lease_id)
                live = current is not None and current["state"] == "open" and current["expires"] >= time.time()
                for c in checks:
                    if not c.claimed:
                        continue
                    if live:
                        self.store.mark_slot(db, lease_id, c.slot, "open", only_if="scoring")
                    elif self.store.mark_slot(db, lease_id, c.slot, "expired", only_if="scoring"):
                        # The lease expired meanwhile (its expiry skipped slots being scored):
                        # the problem goes back to the pool instead of into a dead lease.
                        self.store.reissue_slot(db, lease_id, c.slot)
            if isinstance(e, Busy):
                self.counters.count("grading_busy")
                raise ApiError(
                    429,
                    "grading_busy",
                    f"{e}; retry in a moment (nothing was lost: the slots stay open, and the lease is kept "
                    f"at least {BUSY_GRACE_S:.0f} s more)",
                    retry_after=1.0,
                ) from None
            if isinstance(e, Spent):  # a concurrent submission of the same address spent it meanwhile
                self.counters.count("grading_spent")
                raise ApiError(
                    429, "grading_spent", f"{e}; retry in {e.retry_after:.0f} s", retry_after=e.retry_after
                ) from None
            raise
        turnaround = (now - lease["created"]) / max(1, lease["slots"])
        accepted, rejected = [], []
        with self.store.tx() as db:
            for c in checks:
                if c.group is None and c.reason not in ("duplicate", "in_progress"):
                    # A refused slot is closed and its problem goes back to the pool: it must not
                    # hold back-pressure capacity until the lease expires.
                    only_if = "scoring" if c.claimed else "open"  # refused in the lane, after the cheap checks
                    if self.store.mark_slot(db, lease_id, c.slot, "rejected", only_if=only_if):
                        self.store.reissue_slot(db, lease_id, c.slot)
                if c.reason == "duplicate" and slot_rows[c.slot]["state"] == "submitted":
                    # A resubmission after a lost reply (the lease is this worker's): answer with
                    # what was stored, and do not count it against an honest worker.
                    row = self.store.stored_group(db, lease_id, c.slot)
                    if row is not None:
                        accepted.append(
                            {
                                "slot": c.slot,
                                "rewards": json.loads(row[0])["rewards"],
                                "informative": bool(row[1]),
                                "already_accepted": True,
                            }
                        )
                        continue
                if c.reason is not None:
                    fraud = self.store.count_rejection(
                        db, key, lease_id, c.slot, c.reason, c.detail, fraud=c.reason in FRAUD_REASONS
                    )
                    rejected.append({"slot": c.slot, "reason": c.reason, "detail": c.detail})
                    self.counters.count(f"rejected/{c.reason}")
                    if c.reason in FRAUD_REASONS:
                        self.validation.record_fraud(db, key, c.reason, c.detail, fraud)
                    continue
                self.store.mark_slot(db, lease_id, c.slot, "submitted")
                g = c.group
                assert g is not None  # every check without a reason holds its group
                g.created, g.gen_seconds = now, turnaround
                informative = bool(is_informative(torch.tensor([g.rewards]))[0])
                full = self._rng.random() < self._check_rate(db, key, c.proofless)
                if c.proofless:
                    self.counters.count("groups_accepted/without_proofs")
                self.store.add_group(
                    db,
                    lease_id,
                    c.slot,
                    key,
                    g.policy_version,
                    now,
                    g.to_json(),
                    informative,
                    "pending" if full else "queued" if informative else "uninformative",
                    json.dumps(c.proofs, separators=(",", ":")),
                )
                if not full:
                    self.validation.settled(db, key, informative, validated=False)
                if (
                    self.cfg.tasks.retire_after
                    and proven
                    and curriculum.record(
                        db,
                        slot_rows[c.slot]["problem"],
                        informative,
                        after=self.cfg.tasks.retire_after,
                        limit=curriculum.max_retired(len(self.rows), self.cfg.tasks.retire_max_share),
                    )
                ):
                    self.counters.count("tasks/retired")
                accepted.append(
                    {
                        "slot": c.slot,
                        "rewards": g.rewards,
                        "informative": informative,
                        "validation": "pending" if full else "cheap checks only",
                    }
                )
            fresh = [a for a in accepted if not a.get("already_accepted")]
            self.store.close_lease_if_settled(db, lease_id)
        self.counters.count("groups_accepted", len(fresh))
        return {"accepted": accepted, "rejected": rejected}
