"""Building batch n: the async bound, trusted rewards, and online filtering.

Groups are taken first in, first out. A group sampled by a policy older than n - k is dropped
and counted (`off_policy/dropped`); the rest are scored here (a worker's claims are never
used); groups whose rewards are all equal carry no advantage and are dropped
(`batch/uninformative_groups`); the batch waits until it has `prompts_per_step` informative ones.
Scored groups beyond the batch are kept in memory for the next step and re-checked against the
bound there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from swarmrl.algorithm.advantages import is_informative
from swarmrl.config import Config
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rl.rollouts import Group
from swarmrl.rl.scoring import score_groups
from swarmrl.transport.filesystem import RunDir


class BatchBuilder:
    def __init__(self, rd: RunDir, cfg: Config, tokenizer, pool: VerifierPool,
                 check_alive: Callable[[], None] | None = None):
        self.rd, self.cfg, self.tokenizer, self.pool = rd, cfg, tokenizer, pool
        self.check_alive = check_alive or (lambda: None)
        self.carry: list[Group] = []
        self.dropped_total = 0
        self.uninformative_streak = 0

    def _check_signal(self, keep: torch.Tensor, fresh: list[Group]) -> None:
        """Fail loudly instead of waiting forever when no group carries any signal."""
        self.uninformative_streak = 0 if bool(keep.any()) else self.uninformative_streak + len(fresh)
        limit = self.cfg.sampling.uninformative_limit
        if self.uninformative_streak >= limit:
            mean = statistics.fmean(r for g in fresh for r in g.task_rewards)
            raise RuntimeError(
                f"the last {self.uninformative_streak} groups all had equal rewards (mean task reward {mean:.2f}), "
                "so GRPO has no signal: the policy solves none (or all) of these tasks. Use a stronger "
                "base model (model.path, or more sft.steps), easier/harder tasks, or a larger group_size.")

    def build(self, step: int, *, poll_s: float = 0.02) -> tuple[list[Group], dict[str, float]]:
        want = self.cfg.sampling.prompts_per_step
        oldest = step - self.cfg.async_.bound
        taken: list[Group] = []
        stale = uninformative = scored_groups = 0
        task_rewards: list[float] = []
        gen_seconds = 0.0  # worker time spent on everything this step consumed, dropped included
        t0 = time.monotonic()
        queue, self.carry = [g for g in self.carry if g.policy_version >= oldest], []
        while len(taken) < want:
            if not queue:
                paths = self.rd.pending_groups()
                if not paths:
                    self.check_alive()
                    time.sleep(poll_s)
                    continue
                fresh = []
                for path in paths[: 2 * want]:
                    g = self.rd.read_group(path)
                    path.unlink()
                    gen_seconds += g.gen_seconds
                    if g.policy_version < oldest:
                        stale += 1
                    else:
                        fresh.append(g)
                if fresh:
                    score_groups(fresh, tokenizer=self.tokenizer, pool=self.pool, cfg=self.cfg)
                    scored_groups += len(fresh)
                    for g in fresh:
                        task_rewards.extend(g.task_rewards)
                    keep = is_informative(torch.tensor([g.rewards for g in fresh]))
                    uninformative += int((~keep).sum())
                    self._check_signal(keep, fresh)
                    queue.extend(g for g, k in zip(fresh, keep.tolist()) if k)
                continue
            taken.append(queue.pop(0))
        self.carry = queue
        self.dropped_total += stale
        rewards = [r for g in taken for r in g.rewards]
        batch_task = [r for g in taken for r in g.task_rewards]
        lengths = [len(s.token_ids) for g in taken for s in g.samples]
        staleness = [step - g.policy_version for g in taken]
        metrics = {
            "time/wait_for_batch": time.monotonic() - t0,
            "time/generation": gen_seconds,
            "reward/mean": statistics.fmean(rewards),
            "reward/std": statistics.pstdev(rewards),
            # Accuracy over everything sampled (before filtering), the honest training signal.
            "reward/task_mean_all": statistics.fmean(task_rewards) if task_rewards else float("nan"),
            "reward/task_mean": statistics.fmean(batch_task),
            "length/mean": statistics.fmean(lengths),
            "length/max": float(max(lengths)),
            "length/truncated_frac": statistics.fmean(float(s.finish_reason == "length") for g in taken for s in g.samples),
            "off_policy/max": float(max(staleness)),
            "off_policy/mean": statistics.fmean(staleness),
            "off_policy/dropped": float(stale),
            "off_policy/dropped_total": float(self.dropped_total),
            "batch/uninformative_groups": float(uninformative),
            "batch/scored_groups": float(scored_groups),
            "batch/generated_tokens": float(sum(lengths)),
        }
        if self.cfg.length.enabled:
            targets = [g.target_length for g in taken for _ in g.samples]
            metrics["length/target_mean"] = statistics.fmean(targets)
            metrics["length/abs_error_mean"] = statistics.fmean(abs(n - t) for n, t in zip(lengths, targets))
        return taken, metrics
