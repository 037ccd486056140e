"""Math rewards: pull the final ``\\boxed{}`` answer out of a completion and grade it.

Grading uses ``math_verify`` with its own signal-based timeouts switched off,
because ``signal.alarm`` only works in the main thread of the main interpreter.
Runaway sympy work is instead bounded from the outside by
:class:`swarmrl.rewards.pool.VerifierPool`, which kills the worker process.
Everything here is a plain module-level function so a spawned worker can
unpickle it by reference.

Answers come from strangers, and a few characters can cost the grader seconds or hours
(``\\Gamma(10^{6})``, a power tower, ``((((...))))``): before anything is evaluated, an
answer is refused (reward 0, with the reason) when its shape is one no real answer has,
unless the ground truth has it too (``_precheck``, ``_absurd``, ``_calculus``; docs/security.md,
"Grading"). What these cheap checks miss, the pool's per-answer budget ends.
"""

from __future__ import annotations

import logging
import math
import re
from decimal import Decimal

from math_verify import parse, verify
from sympy import (
    Basic,
    Derivative,
    FallingFactorial,
    Float,
    Function,
    Integral,
    Limit,
    Mul,
    Pow,
    Product,
    Rational,
    RisingFactorial,
    Sum,
    binomial,
    exp,
    factorial,
    factorial2,
    gamma,
    subfactorial,
)

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
# Brackets of any kind nested in an answer. sympy's LaTeX parser (ANTLR) takes time that grows
# steeply with depth: ~0.3 s at 4, ~0.5-1 s at 8, 15 s at 50, on a 2-core machine
# (benchmarks/bench_grading.py); the deepest real answers (``\\left(\\frac{\\sqrt{3}}{2}, ...\\right)``)
# nest 3 or 4.
MAX_NESTING = 6
# Function applications nested in the parsed answer (sin, log, gamma, ...): evaluating them
# to compare gets dearer with each level (tan applied 4 times: ~1.7 s, 5 times: over 5 s).
MAX_FUNCTION_NESTING = 3
# Digits of a Gamma or binomial of integers, which the parser computes in pure Python as it reads
# it: binomial(10^5, 5*10^4) (30 103 digits) costs 1.5 s, anything under this ~0.2 s.
MAX_CALL_DIGITS = 10_000


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
    many to say), read from the unevaluated expression math_verify parses, without computing it.
    Only an upper-bound guess for the functions that build big numbers: n! and Gamma(n) have about
    n log10(n) digits, binomial(n, k) at most min(n log10(2), k log10(n)), exp(x) like 10^x."""
    if isinstance(expr, Rational):  # integers included (q == 1)
        return max(abs(expr.p).bit_length(), expr.q.bit_length()) * math.log10(2)
    if isinstance(expr, Float):
        x = abs(float(expr))
        return abs(math.log10(x)) if 0 < x < math.inf else (math.inf if x else 0.0)
    if isinstance(expr, (Pow, exp, factorial, factorial2, subfactorial, gamma, RisingFactorial, FallingFactorial)):
        exponent = _digits(expr.args[-1])  # the exponent, the n of n!, the x of Gamma(x)
        if exponent > 15:
            return math.inf
        if isinstance(expr, Pow):
            base = _digits(expr.args[0])
        elif isinstance(expr, exp):
            base = 1.0
        else:  # n! ~ n^n; (x)_n, x^(n) ~ x^n
            base = exponent if len(expr.args) == 1 else max(exponent, _digits(expr.args[0]))
        return 10**exponent * max(1.0, base)
    if isinstance(expr, binomial):
        n, k = (_digits(a) for a in expr.args)
        return min(10**n * math.log10(2) if n <= 15 else math.inf, 10**k * max(1.0, n) if k <= 15 else math.inf)
    if isinstance(expr, Basic) and expr.args:
        sizes = [_digits(a) for a in expr.args]
        return sum(sizes) if isinstance(expr, Mul) else max(sizes)
    return 0.0


def _absurd(parsed: list) -> float:
    return max((_digits(e) for e in parsed if isinstance(e, Basic)), default=0.0)


def _function_nesting(expr) -> int:
    """Function applications nested in ``expr`` (``sin(log(x))``: 2; powers and roots are not
    functions)."""
    if not isinstance(expr, Basic) or not expr.args:
        return 0
    inner = max(_function_nesting(a) for a in expr.args)
    return inner + 1 if isinstance(expr, Function) else inner


# Operations a final answer never leaves undone, and each can cost sympy the whole budget
# (``\\int_0^1 e^{x^{x}} dx``, ``\\prod_{k=1}^{10^{6}} k``).
_CALCULUS = {Integral: "an integral", Sum: "a sum", Product: "a product", Limit: "a limit", Derivative: "a derivative"}


def _calculus(parsed: list) -> set[str]:
    return {name for kind, name in _CALCULUS.items() if any(isinstance(e, Basic) and e.has(kind) for e in parsed)}


# -- before parsing ------------------------------------------------------------------------------
# sympy's LaTeX parser evaluates some calls as it reads them (``\\Gamma(1000000)`` is 999999!,
# ~6 s of parsing), so these shapes are refused from the text, before the checks on the parsed
# expression could run.
_OPEN, _CLOSE = "([{", ")]}"
_GROWTH = re.compile(r"\\([Gg]amma|[dt]?binom)(?![A-Za-z])")
_CHOOSE = re.compile(r"\\choose(?![A-Za-z])")
_INNER_GROWTH = re.compile(r"\\(?:[Gg]amma|[dt]?binom|choose)(?![A-Za-z])|(?<!\\)!")
_LEFT = re.compile(r"\s*(?:\\left(?![A-Za-z]))?\s*")
_BARE_NUMBER = re.compile(r"\s*[0-9]+")
# What the parser skips inside a number it reads as one integer (``1{,}000``, ``(10)``, ``+5``).
_NOT_DIGITS = re.compile(r"\\left|\\right|\\[,;:! ]|[\s(){}\[\],+]")


def _nesting(text: str) -> int:
    """How deep brackets of any kind (``( [ {``, ``\\{``, ``\\left(``) nest in ``text``; an
    interval's mismatched pair (``[0, 1)``) counts as a pair."""
    depth = deepest = 0
    for ch in text:
        if ch in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
    return deepest


def _argument(text: str, i: int) -> tuple[str, int]:
    """The argument written at ``text[i:]`` and where it ends: a bracketed group's content (any
    bracket, ``\\left`` allowed) or a bare number (``\\Gamma 5``); ``""`` when neither."""
    j = _LEFT.match(text, i).end()  # type: ignore[union-attr]  # matches the empty string
    if j < len(text) and text[j] in _OPEN:
        depth = 0
        for k in range(j, len(text)):
            depth += (text[k] in _OPEN) - (text[k] in _CLOSE)
            if depth == 0:
                return text[j + 1 : k], k + 1
        return text[j + 1 :], len(text)
    number = _BARE_NUMBER.match(text, i)
    return (number.group(), number.end()) if number else ("", i)


def _enclosing(text: str, start: int, end: int) -> tuple[str, str]:
    """The text from the group that encloses ``text[start:end]`` up to it, and after it to the
    group's end: the operands of an infix ``{n \\choose k}``."""
    depth, left = 0, 0
    for k in range(start - 1, -1, -1):
        depth += (text[k] in _CLOSE) - (text[k] in _OPEN)
        if depth < 0:
            left = k + 1
            break
    depth, right = 0, len(text)
    for k in range(end, len(text)):
        depth += (text[k] in _OPEN) - (text[k] in _CLOSE)
        if depth < 0:
            right = k
            break
    return text[left:start], text[end:right]


def _log10_factorial(n: int) -> float:
    """Digits of n! (0 for n < 2)."""
    if n < 2:
        return 0.0
    return math.lgamma(n + 1) / math.log(10) if n < 10**15 else math.inf


_POWER = re.compile(r"([0-9]+)\^\{?([0-9]+)\}?")


def _integer(arg: str) -> int | None:
    """The integer ``arg`` writes, as a number or one power of numbers (``1{,}000``, ``10^{6}``),
    or None (anything else, or over 10^15: beyond what a Gamma or binomial may take)."""
    text = _NOT_DIGITS.sub("", arg)
    power = _POWER.fullmatch(text)
    if power is not None:
        base, exponent = int(power.group(1)), int(power.group(2))
        return 10**16 if base > 1 and exponent * math.log10(base) > 15 else base**exponent
    if not (text.isascii() and text.isdigit()):
        return None
    return 10**16 if len(text) > 15 else int(text)


def _call_digits(binom: bool, args: list[str]) -> float:
    """Digits of the value of ``\\Gamma(args)`` or ``\\binom(args)`` when its arguments are
    integers written out: the parser computes those as it reads them (a power it leaves to the
    checks after parsing, refused here as early), and a growth call inside another's arguments is
    evaluated first, so its size is beyond count."""
    if any(_INNER_GROWTH.search(a) for a in args):
        return math.inf
    values = [v for v in map(_integer, args) if v is not None]
    if len(values) < len(args):
        return 0.0  # not computed while parsing: sized after it (_digits)
    if max(values) > 10**15:
        return math.inf
    if not binom:
        return _log10_factorial(values[0] - 1)
    n, k = values
    return _log10_factorial(n) - _log10_factorial(k) - _log10_factorial(n - k) if k <= n else 0.0


def _growth_digits(text: str) -> float:
    """Digits of the largest value a Gamma or binomial call written in ``text`` makes the parser
    compute (``\\Gamma(1000000)``: ~5.6e6; ``\\binom{40}{20}``: 11; inf: beyond count)."""
    worst = 0.0
    for call in _GROWTH.finditer(text):
        binom = "binom" in call.group(1)
        args, end = [], call.end()
        for _ in range(2 if binom else 1):
            arg, end = _argument(text, end)
            args.append(arg)
        worst = max(worst, _call_digits(binom, args))
    for call in _CHOOSE.finditer(text):
        worst = max(worst, _call_digits(True, list(_enclosing(text, call.start(), call.end()))))
    return worst


def _precheck(ground_truth: str, answer: str) -> str | None:
    """Why ``answer`` is refused from its text alone, before parsing (None: parse it). Each limit
    rises to what the ground truth itself needs."""
    if len(answer) > max(MAX_ANSWER_CHARS, 2 * len(ground_truth)):
        return f"answer of {len(answer)} characters is longer than the {MAX_ANSWER_CHARS} graded"
    depth = _nesting(answer)
    if depth > max(MAX_NESTING, _nesting(ground_truth)):
        return f"answer {_quote(answer)} nests brackets {depth} deep, more than the {MAX_NESTING} graded: not parsed"
    digits = _growth_digits(answer)
    if digits > max(MAX_CALL_DIGITS, 2 * _growth_digits(ground_truth)):
        return f"answer {_quote(answer)} {_asks_for(digits, MAX_CALL_DIGITS)}: not parsed"
    return None


def _asks_for(digits: float, limit: int) -> str:
    size = "beyond count" if digits == math.inf else f"~{digits:.3g}"
    return f"asks for numbers of {size} digits, more than the {limit} graded"


# A plain decimal integer, as most arithmetic answers are: compared by value without math_verify,
# whose LaTeX parse costs ~3 ms an answer (a tenth of a CPU core on the default run, profiled).
# math_verify reads such a pair as the same two integers, so the verdict is the same
# (tests/unit/test_math_precheck.py compares both paths); anything else takes the full path.
_PLAIN_INTEGER = re.compile(r"[ \t\r\n]*(-?[0-9]{1,30})[ \t\r\n]*")  # ASCII only: int() reads other digits too


def _grade(ground_truth: str, answer: str) -> tuple[float, str | None]:
    """Reward and, when it is 0, a short human-readable reason."""
    gold, said = _PLAIN_INTEGER.fullmatch(ground_truth), _PLAIN_INTEGER.fullmatch(answer)
    if gold is not None and said is not None:
        if int(gold.group(1)) == int(said.group(1)):
            return 1.0, None
        return 0.0, _mismatch(ground_truth, answer)
    return _grade_parsed(ground_truth, answer)


def _mismatch(ground_truth: str, answer: str) -> str:
    return f"answer {_quote(answer)} does not match the ground truth {ground_truth!r}"


def _grade_parsed(ground_truth: str, answer: str) -> tuple[float, str | None]:
    """`_grade` through math_verify: every answer that is not a plain integer (and, in tests, the
    integers too, to check the shortcut against it)."""
    gold = _parse_boxed(ground_truth)
    if not gold:
        return 0.0, f"math_verify could not parse the ground truth {ground_truth!r}"
    refused = _precheck(ground_truth, answer)
    if refused is not None:
        return 0.0, refused
    prediction = _parse_boxed(answer)
    if not prediction:
        return 0.0, f"math_verify could not parse the answer {_quote(answer)}"
    digits = _absurd(prediction)
    if digits > max(MAX_ANSWER_DIGITS, 2 * _absurd(gold)):
        return 0.0, f"answer {_quote(answer)} {_asks_for(digits, MAX_ANSWER_DIGITS)}: not evaluated"
    nesting = max((_function_nesting(e) for e in prediction), default=0)
    if nesting > max(MAX_FUNCTION_NESTING, max((_function_nesting(e) for e in gold), default=0)):
        return 0.0, (
            f"answer {_quote(answer)} nests functions {nesting} deep, more than the "
            f"{MAX_FUNCTION_NESTING} graded: not evaluated"
        )
    undone = _calculus(prediction) - _calculus(gold)
    if undone:
        return 0.0, f"answer {_quote(answer)} leaves {' and '.join(sorted(undone))} to compute: give its value"
    # verify is asymmetric: the gold answer must come first.
    if verify(gold, prediction, timeout_seconds=None):
        return 1.0, None
    return 0.0, _mismatch(ground_truth, answer)


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
