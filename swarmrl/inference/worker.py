"""An inference worker (`swarmrl worker --run-dir DIR`): newest allowed policy in, groups out.

The async bound is respected at the source: a worker only samples with version v when
v >= next_step - k (next_step is the step the trainer is collecting data for), and pauses while
enough groups already wait, so it never produces data that the bound would have to throw away
unless the trainer falls behind. The trainer still checks every group's version (it trusts the
rule, not the worker).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from swarmrl.config import Config, load_config
from swarmrl.inference.sampler import Sampler
from swarmrl.model.checkpoint import load_policy
from swarmrl.rl.rollouts import Group, Sample
from swarmrl.rl.tasks import model_input, task_rows
from swarmrl.transport.filesystem import RunDir


def max_pending(cfg: Config) -> int:
    """Queue depth at which workers pause. In steady state workers and trainer run at the same
    rate, so a deeper queue adds staleness, not throughput: about one batch ahead is enough to
    keep both busy (two batches of groups, since online filtering drops some)."""
    return cfg.async_.max_pending_groups or cfg.sampling.prompts_per_step * min(cfg.async_.bound + 1, 2)


class Worker:
    def __init__(self, run_dir: str | Path, index: int, cfg: Config | None = None):
        self.rd = RunDir(run_dir)
        self.cfg = cfg or load_config(self.rd.root / "config.toml")
        self.index = index
        self.name = f"w{index}"
        self.train_rows, _ = task_rows(self.cfg, log=lambda *_: None)
        # The draw position is keyed by start time so a restarted worker does not replay its
        # first problems; workers still cannot pick problems (the trusted side checks ids later).
        self.rng = random.Random(f"{self.cfg.seed}-{index}-{time.time_ns()}")
        self.model = None
        self.version: int | None = None
        self.parent = os.getppid()

    def _usable_version(self) -> int | None:
        latest = self.rd.latest_version()
        next_step = self.rd.read_state().get("next_step", 0)
        if latest is None or latest < next_step - self.cfg.async_.bound:
            return None
        return latest

    def _load(self, version: int) -> bool:
        try:
            model, tok = load_policy(self.rd.version_path(version), device=self.cfg.model.device,
                                     dtype=getattr(torch, self.cfg.model.dtype))
        except (OSError, ValueError):
            return False  # pruned or replaced under us; look again
        self.model, self.tokenizer, self.version = model.eval(), tok, version
        self.sampler = Sampler(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
        return True

    def generate_groups(self) -> list[Group]:
        c, s = self.cfg, self.cfg.sampling
        rows = [self.rng.choice(self.train_rows) for _ in range(s.worker_batch_prompts)]
        targets = [self.rng.choice(c.length.targets) if c.length.enabled else None for _ in rows]
        inputs = [model_input(self.tokenizer, r["prompt"], t) for r, t in zip(rows, targets)]
        seeds = [self.rng.getrandbits(63) for _ in range(len(rows) * s.group_size)]
        prompts = [ids for _, ids in inputs for _ in range(s.group_size)]
        t0 = time.monotonic()
        outs = self.sampler.generate(prompts, seeds, max_new_tokens=s.max_new_tokens, temperature=s.temperature)
        share = (time.monotonic() - t0) / len(rows)
        groups, now = [], time.time()
        for i, (r, (prompt, ids), t) in enumerate(zip(rows, inputs, targets)):
            block = range(i * s.group_size, (i + 1) * s.group_size)
            samples = [Sample(outs[j].token_ids, outs[j].logprobs, outs[j].finish_reason, seeds[j]) for j in block]
            groups.append(Group(r["problem_id"], r["task_type"], prompt, r["verification_info"], ids, samples,
                                self.version, self.name, s.temperature, t, now, share))
        return groups

    def run(self, *, poll_s: float = 0.05) -> None:
        torch.set_num_threads(self.cfg.async_.worker_threads)
        limit = max_pending(self.cfg)
        while not self.rd.stop_requested():
            if os.getppid() != self.parent:
                return  # the launcher died: do not run on as an orphan
            version = self._usable_version()
            if version is None or self.rd.pending_count() >= limit:
                time.sleep(poll_s)
                continue
            if version != self.version and not self._load(version):
                time.sleep(poll_s)
                continue
            for g in self.generate_groups():
                self.rd.put_group(g)


def run_worker(run_dir: str | Path, index: int) -> None:
    Worker(run_dir, index).run()
