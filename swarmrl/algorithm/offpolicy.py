"""Corrections for rollouts sampled by an older policy than the one being trained.

Pure functions, no I/O. With async bound k a sequence in batch n was sampled by the behaviour
policy (version n - s, 0 <= s <= k, logprobs recorded by the worker), while the trainer holds
version n. Three policies are in play:

- the behaviour policy pi_b, which sampled the tokens (``behaviour_logprobs``);
- the proximal policy pi_prox, the trainer's weights at the start of the rollout step
  (``old_logprobs = "recompute"``), which anchors the PPO clip;
- the policy being optimised, pi_theta.

The seed run's objective clips pi_theta / pi_prox and ignores pi_b altogether, so tokens from a
stale policy are trained on as if they were on-policy. Decoupled PPO (Fu et al. 2025, AReaL,
"the proximal policy") keeps that clip and multiplies each token's loss by the importance
weight pi_prox / pi_b, truncated at a cap so one very stale token cannot dominate the step.
This module computes that weight, per token or per sequence, with optional masking of tokens
whose weight leaves a trust band (the per-token rejection of "IcePop"-style corrections): a
token sampled where the two policies disagree by more than the band is dropped rather than
merely down-weighted.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LEVELS = ("token", "sequence")

# exp() of a log-ratio above ~88 is inf in float32; every use below is truncated far sooner.
_MAX_LOG_WEIGHT = 20.0


def behaviour_weights(
    proximal_logprobs: Tensor,  # [B, T] float, trainer's policy at the start of the step
    behaviour_logprobs: Tensor,  # [B, T] float, the worker's logprobs (the sampling policy)
    loss_mask: Tensor,  # [B, T] bool, completion tokens that count
    *,
    cap: float,
    level: Literal["token", "sequence"] = "token",
    mask_band: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights min(pi_prox / pi_b, cap), 0 off the mask; returns
    (weights [B, T], metrics).

    ``level="token"``: each token's own ratio. ``level="sequence"``: the geometric mean of the
    sequence's token ratios, exp(mean_t log(pi_prox / pi_b)), the same for every token of the
    sequence: less variance than a product of token ratios, and it still sees a sequence that
    drifted as a whole. ``mask_band`` (> 1): a token (or, at sequence level, a whole sequence)
    whose ratio is outside [1 / mask_band, mask_band] gets weight 0 instead.
    """
    if not cap > 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    if level not in LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; allowed: {', '.join(LEVELS)}")
    if mask_band is not None and not mask_band > 1.0:
        raise ValueError(f"mask_band must be > 1 (a ratio band [1/b, b]), got {mask_band}")
    log_w = torch.where(loss_mask, proximal_logprobs - behaviour_logprobs, 0.0)  # [B, T]
    if level == "sequence":
        n = loss_mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
        log_w = (log_w.sum(dim=1, keepdim=True) / n).expand_as(log_w)  # [B, T], one value per row
    log_w = log_w.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)
    raw = log_w.exp()  # [B, T]
    weights = raw.clamp(max=cap)
    keep = loss_mask
    if mask_band is not None:
        inside = (raw <= mask_band) & (raw >= 1.0 / mask_band)  # [B, T]
        keep = keep & inside
    weights = torch.where(keep, weights, 0.0)  # [B, T]

    with torch.no_grad():
        n_tok = int(loss_mask.sum())
        denom = max(n_tok, 1)
        metrics = {
            "off_policy/is_weight_mean": float(torch.where(loss_mask, weights, 0.0).sum()) / denom,
            "off_policy/is_truncated_frac": float((loss_mask & (raw > cap)).sum()) / denom,
            "off_policy/is_masked_frac": float((loss_mask & ~keep).sum()) / denom,
        }
    return weights.detach(), metrics
