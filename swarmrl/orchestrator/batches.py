"""The trainer's side: batch n built from queued groups first in, first out (stale ones dropped
and counted) and frozen in SQLite, published policy versions, the end of the run."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from swarmrl.config import Config
from swarmrl.orchestrator.counters import Counters
from swarmrl.orchestrator.errors import WAITING, ApiError
from swarmrl.orchestrator.leasing import Leasing
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
    if cfg.length.enabled:
        targets = [g.target_length for g in taken for _ in g.samples]
        m["length/target_mean"] = statistics.fmean(targets)
        m["length/abs_error_mean"] = statistics.fmean(abs(n - t) for n, t in zip(lengths, targets))
    return m


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
        groups wait, else report what is missing (the trainer polls)."""
        cfg = self.cfg
        want, k = cfg.sampling.prompts_per_step, cfg.async_.bound
        with self.store.tx() as db:
            row = self.store.batch(db, step)
            if row is not None:
                return self._batch_response(db, row)
            next_step, _, _ = Store.progress(db)
            if step != next_step:
                raise ApiError(409, "wrong_step", f"batch {step} cannot be built: the next batch is {next_step}")
            streak = Store.get_meta(db, "uninformative_streak", 0)
            if streak >= cfg.sampling.uninformative_limit:
                payloads = self.store.latest_uninformative_payloads(db, streak)
                rewards = [r for p in payloads for r in json.loads(p)["task_rewards"]]
                mean = statistics.fmean(rewards) if rewards else float("nan")
                raise ApiError(
                    409,
                    "no_signal",
                    f"the last {streak} groups all had equal rewards (mean task reward {mean:.2f}), "
                    "so GRPO has no signal: the policy solves none (or all) of these tasks. Use a "
                    "stronger base model (model.path, or more sft.steps), easier/harder tasks, or a "
                    "larger group_size.",
                )
            oldest = step - k
            stale = self.store.drop_older(db, ("queued",), oldest, step)
            if stale:
                self.counters.count("off_policy_dropped", stale)
            ids = self.store.queued_ids(db, want)
            if len(ids) < want:
                return {"ready": False, "step": step, "queued": len(ids), "needed": want}
            self.store.consume(db, ids, step)
            self.store.resolve_uninformative(db, step)
            taken = [Group.from_json(p) for p in self.store.payloads(db, ids)]
            resolved = [Group.from_json(p) for p in self.store.resolved_payloads(db, step)]
            n_stale = self.store.resolved_stale_count(db, step)
            metrics = batch_metrics(step, taken, resolved, n_stale, cfg)
            metrics["off_policy/dropped_total"] = float(self.store.count_groups(db, ("stale",)))
            metrics.update(self.validation.metrics(db))
            self.store.save_batch(db, step, json.dumps(ids), json.dumps(metrics), time.time())
            Store.set_meta(db, "next_step", step + 1)
            row = self.store.batch(db, step)
            self.counters.count("batches_built")
            return self._batch_response(db, row)

    def _batch_response(self, db, row) -> dict:
        ids = json.loads(row["group_ids"])
        return {
            "ready": True,
            "step": row["step"],
            "group_ids": ids,
            "groups": [json.loads(p) for p in self.store.payloads(db, ids)],
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
