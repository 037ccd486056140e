"""Held-out accuracy of a policy: the same sampler and the same reward code as training."""

from __future__ import annotations

import statistics


from swarmrl.config import Config
from swarmrl.inference.sampler import Sampler
from swarmrl.rewards.code import CodeGrader
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rl.rollouts import Group, Sample
from swarmrl.rl.scoring import score_groups
from swarmrl.rl.tasks import model_input


def evaluate(model, tokenizer, rows: list[dict], cfg: Config, pool: VerifierPool, *,
             batch_prompts: int = 64, code: CodeGrader | None = None) -> dict[str, float]:
    """`eval/accuracy`: mean task reward over `eval.samples` samples per held-out problem
    (avg@k) at `eval.temperature`; with length control on, prompts carry the middle target."""
    model.eval()
    sampler = Sampler(model, stop_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    target = sorted(cfg.length.targets)[len(cfg.length.targets) // 2] if cfg.length.enabled else None
    k = cfg.eval.samples
    groups: list[Group] = []
    for start in range(0, len(rows), batch_prompts):
        chunk = rows[start : start + batch_prompts]
        inputs = [model_input(tokenizer, r["prompt"], target) for r in chunk]
        prompts = [ids for _, ids in inputs for _ in range(k)]
        seeds = [10_000_019 * (start + i) + j for i in range(len(chunk)) for j in range(k)]
        outs = sampler.generate(prompts, seeds, max_new_tokens=cfg.sampling.max_new_tokens,
                                temperature=cfg.eval.temperature)
        for i, r in enumerate(chunk):
            samples = [Sample(o.token_ids, o.logprobs, o.finish_reason, seeds[i * k + j])
                       for j, o in enumerate(outs[i * k : (i + 1) * k])]
            groups.append(Group(r["problem_id"], r["task_type"], inputs[i][0], r["verification_info"],
                                inputs[i][1], samples, -1, "eval", cfg.eval.temperature, target))
    score_groups(groups, tokenizer=tokenizer, pool=pool, cfg=cfg, code=code)
    task = [x for g in groups for x in g.task_rewards]
    lengths = [len(s.token_ids) for g in groups for s in g.samples]
    metrics = {
        "eval/accuracy": statistics.fmean(task) if task else 0.0,
        "eval/length_mean": statistics.fmean(lengths) if lengths else 0.0,
        "eval/problems": float(len(rows)),
    }
    if target is not None:
        metrics["eval/length_target"] = float(target)
        metrics["eval/length_within_target"] = statistics.fmean(float(n <= target) for n in lengths)
    return metrics
