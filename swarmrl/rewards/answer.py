"""Where a completion's final answer may be, for every task type, and how a ``\\boxed{}``
answer is read (the math and multiple-choice graders read it the same way)."""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# ``\boxed`` optionally followed by whitespace, then the opening brace.
_BOXED_START = re.compile(r"\\boxed\s*\{")


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


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_index``, or None if unbalanced.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` (literal
    braces in LaTeX) do not count towards the nesting depth.
    """
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def boxed_contents(text: str) -> list[str]:
    """Contents of every top-level, balanced ``\\boxed{...}`` in ``text``, in order."""
    contents = []
    position = 0
    while (match := _BOXED_START.search(text, position)) is not None:
        open_index = match.end() - 1
        close_index = _matching_brace(text, open_index)
        if close_index is None:  # unclosed: skip it, a later box may be fine
            position = match.end()
            continue
        contents.append(text[open_index + 1 : close_index])
        position = close_index + 1
    return contents
