"""Where a completion's final answer may be, for every task type."""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def answer_region(completion: str) -> str | None:
    """The part of the completion that may hold the final answer.

    Text after the last ``</think>``; the whole text when there is no think
    block; None when ``<think>`` was opened and never closed (the INTELLECT-2
    seed run scores such completions 0 rather than trust an answer written
    mid-thought).
    """
    close_index = completion.rfind(THINK_CLOSE)
    if close_index >= 0:
        return completion[close_index + len(THINK_CLOSE) :]
    if THINK_OPEN in completion:
        return None
    return completion


def missing_answer_reason(completion: str, what: str) -> str:
    """Why a completion has nothing to grade: an unclosed ``<think>``, or no ``what`` (e.g.
    "\\boxed{} answer") in its answer region."""
    if answer_region(completion) is None:
        return "completion opens <think> but never closes it"
    where = " after </think>" if THINK_CLOSE in completion else ""
    return f"no {what}{where}"
