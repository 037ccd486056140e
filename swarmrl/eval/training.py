"""Held-out accuracy during training, through the same code as `swarmrl eval`
(:mod:`swarmrl.eval.runner`): the trainer's own model as a local backend, graded by the same
reward code, reported as `eval/...` metrics."""

from __future__ import annotations

from swarmrl.config import Config
from swarmrl.eval.runner import EvalSettings, ModelBackend, evaluate_rows
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import Graders


def evaluate(
    model, tokenizer, rows: list[dict], cfg: Config, pool: VerifierPool, *, graders: Graders | None = None
) -> dict[str, float]:
    """`eval/accuracy` is avg@k: the mean task reward over `eval.samples` samples per held-out
    problem at `eval.temperature`; `eval/pass@j` the unbiased pass@j. With length control on,
    prompts carry the middle target and the length metrics say how well it was kept."""
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
    _, summary = evaluate_rows(rows, backend, settings, pool=pool, graders=graders)
    metrics = {
        "eval/accuracy": summary[f"avg@{settings.k}"],
        "eval/length_mean": summary["length/mean"],
        "eval/problems": float(summary["problems"]),
    }
    metrics.update({f"eval/{key}": float(value) for key, value in summary.items() if key.startswith("pass@")})
    if target is not None:
        metrics["eval/length_target"] = float(target)
        metrics["eval/length_within_target"] = summary["length/within_target"]
        metrics["eval/length_abs_error_mean"] = summary["length/abs_error_mean"]
    return metrics
