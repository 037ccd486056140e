"""Procedural tasks for the built-in environments (swarmrl/envs/builtin.py), as task rows.

A row's task_type is "env:NAME" and its verification_info the environment's task (JSON), so the
loaders, the leases and the trusted side handle them like any other row; the orchestrator sends
a worker the part of the task the environment's `visible` keeps (never a calculator's answer).

calculator  "Compute 37 * 48 - 19." with the calculator's rule in the prompt: two-digit
            products the tiny model gets wrong by itself, which the tool computes exactly.
guess       "I am thinking of a number from 1 to 16 ...": the hidden number depends on the
            episode's seed, so every row of a range is the same game, and rows differ by id.
The held-out split is decided by a hash of the problem, as for arithmetic.
"""

from __future__ import annotations

import hashlib
import json
import random

from swarmrl.envs.registry import task_type

CALCULATOR_RULE = (
    "You may use a calculator: write <calc>EXPRESSION</calc> and stop, and its value comes back as "
    "<result>VALUE</result>. Give the final answer as a number without a calculator call."
)
GUESS_RULE = "Say one number per turn; I answer higher or lower until you find it."


def _held_out(text: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def calculator_rows(n: int, *, digits: int = 2, split: str = "train", held_out_fraction: float = 0.1, seed: int = 0):
    """`n` distinct "a * b - c" / "a * b + c" problems with `digits`-digit operands."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    lo, hi = 10 ** (digits - 1) if digits > 1 else 1, 10**digits - 1
    if n > 0.25 * 2 * (hi - lo + 1) ** 3 * (held_out_fraction if split == "test" else 1 - held_out_fraction):
        raise ValueError(f"asked for {n} distinct {digits}-digit calculator problems: raise tasks.digits or lower n")
    rng = random.Random(f"{seed}-calculator-{digits}-{split}")
    rows, seen = [], set()
    while len(rows) < n:
        a, b, c, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi), rng.choice("+-")
        expression = f"{a} * {b} {op} {c}"
        if expression in seen or _held_out(expression, held_out_fraction) != (split == "test"):
            continue
        seen.add(expression)
        answer = a * b + c if op == "+" else a * b - c
        rows.append(
            {
                "problem_id": f"calc-{a}x{b}{'p' if op == '+' else 'm'}{c}",
                "task_type": task_type("calculator"),
                "prompt": f"Compute {expression}. {CALCULATOR_RULE}",
                "verification_info": json.dumps({"expression": expression, "answer": str(answer)}),
            }
        )
    return rows


def guess_rows(n: int, *, low: int = 1, high: int = 16, split: str = "train"):
    """`n` rows of the guessing game on [low, high] (the number comes from each episode's seed)."""
    if not low < high:
        raise ValueError(f"a guessing game needs low < high, got {low}, {high}")
    prompt = f"I am thinking of a number from {low} to {high}. {GUESS_RULE}"
    info = json.dumps({"low": low, "high": high})
    return [
        {
            "problem_id": f"guess-{split}-{i}",
            "task_type": task_type("guess"),
            "prompt": prompt,
            "verification_info": info,
        }
        for i in range(n)
    ]
