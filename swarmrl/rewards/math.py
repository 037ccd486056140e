"""Math rewards: pull the final ``\\boxed{}`` answer out of a completion and grade it.

Grading uses ``math_verify`` with its own signal-based timeouts switched off,
because ``signal.alarm`` only works in the main thread of the main interpreter.
Runaway sympy work is instead bounded from the outside by
:class:`swarmrl.rewards.pool.VerifierPool`, which kills the worker process.
Everything here is a plain module-level function so a spawned worker can
unpickle it by reference.
"""

from __future__ import annotations

import logging
import math
import re
from decimal import Decimal

from math_verify import parse, verify
from sympy import Basic, Float, Mul, Pow, Rational, factorial

from swarmrl.rewards.answer import answer_region, boxed_contents, missing_answer_reason

# How much of a wrong answer to quote in the reason string, so one runaway
# completion does not bloat the scored JSONL.
_MAX_QUOTED_ANSWER = 80

# Answers are graded for strangers, and some cost the grader its whole timeout
# (9^{9^{9^{9}}}, 1000000!, a fraction over 10^{10^{8}}) while no real answer
# looks like them. Refused before sympy evaluates anything, unless the ground
# truth is as big. Digits: sympy checks a 10^5-digit number in ~0.05 s, a
# 10^7-digit one in ~8 s, 9^{9^9} (3.7e8 digits) in hours.
MAX_ANSWER_CHARS = 1000
MAX_ANSWER_DIGITS = 100_000


class _DropDisabledTimeoutWarning(logging.Filter):
    """Hide math_verify's "Timeout is disabled" warning.

    We disable its timeouts on purpose (the pool enforces a hard one), so the
    warning would only be noise printed once by every worker process.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def _last_boxed(text: str) -> str | None:
    """Content of the last top-level, balanced ``\\boxed{...}`` in ``text``.

    A ``\\boxed`` nested inside another one is part of the outer answer, so
    the scan resumes after each complete box; an unclosed ``\\boxed{`` is
    skipped so a later well-formed one can still be found.
    """
    contents = boxed_contents(text)
    return contents[-1] if contents else None


def extract_answer(completion: str) -> str | None:
    """The final answer: the content of the last ``\\boxed{...}`` after ``</think>``.

    Returns None when there is nothing to grade: an unclosed ``<think>``, no
    balanced ``\\boxed{}``, or an empty one. The content is returned without
    surrounding whitespace, nested braces intact (``\\frac{1}{2}``).
    """
    region = answer_region(completion)
    if region is None:
        return None
    boxed = _last_boxed(region)
    if boxed is None or not boxed.strip():
        return None
    return boxed.strip()


# How a row's final answer is read (verification_info's optional "extract"): "boxed" (the
# default, the seed run's format: the last \boxed{} after </think>) or "last_number" (the
# flexible extraction GSM8K harnesses use for models that were never taught a format: the last
# \boxed{} if there is one, else the last number written; `12 + 7 = 8` answers 8).
EXTRACTS = ("boxed", "last_number")
_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?")


def extract_last_number(completion: str) -> str | None:
    """The last \\boxed{} answer of the answer region, else its last number (commas dropped)."""
    boxed = extract_answer(completion)
    if boxed is not None:
        return boxed
    region = answer_region(completion)
    numbers = _NUMBER.findall(region or "")
    return numbers[-1].replace(",", "") if numbers else None


def extract_mode(verification_info: dict) -> str:
    """The row's answer extraction; ValueError naming the fix for an unknown one."""
    mode = verification_info.get("extract", "boxed") if isinstance(verification_info, dict) else "boxed"
    if mode not in EXTRACTS:
        raise ValueError(f"verification_info's extract is {mode!r}; use one of {', '.join(EXTRACTS)} (or leave it out)")
    return mode


def _parse_boxed(expression: str) -> list:
    """Parse one answer with math_verify, its signal-based timeout disabled.

    Wrapping in ``\\boxed{}`` makes math_verify's LaTeX extractor take the
    whole string as the answer, which works for integers, ``1/2``, LaTeX and
    even ``$5$`` alike.
    """
    return parse("\\boxed{" + expression + "}", parsing_timeout=None)


def _digits(expr) -> float:
    """Roughly how many digits the largest number built while evaluating ``expr`` has (inf: too
    many to say), read from the unevaluated expression math_verify parses, without computing it."""
    if isinstance(expr, Rational):  # integers included (q == 1)
        return max(abs(expr.p).bit_length(), expr.q.bit_length()) * math.log10(2)
    if isinstance(expr, Float):
        x = abs(float(expr))
        return abs(math.log10(x)) if 0 < x < math.inf else (math.inf if x else 0.0)
    if isinstance(expr, (Pow, factorial)):
        exponent = _digits(expr.args[-1])  # the exponent, or the n of n!
        if exponent > 15:
            return math.inf
        base = _digits(expr.args[0]) if isinstance(expr, Pow) else exponent
        return 10**exponent * max(1.0, base)
    if isinstance(expr, Basic) and expr.args:
        sizes = [_digits(a) for a in expr.args]
        return sum(sizes) if isinstance(expr, Mul) else max(sizes)
    return 0.0


def _absurd(parsed: list) -> float:
    return max((_digits(e) for e in parsed if isinstance(e, Basic)), default=0.0)


def _grade(ground_truth: str, answer: str) -> tuple[float, str | None]:
    """Reward and, when it is 0, a short human-readable reason."""
    gold = _parse_boxed(ground_truth)
    if not gold:
        return 0.0, f"math_verify could not parse the ground truth {ground_truth!r}"
    if len(answer) > max(MAX_ANSWER_CHARS, 2 * len(ground_truth)):
        return 0.0, f"answer of {len(answer)} characters is longer than the {MAX_ANSWER_CHARS} graded"
    prediction = _parse_boxed(answer)
    if not prediction:
        return 0.0, f"math_verify could not parse the answer {_quote(answer)}"
    digits = _absurd(prediction)
    if digits > max(MAX_ANSWER_DIGITS, 2 * _absurd(gold)):
        size = "beyond count" if digits == math.inf else f"~{digits:.3g}"
        return 0.0, (
            f"answer {_quote(answer)} asks for numbers of {size} digits, more than the "
            f"{MAX_ANSWER_DIGITS} graded: not evaluated"
        )
    # verify is asymmetric: the gold answer must come first.
    if verify(gold, prediction, timeout_seconds=None):
        return 1.0, None
    return 0.0, f"answer {_quote(answer)} does not match the ground truth {ground_truth!r}"


def _quote(text: str) -> str:
    if len(text) <= _MAX_QUOTED_ANSWER:
        return repr(text)
    return repr(text[:_MAX_QUOTED_ANSWER] + "...")


def verify_math(ground_truth: str, answer: str) -> float:
    """1.0 if ``answer`` is mathematically equal to ``ground_truth``, else 0.0.

    Both strings are bare answers (no ``\\boxed``), e.g. ``"1/2"`` and
    ``"\\frac{1}{2}"``. No timeout is applied here; run it in a
    :class:`~swarmrl.rewards.pool.VerifierPool` to bound pathological inputs.
    """
    reward, _ = _grade(ground_truth, answer)
    return reward


def ground_truth_text(verification_info: dict) -> str:
    """The ground truth of a decoded ``verification_info`` as a non-empty string.

    JSON may carry it as a string or a number; numbers are spelled out in
    plain decimal so math_verify reads them as numbers. Raises ValueError
    naming the problem when there is no usable ground truth, so callers can
    reject the row before any grading work.
    """
    if not isinstance(verification_info, dict) or "ground_truth" not in verification_info:
        raise ValueError(
            "verification_info has no 'ground_truth' key; a verifiable_math row needs "
            'verification_info like {"ground_truth": "42"}'
        )
    value = verification_info["ground_truth"]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"ground_truth must be a string or a number, got {type(value).__name__} "
            f"{value!r}; fix the row's verification_info"
        )
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"ground_truth must be a finite number, got {value!r}")
        if value.is_integer():
            return str(int(value))
        # repr gives 1e-07, which math_verify reads as 1*e - 7; spell it out.
        return format(Decimal(repr(value)), "f")
    text = str(value).strip()
    if not text:
        raise ValueError("ground_truth is empty; fix the row's verification_info")
    extract_mode(verification_info)
    return text


def math_task_reward(verification_info: dict, completion: str) -> tuple[float, str | None]:
    """Reward for a ``verifiable_math`` row: 1.0 if the final boxed answer is right.

    ``verification_info`` is the decoded JSON ``{"ground_truth": ...}``.
    Returns ``(reward, reason)``: ``reason`` is None for a correct answer and
    otherwise says why the reward is 0 (unclosed think, no boxed answer,
    wrong answer). A row that cannot be graded at all (no usable ground
    truth) raises ValueError instead, because that is a data bug, not a
    wrong answer.
    """
    ground_truth = ground_truth_text(verification_info)
    if extract_mode(verification_info) == "last_number":
        answer = extract_last_number(completion)
        if answer is None:
            return 0.0, missing_answer_reason(completion, "number or \\boxed{} answer")
        return _grade(ground_truth, answer)
    answer = extract_answer(completion)
    if answer is None:
        return 0.0, missing_answer_reason(completion, "\\boxed{} answer")
    return _grade(ground_truth, answer)
