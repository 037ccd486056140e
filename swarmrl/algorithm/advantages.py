"""Group-relative advantages for GRPO.

GRPO samples ``group_size`` completions per prompt and scores each one; a completion's
advantage is its reward relative to its siblings, so no value network is needed. Pure
functions, no I/O.
"""

from __future__ import annotations

from torch import Tensor


def group_advantages(rewards: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantage of every completion relative to its own group.

    Args:
        rewards: Tensor  # [num_groups, group_size] float, one row per prompt.
        normalize_std: divide by the group's std (GRPO). False gives the plain
            ``r - mean`` of Dr.GRPO (Liu et al. 2025), which argues the std division
            over-weights near-uniform groups (all-but-one right/wrong) and biases the
            update by question difficulty.
        eps: keeps the division finite when a group's rewards are all equal.

    Returns:
        Tensor  # [num_groups, group_size] float, same dtype as ``rewards``.

    The std is the *population* std (``unbiased=False``): it is defined for any group
    size (the Bessel-corrected one is NaN for a group of 1), and it makes a 0/1-reward
    group with both outcomes map to exactly +-1 when the outcomes are balanced.
    """
    centered = rewards - rewards.mean(dim=-1, keepdim=True)  # [G, N]
    if not normalize_std:
        return centered
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)  # [G, 1]
    return centered / (std + eps)  # [G, N]


def is_informative(rewards: Tensor, *, atol: float = 1e-9) -> Tensor:
    """Whether a group carries any learning signal.

    A group whose rewards are all equal (all solved, or all failed) has zero advantage
    on every completion, so it contributes no policy gradient while still costing
    compute and shrinking a token-normalised loss; online filtering drops these groups.

    Args:
        rewards: Tensor  # [num_groups, group_size] float
        atol: rewards closer than this count as equal.

    Returns:
        Tensor  # [num_groups] bool, True where the group's rewards are not all equal.
    """
    spread = rewards.amax(dim=-1) - rewards.amin(dim=-1)  # [G]
    return spread > atol
