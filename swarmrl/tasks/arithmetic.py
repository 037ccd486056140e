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


def prompt_for(problem: Problem) -> str:
    return f"Compute {problem.a} {problem.op} {problem.b}."


def trace_for(problem: Problem, *, slip: bool = False) -> str:
    """Column arithmetic right to left, one digit per line, then the boxed answer.

    Addition: `d1+d2=s`, or `d1+d2+1=s` with a carry, per column. Subtraction of a larger number
    is rewritten as the negation of the reverse difference, so every column step stays a small
    fact. `slip=True` writes the trace of a classic mistake: the carry (or borrow) is never
    passed to the next column, and the boxed answer is what that wrong trace adds up to. The SFT
    warm start mixes such traces in, so the base policy sometimes slips and RL has a consistent,
    checkable behaviour to fix (see docs/default-run.md).
    """
    a, b, op = problem.a, problem.b, problem.op
    lines = []
    negative = False
    if op == "-" and a < b:
        a, b, negative = b, a, True
        lines.append(f"{problem.a}<{problem.b} so -({a}-{b})")
    da, db = str(a)[::-1], str(b)[::-1]
    carry = 0
    digits = []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if op == "+":
            s = x + y + carry
            lines.append(f"{x}+{y}{'+1' if carry else ''}={s}")
            carry, digit = s // 10, s % 10
        else:
            s = x - y - carry
            if s < 0:
                lines.append(f"{x}-{y}{'-1' if carry else ''}={s}+10={s + 10}")
                carry, digit = 1, s + 10
            else:
                lines.append(f"{x}-{y}{'-1' if carry else ''}={s}")
                carry, digit = 0, s
        digits.append(digit)
        if slip and i + 1 < max(len(da), len(db)):
            carry = 0  # the mistake: the carry is dropped before the next column
    if op == "+" and carry:
        lines.append(f"carry {carry}")
        digits.append(carry)
    value = int("".join(str(d) for d in reversed(digits)))
    answer = -value if negative else value
    if not slip:
        assert answer == problem.answer, (problem, answer)
    think = "\n".join(lines)
    return f"<think>{think}</think>\n\\boxed{{{answer}}}"


def has_carry(problem: Problem) -> bool:
    """Whether a slip (dropped carry or borrow) would change this problem's trace."""
    return trace_for(problem) != trace_for(problem, slip=True)


def sample_problem(rng: random.Random, digits: int, ops: str) -> Problem:
    lo = 10 ** (digits - 1) if digits > 1 else 0
    hi = 10**digits - 1
    return Problem(rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops))


def generate(n: int, *, digits: int = 3, ops: str = "+-", split: str = "train",
             held_out_fraction: float = 0.1, seed: int = 0, with_trace: bool = False,
             slip_rate: float = 0.0) -> list[dict]:
    """`n` distinct rows of one split. `with_trace` adds a `trace` column for SFT, in which a
    problem with a carry gets the slipped trace with probability `slip_rate`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{seed}-{digits}-{ops}-{split}")
    want_test = split == "test"
    rows, seen = [], set()
    space = 2 * (10**digits) ** 2
    if n > space * (held_out_fraction if want_test else 1 - held_out_fraction) * 0.5:
        raise ValueError(f"asked for {n} distinct {digits}-digit problems in split {split!r}; "
                         "that is too close to all there are: raise `digits` or lower `n`")
    while len(rows) < n:
        p = sample_problem(rng, digits, ops)
        if p in seen or is_held_out(p, held_out_fraction) != want_test:
            continue
        seen.add(p)
        row = {
            "problem_id": p.problem_id,
            "task_type": TASK_TYPE,
            "prompt": prompt_for(p),
            "verification_info": json.dumps({"ground_truth": str(p.answer)}),
            "difficulty": digits,
        }
        if with_trace:
            slipped = slip_rate > 0 and has_carry(p) and rng.random() < slip_rate
            row["trace"] = trace_for(p, slip=slipped)
        rows.append(row)
    return rows
