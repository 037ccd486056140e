"""INTELLECT-2's two-sided clipped GRPO loss, and the per-token quantities it consumes.

Pure functions, no I/O. Shapes: ``B`` sequences, ``T`` token positions, ``V`` vocabulary.
Every ``[B, T]`` tensor is aligned so position ``t`` is the log-probability of the token
at ``t`` given everything before it (the caller shifts logits/targets by one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swarmrl.config import AlgorithmConfig

NORMALIZER_MODES = ("token", "constant", "sequence")

# exp() of a log-ratio above ~88 is inf in float32, and inf * 0 in exp's backward is NaN.
# Every use of the ratio is bounded (by delta or 1 + eps_high) long before e^20, so
# clamping changes no loss value and only zeroes gradients that are already zero.
_MAX_LOG_RATIO = 20.0


@dataclass
class LossInputs:
    """One micro-batch of the loss's per-token inputs."""

    logprobs: Tensor  # [B, T] float, current policy; requires grad
    old_logprobs: Tensor  # [B, T] float, policy that sampled the tokens
    advantages: Tensor  # [B] float, one per sequence, broadcast over its tokens
    loss_mask: Tensor  # [B, T] bool, True on completion tokens that count
    importance_weights: Tensor | None = None  # [B, T] float, truncated IS weights, detached
    entropy: Tensor | None = None  # [B, T] float, current policy's entropy (with grad)
    ref_logprobs: Tensor | None = None  # [B, T] float, frozen reference policy


# The defaults are the config's (swarmrl/config/training.py, AlgorithmConfig): one source of truth.
_ALG = AlgorithmConfig()


def loss_normalizer(mode: str, *, num_tokens: int, num_sequences: int, max_tokens: int) -> float:
    """Denominator for the summed per-token loss of one whole optimizer step.

    ``"token"``: total masked tokens (DAPO's token-level mean; long answers are not
    down-weighted per token). ``"constant"``: ``num_sequences * max_tokens``, a budget
    that does not depend on the sampled lengths (Dr.GRPO), so the length bias of a
    per-sequence mean disappears. ``"sequence"``: ``num_sequences``, for a loss whose
    tokens were each divided by their sequence's length (``grpo_loss(per_sequence=True)``):
    the original GRPO mean of per-sequence means, where every sequence weighs the same
    whatever its length. At least 1, so an all-masked step gives a 0 loss.
    """
    if mode == "token":
        return float(max(num_tokens, 1))
    if mode == "constant":
        return float(max(num_sequences * max_tokens, 1))
    if mode == "sequence":
        return float(max(num_sequences, 1))
    raise ValueError(f"unknown loss normalizer mode {mode!r}; allowed: {', '.join(NORMALIZER_MODES)}")


def grpo_loss(
    inputs: LossInputs,
    *,
    normalizer: float,
    delta: float = _ALG.delta,
    eps_low: float = _ALG.eps_low,
    eps_high: float = _ALG.eps_high,
    entropy_coef: float = _ALG.entropy_coef,
    kl_coef: float = _ALG.kl_coef,
    per_sequence: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Sum of masked per-token losses divided by ``normalizer``; returns (loss, metrics).

    ``normalizer`` is the whole optimizer step's (see ``loss_normalizer``), so summing
    this over the step's micro-batches equals the loss of the step as one batch.
    ``per_sequence``: each token's loss is first divided by its sequence's masked length
    (normalization "sequence"). Metrics are python floats, masked means over this micro-batch.
    """
    if not delta > 1.0 + eps_high:
        raise ValueError(f"delta ({delta}) must exceed 1 + eps_high ({1.0 + eps_high})")
    x, mask = inputs, inputs.loss_mask  # mask: [B, T] bool
    # Masked positions may hold padding garbage (even inf/NaN); zero them *before* any
    # arithmetic, because multiplying by the mask afterwards would let NaN through.
    log_ratio = torch.where(mask, x.logprobs - x.old_logprobs, 0.0)  # [B, T]
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()  # [B, T]
    adv = x.advantages[:, None]  # [B, 1], broadcast over tokens
    # A > 0: the pessimistic max picks min(r, 1 + eps_high): the usual PPO clip.
    # A < 0: plain PPO picks r itself once r > 1 + eps_high, so one token whose
    # probability exploded since sampling (stale async rollouts) gives an unbounded loss
    # and gradient. min(r, delta) caps that term at delta, and its gradient is zero above.
    unclipped = -ratio.clamp(max=delta) * adv  # [B, T]
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # [B, T]
    policy = torch.maximum(unclipped, clipped)  # [B, T]
    if x.importance_weights is not None:
        # Corrects for the sampler's and trainer's token probabilities disagreeing.
        policy = policy * torch.where(mask, x.importance_weights.detach(), 0.0)  # [B, T]
    per_token = policy  # [B, T]
    if x.entropy is not None:
        entropy = torch.where(mask, x.entropy, 0.0)  # [B, T]
        per_token = per_token - entropy_coef * entropy
    if x.ref_logprobs is not None:
        # k3 = e^d - d - 1 with d = ref - logp: unbiased for KL(pi || ref) under samples
        # from pi, and always >= 0, so it has far lower variance than -d (Schulman).
        d = torch.where(mask, x.ref_logprobs - x.logprobs, 0.0)  # [B, T]
        kl = d.exp() - d - 1.0  # [B, T]
        per_token = per_token + kl_coef * kl
    if per_sequence:
        per_token = per_token / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, T] / [B, 1]
    loss = torch.where(mask, per_token, 0.0).sum() / normalizer  # scalar

    with torch.no_grad():
        n = int(mask.sum())
        denom = max(n, 1)

        def mean(t: Tensor) -> float:  # t: [B, T]; masked mean over this micro-batch
            return float(torch.where(mask, t, 0).sum()) / denom

        metrics = {
            "loss/policy": mean(policy),
            # Which bound binds follows from the sign of A (and delta > 1 + eps_high):
            "clip/low_frac": mean((adv < 0) & (ratio < 1.0 - eps_low)),
            "clip/high_frac": mean((adv > 0) & (ratio > 1.0 + eps_high)),
            "clip/delta_frac": mean((adv < 0) & (ratio > delta)),
            "ratio/mean": mean(ratio),
            "ratio/max": float(ratio[mask].max()) if n else 0.0,
            "tokens": float(n),
        }
        if x.entropy is not None:
            metrics["loss/entropy"] = mean(entropy)
        if x.ref_logprobs is not None:
            metrics["loss/kl"] = mean(kl)
    return loss, metrics


def _scaled_logits(logits: Tensor, temperature: float) -> Tensor:
    """logits: [B, T, V] -> [B, T, V] in at least float32, divided by the temperature."""
    # Half-precision log-softmax over a large vocabulary loses the small probabilities
    # the importance ratio depends on; float64 inputs are kept as they are.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Skipping the division at T=1 avoids a [B, T, V] copy for float32 logits.
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at each target token.

    Args:
        logits: Tensor  # [B, T, V] float, any precision
        targets: Tensor  # [B, T] long, already shifted to align with ``logits``
        temperature: the sampler's temperature, so the ratio compares like with like.

    Returns:
        Tensor  # [B, T] float32 (float64 for float64 logits)

    Gathers the target logit and subtracts logsumexp instead of gathering from a full
    log_softmax, so no [B, T, V] log-probability tensor is materialised.
    """
    logits = _scaled_logits(logits, temperature)  # [B, T, V]
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return target_logits - logits.logsumexp(dim=-1)  # [B, T]


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) at every position.

    Args:
        logits: Tensor  # [B, T, V] float, any precision

    Returns:
        Tensor  # [B, T] float32 (float64 for float64 logits), differentiable.
    """
    logp = _scaled_logits(logits, temperature).log_softmax(dim=-1)  # [B, T, V]
    return -(logp.exp() * logp).sum(dim=-1)  # [B, T]
