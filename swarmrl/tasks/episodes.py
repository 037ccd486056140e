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

from swarmrl.envs.builtin import CALCULATOR, GUESS
from swarmrl.envs.registry import task_type

CALCULATOR_RULE = "Tool: <calc>EXPR</calc>."
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


def guess_rows(n: int, *, low: int = 1, high: int = 16, split: str = "train", turn_cost: float = 0.0):
    """`n` rows of the guessing game on [low, high] (the number comes from each episode's seed);
    a found number pays 1 less `turn_cost` per turn after the first (the environment's reward)."""
    if not low < high:
        raise ValueError(f"a guessing game needs low < high, got {low}, {high}")
    prompt = f"I am thinking of a number from {low} to {high}. {GUESS_RULE}"
    task = {"low": low, "high": high}
    if turn_cost:
        task["turn_cost"] = turn_cost
    info = json.dumps(task)
    return [
        {
            "problem_id": f"guess-{split}-{i}",
            "task_type": task_type("guess"),
            "prompt": prompt,
            "verification_info": info,
        }
        for i in range(n)
    ]


def calculator_traces(rows: list[dict], *, tool_rate: float, seed: int = 0) -> list[dict]:
    """Worked episodes of calculator rows for the warm start, each a row with `turns` (the model's)
    and `observations` (the environment's own replies, from CALCULATOR.respond): a share
    `tool_rate` call the tool on the whole expression and copy its result; the rest answer at
    once with the right number (which a 1M-parameter model cannot learn to compute for unseen
    2-digit products, so its direct answers are mostly wrong: what RL can fix by calling the tool)."""
    rng = random.Random(f"{seed}-calculator-traces")
    out = []
    for row in rows:
        task = json.loads(row["verification_info"])
        if rng.random() < tool_rate:
            call = f"<calc>{task['expression']}</calc>"
            reply = CALCULATOR.respond(task, [call], 0)
            turns, observations = [call, task["answer"]], [reply.observation]
        else:
            turns, observations = [task["answer"]], []
        out.append({**row, "turns": turns, "observations": observations})
    return out


def guess_traces(n: int, *, high: int, max_turns: int, seed: int = 0) -> list[dict]:
    """Worked games for the warm start: each turn writes the range the number is still in and a
    guess drawn uniformly from it ("[9,16] 12"), the environment's reply follows (higher, lower;
    a found number ends the game), up to `max_turns` turns. Uniform guesses find the number less
    often within the turns than halving the range does: what RL can learn from the reward."""
    rng = random.Random(f"{seed}-guess-traces")
    row = guess_rows(1, high=high)[0]
    task = json.loads(row["verification_info"])
    out = []
    for _ in range(n):
        env_seed = rng.randrange(1 << 62)
        low, top, turns, observations = int(task["low"]), int(task["high"]), [], []
        while len(turns) < max_turns:
            guess = rng.randint(low, top)
            turns.append(f"[{low},{top}] {guess}")
            reply = GUESS.respond(task, turns, env_seed)
            if reply.done:
                break
            observations.append(reply.observation)
            low, top = (guess + 1, top) if reply.observation == "higher" else (low, guess - 1)
        out.append({**row, "turns": turns, "observations": observations[: len(turns) - 1], "env_seed": env_seed})
    return out
