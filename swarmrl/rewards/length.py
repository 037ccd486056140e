"""Length control, as in the INTELLECT-2 report.

The prompt tells the model how many tokens to think for, and the reward is
shaped by how far the completion's length lands from that target, so a
single model learns to follow a thinking budget.
"""

from __future__ import annotations

LENGTH_SUFFIX = " Think for {N} tokens before giving a response."

LENGTH_MODES = ("exact", "max", "clip")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer number of tokens, got {value!r}")


def with_length_target(prompt: str, target: int) -> str:
    """Append the thinking-budget instruction for ``target`` tokens to ``prompt``."""
    _check_positive_int("target", target)
    return prompt + LENGTH_SUFFIX.format(N=target)


def _clip(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def length_reward(task_reward: float, length: int, target: int, mode: str, coef: float) -> float:
    """Shape ``task_reward`` by how ``length`` (tokens) compares with ``target``.

    Modes:
      - ``"exact"``: ``task_reward - coef * |length - target|``; every token off
        target costs ``coef``, in either direction, so it can go negative.
      - ``"max"``: ``task_reward * clip(coef * (target - length) + 0.5, 0, 1)``;
        the target is a soft ceiling: at the target half the reward is kept,
        shorter keeps more (up to all of it), longer keeps less.
      - ``"clip"``: ``task_reward`` if ``length <= target`` else 0; a hard ceiling.
    """
    _check_positive_int("target", target)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative integer number of tokens, got {length!r}")
    if mode == "exact":
        return task_reward - coef * abs(length - target)
    if mode == "max":
        return task_reward * _clip(coef * (target - length) + 0.5, 0.0, 1.0)
    if mode == "clip":
        return task_reward if length <= target else 0.0
    raise ValueError(f"unknown length mode {mode!r}; use one of {', '.join(LENGTH_MODES)}")
