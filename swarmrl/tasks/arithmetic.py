"""Procedural arithmetic: the built-in task the embedded default learns.

Rows follow the INTELLECT-2 RL dataset schema (`problem_id`, `task_type`, `prompt`,
`verification_info` as a JSON string), so the same loaders, rewards and trainers handle them
and real datasets alike. Each problem also has a worked trace in the reasoning format
(`<think>...</think>` then `\\boxed{answer}`) that `swarmrl sft` uses for the warm start.

Difficulty is the number of digits per operand. The held-out split is decided by a hash of the
problem itself, never by generation order, so a problem can never be in both splits.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

TASK_TYPE = "verifiable_math"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str  # "+" or "-"

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def text(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def problem_id(self) -> str:
        return f"arith-{self.a}{'p' if self.op == '+' else 'm'}{self.b}"


def is_held_out(problem: Problem, held_out_fraction: float) -> bool:
    """Stable split membership: a hash of the problem, not of the random stream."""
    h = int.from_bytes(hashlib.sha256(problem.text.encode()).digest()[:8], "big")
    return (h % 10_000) < held_out_fraction * 10_000


def prompt_for(problem: Problem, style: str = "reasoning") -> str:
    if style == "plain":
        return f"What is {problem.a} {problem.op} {problem.b}? {PLAIN_INSTRUCTION}"
    return f"Compute {problem.a} {problem.op} {problem.b}."


# Styles of prompt and grading. "reasoning": the project's own format, taught by `swarmrl sft`
# (a <think> trace, then \boxed{answer}). "plain": a question as a user would ask a chat model that
# was never taught a format, graded on the last number it writes (math rows' "last_number"
# extraction): what a pretrained checkpoint brought from elsewhere can earn rewards on at once.
STYLES = ("reasoning", "plain")
PLAIN_INSTRUCTION = "Answer with only the number."


SLIPS = ("carry", "order")


VERBOSITY_LEVELS = (0, 1, 2)
_PLACES = ("ones", "tens", "hundreds", "thousands")


def trace_for(problem: Problem, *, slip: str | None = None, verbosity: int = 0) -> str:
    """Column arithmetic right to left, one digit per line, then the boxed answer.

    Addition: `d1+d2=s`, or `d1+d2+1=s` with a carry, per column. Subtraction of a larger number
    is rewritten as the negation of the reverse difference, so every column step stays a small
    fact. `slip` writes the trace of a classic mistake, with the boxed answer that mistake leads
    to: "carry" never passes a carry (or borrow) to the next column; "order" reads the column
    digits off in the order they were computed, so the answer comes out reversed. The SFT warm
    start mixes such traces in, so the base policy sometimes slips and RL has consistent,
    checkable behaviours to fix (see docs/default-run.md).

    `verbosity` says the same computation at more length, so that a policy can think for longer
    or shorter without changing what it computes (length control, docs/learning.md):
    0 one terse line per column (the default run's format): `6+7=13`;
    1 the digit written down as well: `6+7=13, write 3`;
    2 each column named, with its carry or borrow: `ones: 6+7=13, write 3, carry 1`.
    For two digits that is about 40, 55 and 80 tokens (docs/learning.md has the distribution).
    """
    if verbosity not in VERBOSITY_LEVELS:
        raise ValueError(f"verbosity must be one of {VERBOSITY_LEVELS}, got {verbosity!r}")
    a, b, op = problem.a, problem.b, problem.op
    lines = []
    negative = False
    if op == "-" and a < b:
        a, b, negative = b, a, True
        lines.append(
            f"{problem.a}<{problem.b} so -({a}-{b})"
            if verbosity < 2
            else f"{problem.a} is less than {problem.b}, so compute -({a}-{b})"
        )
    da, db = str(a)[::-1], str(b)[::-1]
    carry = 0
    digits = []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if op == "+":
            s = x + y + carry
            step = f"{x}+{y}{'+1' if carry else ''}={s}"
            carry, digit = s // 10, s % 10
            note = ", carry 1" if carry else ""
        else:
            s = x - y - carry
            if s < 0:
                step = f"{x}-{y}{'-1' if carry else ''}={s}+10={s + 10}"
                carry, digit = 1, s + 10
            else:
                step = f"{x}-{y}{'-1' if carry else ''}={s}"
                carry, digit = 0, s
            note = ", borrow 1" if carry else ""
        if verbosity == 0:
            lines.append(step)
        elif verbosity == 1:
            lines.append(f"{step}, write {digit}")
        else:
            place = _PLACES[i] if i < len(_PLACES) else f"column {i + 1}"
            lines.append(f"{place}: {step}, write {digit}{note}")
        digits.append(digit)
        if slip == "carry" and i + 1 < max(len(da), len(db)):
            carry = 0  # the mistake: the carry is dropped before the next column
    if op == "+" and carry:
        lines.append(f"carry {carry}" if verbosity < 2 else f"carry {carry} goes in front")
        digits.append(carry)
    if slip == "order":
        digits.reverse()
    value = int("".join(str(d) for d in reversed(digits)))
    answer = -value if negative else value
    if slip is None:
        assert answer == problem.answer, (problem, answer)
    think = "\n".join(lines)
    return f"<think>{think}</think>\n\\boxed{{{answer}}}"


def possible_slips(problem: Problem) -> list[str]:
    """The slips that would change this problem's answer."""
    right = trace_for(problem)
    return [s for s in SLIPS if _answer_of(trace_for(problem, slip=s)) != _answer_of(right)]


def _answer_of(trace: str) -> str:
    return trace.rsplit("\\boxed{", 1)[1].rstrip("}")


def options(tasks) -> dict:
    """The generate() keywords a run's tasks config sets beyond size, digits, ops and seed."""
    return {"style": tasks.style, "held_out_fraction": tasks.held_out_fraction}


def sample_problem(rng: random.Random, digits: int, ops: str) -> Problem:
    lo = 10 ** (digits - 1) if digits > 1 else 0
    hi = 10**digits - 1
    return Problem(rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops))


def generate(
    n: int,
    *,
    digits: int = 3,
    ops: str = "+-",
    split: str = "train",
    held_out_fraction: float = 0.1,
    seed: int = 0,
    with_trace: bool = False,
    slip_rate: float = 0.0,
    verbosity: tuple[int, ...] = (0,),
    style: str = "reasoning",
) -> list[dict]:
    """`n` distinct rows of one split. `with_trace` adds a `trace` column for SFT, in which a
    problem that admits a slip gets a slipped trace (a random one of its slips) with
    probability `slip_rate`, written at a verbosity level drawn uniformly from `verbosity`."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if digits < 1 or not ops or set(ops) - {"+", "-"}:
        raise ValueError(f"need digits >= 1 and ops made of '+' and '-', got digits={digits}, ops={ops!r}")
    rng = random.Random(f"{seed}-{digits}-{ops}-{split}")
    want_test = split == "test"
    rows, seen = [], set()
    # Distinct problems: operands span [lo, hi] (no leading zeros), one per distinct operator.
    lo = 10 ** (digits - 1) if digits > 1 else 0
    space = len(set(ops)) * (10**digits - lo) ** 2
    if n > space * (held_out_fraction if want_test else 1 - held_out_fraction) * 0.5:
        raise ValueError(
            f"asked for {n} distinct {digits}-digit problems in split {split!r}; "
            "that is too close to all there are: raise `digits` or lower `n`"
        )
    while len(rows) < n:
        p = sample_problem(rng, digits, ops)
        if p in seen or is_held_out(p, held_out_fraction) != want_test:
            continue
        seen.add(p)
        row = {
            "problem_id": p.problem_id,
            "task_type": TASK_TYPE,
            "prompt": prompt_for(p, style),
            "verification_info": json.dumps(
                {"ground_truth": str(p.answer)} | ({"extract": "last_number"} if style == "plain" else {})
            ),
            "difficulty": digits,
        }
        if with_trace:
            slips = possible_slips(p) if slip_rate > 0 else []
            slip = rng.choice(slips) if slips and rng.random() < slip_rate else None
            # Drawn only when there is a choice, so the default's random stream is unchanged.
            level = rng.choice(verbosity) if len(verbosity) > 1 else verbosity[0]
            row["trace"] = trace_for(p, slip=slip, verbosity=level)
        rows.append(row)
    return rows
