"""Held-out accuracy during training, through the same code as `swarmrl eval`
(:mod:`swarmrl.eval.runner`): the trainer's own model as a local backend, graded by the same
reward code, reported as `eval/...` metrics."""

from __future__ import annotations

import statistics

from swarmrl.config import Config
from swarmrl.eval.episodes import evaluate_episodes, is_episodic
from swarmrl.eval.runner import EvalSettings, ModelBackend, evaluate_rows
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import Graders


def evaluate(
    model, tokenizer, rows: list[dict], cfg: Config, pool: VerifierPool, *, graders: Graders | None = None
) -> dict[str, float]:
    """`eval/accuracy` is avg@k: the mean task reward over `eval.samples` samples per held-out
    problem at `eval.temperature`; `eval/pass@j` the unbiased pass@j. With length control on,
    prompts carry the middle target and the length metrics say how well it was kept. Held-out
    instruction rows are graded all-or-nothing, so their accuracy is IFEval's prompt-level
    strict measure; in a mix of sources, `eval/accuracy/<source>` is each one's."""
    if is_episodic(rows):
        return evaluate_episodes(model, tokenizer, rows, cfg)
    target = sorted(cfg.length.targets)[len(cfg.length.targets) // 2] if cfg.length.enabled else None
    settings = EvalSettings(
        k=cfg.eval.samples,
        temperature=cfg.eval.temperature,
        max_tokens=cfg.sampling.max_new_tokens,
        length_target=target,
        seed=cfg.seed,
        batch_problems=64,
    )
    # 64 problems x k samples per sampler call, as before this went through the eval runner.
    backend = ModelBackend(model, tokenizer, batch_rows=64 * settings.k)
    results, summary = evaluate_rows(rows, backend, settings, pool=pool, graders=graders)
    metrics = {
        "eval/accuracy": summary[f"avg@{settings.k}"],
        "eval/length_mean": summary["length/mean"],
        "eval/problems": float(summary["problems"]),
    }
    metrics.update({f"eval/{key}": float(value) for key, value in summary.items() if key.startswith("pass@")})
    metrics.update(source_accuracies(rows, results, settings.k))
    # Instruction rows: IFEval's instruction-level strict share too (progress below all-or-nothing).
    if "ifeval/instruction_strict" in summary:
        metrics["eval/instruction_strict"] = summary["ifeval/instruction_strict"]
    if target is not None:
        metrics["eval/length_target"] = float(target)
        metrics["eval/length_within_target"] = summary["length/within_target"]
        metrics["eval/length_abs_error_mean"] = summary["length/abs_error_mean"]
    return metrics


def source_accuracies(rows: list[dict], results: list[dict], k: int) -> dict[str, float]:
    """`eval/accuracy/<source>`: avg@k over the held-out rows of each source of a mix (rows name
    theirs in `source`); nothing when they come from one source (`eval/accuracy` says it)."""
    by_source: dict[str, list[float]] = {}
    for row, result in zip(rows, results, strict=True):
        if "source" in row:
            by_source.setdefault(row["source"], []).extend(result["rewards"])
    if len(by_source) < 2:
        return {}
    return {f"eval/accuracy/{name}": statistics.fmean(rewards) for name, rewards in sorted(by_source.items())}
