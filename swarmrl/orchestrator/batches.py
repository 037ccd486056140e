"""The trainer's side: batch n built from queued groups first in, first out (stale ones dropped
and counted) and frozen in SQLite, published policy versions, the end of the run."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from swarmrl.config import Config
from swarmrl.envs.episode import Episode, episode_metrics, runs
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.errors import WAITING, ApiError
from swarmrl.orchestrator.leasing import Leasing
from swarmrl.orchestrator.retention import is_summary, prune_payloads, prune_through, release_free_pages
from swarmrl.orchestrator.store import Store
from swarmrl.orchestrator.validation import ValidationQueue
from swarmrl.protocol.rollouts import Group


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
    # Episodes (all sampled, before filtering): turns, tool calls, tool errors, observation share.
    m.update(
        episode_metrics(
            [
                Episode(
                    s.token_ids,
                    s.model_mask,
                    sum(1 for r in runs(s.model_mask) if r[2]),
                    bool(s.ended_by_env),
                    s.tool_errors,
                )
                for g in resolved
                for s in g.samples
                if s.model_mask is not None
            ]
        )
    )
    if cfg.length.enabled:
        targets = [g.target_length for g in taken for _ in g.samples]
        m["length/target_mean"] = statistics.fmean(targets)
        m["length/abs_error_mean"] = statistics.fmean(abs(n - t) for n, t in zip(lengths, targets))
    return m


def no_signal_message(
    *, streak: int, seen: int, all_equal: int, groups: list[Group], accuracy_before: float | None, cfg: Config
) -> str:
    """Why a run stops for lack of signal, and what to change: the last `streak` groups in a row
    had all-equal rewards (`groups`: the newest of them), `all_equal` of the `seen` groups so far
    did, `accuracy_before` is the trainer's held-out accuracy before RL if it reported one."""
    g = cfg.sampling.group_size
    task = [r for grp in groups for r in grp.task_rewards]
    mean = statistics.fmean(task) if task else float("nan")
    never = sum(1 for grp in groups if grp.task_rewards and max(grp.task_rewards) <= 0.0)
    always = sum(1 for grp in groups if grp.task_rewards and min(grp.task_rewards) >= 1.0)
    samples = [s for grp in groups for s in grp.samples]
    truncated = sum(s.finish_reason == "length" for s in samples) / max(1, len(samples))
    share = f"{all_equal} of the {seen} groups sampled so far, {all_equal / max(1, seen):.0%}"
    limit = cfg.sampling.no_signal_limit()
    how = "set" if cfg.sampling.uninformative_limit is not None else "this run's default"
    lines = [
        f"no GRPO signal: the last {streak} groups in a row had all-equal rewards across their {g} completions "
        f"({share}), and no batch can be built from such groups; the run stops here rather than wait for one "
        f"(sampling.uninformative_limit: {limit} in a row, {how})."
    ]
    n = len(groups)
    solves_all = n > 0 and always == n
    if solves_all:
        cause = "every completion scored 1: the policy solves all of these tasks, so there is nothing left to learn"
    elif n > 0 and never == n:
        cause = "every completion scored 0: the policy never earns a reward on these tasks"
    elif never + always == n:
        cause = (
            f"of the last {n} groups, {never} scored 0 throughout and {always} scored 1 throughout: "
            "each prompt is either always solved or never"
        )
    else:
        cause = (
            "the rewards are equal within each group but not all 0 or 1: a reward that does not vary "
            "between completions of a prompt (check the task's grader, and the length reward if enabled)"
        )
    lines.append(f"Cause: mean task reward {mean:.2f} in those groups; {cause}.")
    if accuracy_before is not None:
        lines.append(f"Held-out accuracy before RL: {accuracy_before:.3f} (eval/accuracy at step 0).")
    if truncated >= 0.5 and not solves_all:
        lines.append(
            f"{truncated:.0%} of their completions stopped at sampling.max_new_tokens = "
            f"{cfg.sampling.max_new_tokens} before giving an answer: raise it."
        )
    if solves_all:
        lines.append(
            "Fixes: harder tasks (e.g. a higher tasks.digits, or tasks.solve_rate_range keeping rows a "
            "model does not always solve); if the held-out accuracy is high too, this policy is done."
        )
    else:
        lines += [
            "Fixes, one or more:",
            "  - an easier task, or a stronger base model (model.path), so that some completions of a prompt succeed;",
            "  - a format warm start (a short supervised pass such as `swarmrl sft`) if the completions never write "
            "their answer in the graded form (math tasks grade the last \\boxed{...} after </think>);",
            "  - for a model without a reasoning format, a looser answer extraction (the last number it writes, "
            "say): a task type of your own in tasks.types that reads the answer the model does write "
            "(docs/architecture.md, 'How to add a task type');",
            f"  - a larger sampling.group_size (now {g}): a task solved with probability p gives a group with "
            f"signal with probability 1 - p^g - (1-p)^g.",
        ]
    # The command as the user can paste it: this run's folder and tasks where the config names them.
    run_dir = cfg.run_dir or "<run-dir>"
    # A mix is evaluated source by source: name its first (`--benchmark` takes one built-in set).
    tasks = next(iter(cfg.tasks.mix)) if cfg.tasks.mix else cfg.tasks.source
    lines.append(
        f"To see what the policy writes and why it scores what it does: swarmrl eval --config {run_dir}/config.toml "
        f"--model {run_dir}/policies/v000000 --benchmark {tasks} --limit 8 --output-dir <dir> "
        "(results.jsonl holds each completion with its reward and reason)."
    )
    return "\n".join(lines)


class Batches:
    """The trainer's side: batches, published policy versions, finished or not.

    Owns no state in memory: batches, policies and the run's progress (next step, newest
    version, finished) are in the store, each change one store transaction (its lock). Calls
    the validation queue (`metrics`, for a batch's metrics) and leasing (`expire`, when the
    trainer goes back a version)."""

    def __init__(
        self,
        store: Store,
        cfg: Config,
        counters: Counters,
        validation: ValidationQueue,
        leasing: Leasing,
        log: Callable[[str], None],
    ):
        self.store, self.cfg, self.counters, self.log = store, cfg, counters, log
        self.validation, self.leasing = validation, leasing

    def build_batch(self, step: int) -> dict:
        """Batch `step`: the frozen batch if it exists, else build it now if enough informative
        groups wait, else report what is missing (the trainer polls), or refuse with no_signal
        once the last `sampling.no_signal_limit()` groups in a row all had all-equal rewards."""
        cfg = self.cfg
        want, k = cfg.sampling.prompts_per_step, cfg.async_.bound
        refusal: str | None = None
        with self.store.tx() as db:
            row = self.store.batch(db, step)
            if row is not None:
                return self._batch_response(db, row)
            next_step, _, _ = Store.progress(db)
            if step != next_step:
                raise ApiError(409, "wrong_step", f"batch {step} cannot be built: the next batch is {next_step}")
            oldest = step - k
            stale = self.store.drop_older(db, ("queued",), oldest, step)
            if stale:
                self.counters.count("off_policy_dropped", stale)
            ids = self.store.queued_ids(db, want)
            frozen = self._freeze(db, step, ids) if len(ids) == want else None
            if frozen is None:
                signal = self._signal(db)
                refusal = self._no_signal(db, signal)
                if refusal is None:
                    return {"ready": False, "step": step, "queued": len(ids), "needed": want, **signal}
        if frozen is not None:
            release_free_pages(self.store)  # what pruning freed goes back to the file system
            return frozen
        # Raised once the transaction has committed: the stale groups it dropped stay dropped.
        raise ApiError(409, "no_signal", refusal)

    def _freeze(self, db, step: int, ids: list[int]) -> dict:
        """Build batch `step` from queued groups `ids` and freeze it (inside build_batch's transaction)."""
        self.store.consume(db, ids, step)
        self.store.resolve_uninformative(db, step)
        taken = [Group.from_json(p) for p in self.store.payloads(db, ids)]
        resolved = [Group.from_json(p) for p in self.store.resolved_payloads(db, step)]
        n_stale = self.store.resolved_stale_count(db, step)
        metrics = batch_metrics(step, taken, resolved, n_stale, self.cfg)
        metrics["off_policy/dropped_total"] = float(self.store.count_groups(db, ("stale",)))
        metrics.update(self.validation.metrics(db))
        self.store.save_batch(db, step, json.dumps(ids), json.dumps(metrics), time.time())
        Store.set_meta(db, "next_step", step + 1)
        keep = self.cfg.orchestrator.keep_payload_steps
        through = None if keep == "all" else prune_through(step, self.cfg.trainer.checkpoint_every, keep)
        if through is not None:  # in this transaction: a kill -9 leaves the batch and its pruning, or neither
            pruned, freed = prune_payloads(db, through)
            if pruned:
                self.counters.count("groups_pruned", pruned)
                self.counters.count("payload_bytes_pruned", freed)
        row = self.store.batch(db, step)
        self.counters.count("batches_built")
        return self._batch_response(db, row)

    def _signal(self, db) -> dict:
        """What a trainer waiting for a batch is told about the signal: groups that passed their
        checks so far, how many had all-equal rewards, the current streak of those and the limit."""
        streak = Store.get_meta(db, "uninformative_streak", 0)
        return {
            "groups_seen": max(Store.get_meta(db, "groups_settled", 0), streak),
            "groups_all_equal": max(Store.get_meta(db, "groups_all_equal", 0), streak),
            "all_equal_streak": streak,
            "all_equal_limit": self.cfg.sampling.no_signal_limit(),
        }

    def _no_signal(self, db, signal: dict) -> str | None:
        """The no_signal refusal's message once the all-equal streak has reached the limit, else None."""
        streak = signal["all_equal_streak"]
        if streak < signal["all_equal_limit"]:
            return None
        # The newest groups describe the policy as it is now (and a long streak is not all read).
        groups = [Group.from_json(p) for p in self.store.latest_uninformative_payloads(db, min(streak, 1000))]
        held = Store.get_meta(db, "trainer_metrics", {}).get("0", {}).get("eval/accuracy")
        return no_signal_message(
            streak=streak,
            seen=signal["groups_seen"],
            all_equal=signal["groups_all_equal"],
            groups=groups,
            accuracy_before=held,
            cfg=self.cfg,
        )

    def _batch_response(self, db, row) -> dict:
        ids = json.loads(row["group_ids"])
        payloads = self.store.payloads(db, ids)
        if any(map(is_summary, payloads)):
            raise ApiError(
                410,
                "batch_pruned",
                f"batch {row['step']}'s tokens were pruned (orchestrator.keep_payload_steps): the trainer's "
                "checkpoints after it should have been kept; resume from a newer checkpoint, or run with "
                'keep_payload_steps = "all" to keep every payload',
            )
        return {
            "ready": True,
            "step": row["step"],
            "group_ids": ids,
            "groups": [Group.from_json(p) for p in payloads],
            "metrics": json.loads(row["metrics"]),
        }

    def publish(self, version: int, url: str, manifest: dict) -> dict:
        """The trainer announces its current version. It is the authority: a trainer resumed from
        an older checkpoint moves `latest_version` back (its newer versions are being redone)."""
        with self.store.tx() as db:
            self.store.save_policy(db, version, url, json.dumps(manifest), time.time())
            latest = Store.get_meta(db, "latest_version")
            if latest is not None and version < latest:
                # A trainer resumed from an older checkpoint: versions above `version` will be
                # rebuilt with other weights, so work sampled with the old ones is dropped.
                next_step = Store.get_meta(db, "next_step", 0)
                dropped = self.store.drop_newer(db, WAITING, version, next_step)
                self.store.end_leases_above(db, version)
                self.leasing.expire(db, time.time())
                self.log(f"trainer went back to version {version} (was {latest}): {dropped} queued groups dropped")
            Store.set_meta(db, "latest_version", version)
            Store.set_meta(db, "finished", False)  # a trainer publishing means the run is live (resumed)
            self.store.forget_policies(db, version - self.cfg.async_.bound - 8)
        self.counters.count("policies_published")
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
