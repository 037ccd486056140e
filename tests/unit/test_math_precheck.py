"""The math grader's cheap checks (swarmrl/rewards/math.py): the shapes a stranger's answer can
cost the grader seconds with (issue 34) are refused before sympy parses or evaluates them, and
honest answers are still graded right. Runs in this process: no pool, no timeouts."""

from __future__ import annotations

import math
import time

import pytest

import swarmrl.rewards.math as m
from swarmrl.rewards.math import math_task_reward

TOWER = "2^{" * 30 + "2" + "}" * 30  # issue 34: a power tower 30 high, 121 characters
PARENS = "(" * 499 + "1" + ")" * 499  # issue 34: 499 nested parentheses


def grade(gold: str, answer: str) -> tuple[float, str | None]:
    return math_task_reward({"ground_truth": gold}, "<think>x</think> \\boxed{" + answer + "}")


@pytest.fixture
def unparsed(monkeypatch):
    """Fails the test if math_verify is asked to parse anything but the ground truth."""
    real = m.parse

    def parse(text, **kwargs):
        assert text == "\\boxed{70}", f"parsed {text[:60]!r}: it should have been refused from its text"
        return real(text, **kwargs)

    monkeypatch.setattr(m, "parse", parse)


@pytest.mark.parametrize(
    "answer, why",
    [
        ("\\Gamma(10^{6})", "asks for numbers of ~5.57e+06 digits"),  # issue 34: 14 characters, 5 s before
        ("\\Gamma(2^{20})", "asks for numbers of ~5.86e+06 digits"),
        ("\\Gamma(1000000)", "asks for numbers of ~5.57e+06 digits"),
        ("\\gamma(1000000)", "asks for numbers of ~5.57e+06 digits"),
        ("\\Gamma(1{,}000{,}000)", "asks for numbers of ~5.57e+06 digits"),
        ("\\Gamma\\left((1000000)\\right)", "asks for numbers of ~5.57e+06 digits"),
        ("\\Gamma(\\Gamma(10))", "beyond count"),
        ("\\Gamma(\\binom{40}{20})", "beyond count"),
        ("\\binom{1000000}{500000}", "asks for numbers of ~3.01e+05 digits"),
        ("\\dbinom{100000}{50000}", "asks for numbers of ~3.01e+04 digits"),
        ("{1000000 \\choose 500000}", "asks for numbers of ~3.01e+05 digits"),
        (TOWER, "nests brackets 30 deep"),
        (PARENS, "nests brackets 499 deep"),
        ("{" * 30 + "4" + "}" * 30, "nests brackets 30 deep"),
        ("\\left(" * 7 + "4" + "\\right)" * 7, "nests brackets 7 deep"),
    ],
)
def test_shapes_the_parser_would_choke_on_are_refused_from_the_text(unparsed, answer, why):
    reward, reason = grade("70", answer)
    assert reward == 0.0 and why in reason and "not parsed" in reason, reason


@pytest.mark.parametrize(
    "answer, why",
    [
        ("\\gamma(10^{6}+\\frac{1}{2})", "digits"),
        ("\\Gamma(10^{3} \\cdot 10^{3})", "digits"),
        ("\\binom{10^{6}}{5 \\cdot 10^{5}}", "digits"),
        ("e^{e^{e^{e^{e}}}}", "beyond count"),
        ("2^" * 30 + "2", "digits"),
        ("\\tan(\\tan(\\tan(\\tan(\\tan(1)))))", "nests functions 5 deep"),
        ("\\int_0^1 e^{x^{x}} dx", "leaves an integral to compute"),
        ("\\prod_{k=1}^{1000000} k", "leaves a product to compute"),
        ("\\sum_{k=1}^{10^{6}} k^{k}", "leaves a sum to compute"),
    ],
)
def test_shapes_sympy_would_choke_on_are_refused_before_evaluating(answer, why):
    started = time.monotonic()
    reward, reason = grade("70", answer)
    assert reward == 0.0 and why in reason, reason
    # Parsing these costs up to ~1 s on a loaded 2-core machine; evaluating them took 2 s to hours.
    assert time.monotonic() - started < 4.0


@pytest.mark.parametrize(
    "gold, answer",
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\frac{\\pi}{4}", "\\frac{\\pi}{4}"),
        ("(0, 1]", "(0,1]"),
        ("(-\\infty, -2] \\cup [\\frac{1}{2}, \\infty)", "(-\\infty,-2]\\cup[\\frac12,\\infty)"),
        ("\\left(\\frac{\\sqrt{3}}{2}, \\frac{1}{2}\\right)", "\\left(\\frac{\\sqrt{3}}{2}, \\frac{1}{2}\\right)"),
        ("\\sqrt{\\frac{1+\\sqrt{5}}{2}}", "\\sqrt{\\frac{1+\\sqrt{5}}{2}}"),
        ("123456789012345678901234567890", "123456789012345678901234567890"),
        ("120", "\\binom{10}{3}"),
        ("120", "5!"),
        ("24", "\\Gamma(5)"),
        ("\\binom{2024}{1012}", "\\binom{2024}{1012}"),
        ("\\frac{1}{2}", "\\sin(\\frac{\\pi}{6})"),
        ("e^{\\frac{\\pi}{2}}", "e^{\\pi/2}"),
        ("\\ln(\\ln(2))", "\\ln(\\ln 2)"),
        # Over a limit, but no more than the ground truth itself: graded.
        ("\\sum_{k=1}^{n} k", "\\sum_{k=1}^{n} k"),
        ("(" * 7 + "4" + ")" * 7, "\\left(" * 7 + "4" + "\\right)" * 7),
        ("4", "(((((4)))))"),
    ],
)
def test_honest_answers_are_still_graded_right(gold, answer):
    assert grade(gold, answer) == (1.0, None)
    assert grade(gold, answer + "+1")[0] == 0.0


def test_the_bracket_depth_and_growth_estimates():
    assert m._nesting("[0, 1)") == 1 and m._nesting("\\left(\\frac{1}{2}\\right)") == 2
    assert m._nesting(")))(((") == 3  # stray closers do not go below 0
    assert m._growth_digits("\\Gamma(1000000)") == pytest.approx(5.566e6, rel=1e-3)  # 999999!
    assert m._growth_digits("\\binom{40}{20}") == pytest.approx(math.log10(137846528820))
    assert m._growth_digits("{40 \\choose 20}") == pytest.approx(math.log10(137846528820))
    assert m._growth_digits("\\Gamma(x) + \\gamma + \\Gamma(\\frac{1}{3})") == 0.0  # nothing the parser computes
    assert m._growth_digits("\\binom{5}{3!}") == math.inf  # a growth call inside another's argument
    assert m._growth_digits("\\binom{10}{3}\\binom{7}{2}") == pytest.approx(math.log10(120))  # side by side
    assert m._growth_digits("\\binom{10^{6}}{5}") == pytest.approx(27.92, abs=0.01)  # big n, small k: fine
    assert m._growth_digits("\\Gamma(10^{100})") == math.inf


# ---- the plain-integer shortcut (issue 30) ------------------------------------------------------
INTEGER_PAIRS = [
    ("12", "12"),
    ("12", "012"),
    ("12", "13"),
    ("-0", "0"),
    ("7", " 7\n"),
    ("-3", "-3"),
    ("5", "-5"),
    ("0", "00"),
    ("-40", "40"),
    ("99", "0099"),
    ("123456789012345678901234567890", "123456789012345678901234567890"),
    ("123456789012345678901234567890", "123456789012345678901234567891"),
]


@pytest.mark.parametrize("gold,answer", INTEGER_PAIRS)
def test_plain_integers_get_math_verifys_verdict_without_math_verify(gold, answer, monkeypatch):
    slow = m._grade_parsed(gold, answer)  # math_verify's own verdict and reason
    monkeypatch.setattr(m, "parse", lambda *a, **k: pytest.fail(f"math_verify parsed {a[0]!r} for {gold!r}/{answer!r}"))
    assert m._grade(gold, answer) == slow


@pytest.mark.parametrize("answer", ["1e2", "100.0", "+100", "10^2", "١٠٠", "100\u00a0", "(100)"])
def test_anything_but_a_plain_integer_still_goes_through_math_verify(answer, monkeypatch):
    seen = []
    real = m.parse
    monkeypatch.setattr(m, "parse", lambda text, **k: seen.append(text) or real(text, **k))
    assert m._grade("100", answer) == m._grade_parsed("100", answer)
    assert seen, f"{answer!r} was graded without math_verify"
