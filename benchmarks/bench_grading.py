"""Grading cost per answer: honest answers on the real rows, honest LaTeX shapes, hostile answers.

What the per-answer grading budget (`rewards.verify_timeout_s`, docs/security.md "Grading") is
chosen from. Every answer is graded as the orchestrator grades it: `math_task_reward` in a
VerifierPool worker, a group of 8 per `map` call, timed from dispatch to result (pipe included).

1. Real rows (GSM8K test, AIME 2025: `make real-assets`): each row's gold answer graded against
   itself and against what an honest model writes instead: the number +-1, as a fraction, as a
   decimal (right and wrong), with units or text around it, with thousands separators, and at the
   end of a long reasoning completion.
2. Honest LaTeX shapes the integer golds of those sets never show (fractions, roots, pi,
   intervals, tuples, sets, matrices, trigonometry, big-but-fine integers), right and wrong.
3. A worker replaced after a timeout, as the orchestrator's lanes replace one (forked from a
   fork server): how long the replacement takes, and its first answers (sympy's LaTeX parser
   builds its caches again); a spawned worker's start beside it.
4. Hostile: the answers of issue 34 and their variants, each with what it cost under the budget
   (`rewards.verify_timeout_s`) and the reason it got.

Honest answers are measured under a generous timeout (`--timeout`), so none is cut short.

    python benchmarks/bench_grading.py [--rows 0] [--timeout 10] [--repeat 3] [--cold 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from swarmrl.rewards.math import math_task_reward
from swarmrl.rewards.pool import VerifierPool

FILES = ("aime2025.jsonl", "gsm8k-test.jsonl")
REASONING = (
    "Let me work through this step by step. First, I write down what is given: the quantities in "
    "the problem, and what is asked. Let $x$ be the unknown. Then $2x + 3 = 11$, so $x = 4$, and "
    "$\\frac{x}{2} = 2$. Checking: $2 \\cdot 4 + 3 = 11$, which matches. Next, the total is "
    "$4 \\times 12 = 48$ and half of it is $24$; with the discount of $25\\%$ we get $18$. "
)


def honest_variants(gold: str) -> dict[str, tuple[str, bool]]:
    """name -> (completion, whether it is right) for a gold answer (most variants: integer golds)."""
    box = "<think>{}</think> The answer is $\\boxed{{{}}}$."
    if not gold.lstrip("-").isdigit():  # an AIME gold such as 336^\circ
        return {"self": (box.format("short", gold), True), "long_reasoning": (box.format(REASONING * 12, gold), True)}
    n = int(gold)
    out = {
        "self": (box.format("short", gold), True),
        "plus_one": (box.format("short", n + 1), False),
        "minus_one": (box.format("short", n - 1), False),
        "fraction": (box.format("short", f"\\frac{{{2 * n}}}{{2}}"), True),
        "decimal": (box.format("short", f"{n}.0"), True),
        "decimal_wrong": (box.format("short", f"{n}.5"), False),
        "units": (box.format("short", f"{n} \\text{{ dollars}}"), True),
        "dollar_sign": (box.format("short", f"\\${n}"), True),
        "text": (box.format("short", f"x = {n}"), True),
        "long_reasoning": (box.format(REASONING * 12, gold), True),  # ~4 600 characters
    }
    if abs(n) >= 1000:
        out["thousands"] = (box.format("short", f"{n:,}".replace(",", "{,}")), True)
    return out


# (gold, answer, right): the answer shapes competition math has and GSM8K/AIME golds do not.
SHAPES = [
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac{1}{2}", "\\frac{2}{3}", False),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("2\\sqrt{2}", "3\\sqrt{2}", False),
    ("\\frac{\\pi}{4}", "\\frac{\\pi}{4}", True),
    ("\\pi", "3.14", False),
    ("(0, 1]", "(0,1]", True),
    ("[-2, 3)", "[-2,3]", False),
    ("(-\\infty, -2] \\cup [\\frac{1}{2}, \\infty)", "(-\\infty,-2]\\cup[\\frac12,\\infty)", True),
    ("\\left(\\frac{\\sqrt{3}}{2}, \\frac{1}{2}\\right)", "\\left(\\frac{\\sqrt{3}}{2}, \\frac{1}{2}\\right)", True),
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True),
    ("x^2+1", "1+x^{2}", True),
    ("x^2+1", "x^2-1", False),
    ("\\sqrt{\\frac{1+\\sqrt{5}}{2}}", "\\sqrt{\\frac{1+\\sqrt{5}}{2}}", True),
    ("e^{\\frac{\\pi}{2}}", "e^{\\pi/2}", True),
    ("\\sin(\\frac{\\pi}{12})", "\\frac{\\sqrt{6}-\\sqrt{2}}{4}", True),
    ("\\arctan(\\sqrt{3})", "\\frac{\\pi}{3}", True),
    ("\\log_{2} 3", "\\frac{\\ln 3}{\\ln 2}", True),
    ("3+2i", "2i+3", True),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", True),
    ("\\frac{-1 + \\sqrt{5}}{2}", "\\frac{\\sqrt{5}-1}{2}", True),
    ("2^{100}", "1267650600228229401496703205376", True),
    ("\\binom{10}{3}", "120", True),
    ("10!", "3628800", True),
    ("\\binom{2024}{1012}", "\\binom{2024}{1012}", True),
    ("123456789012345678901234567890", "123456789012345678901234567890", True),
    ("123456789012345678901234567890", "123456789012345678901234567891", False),
    ("\\frac{7}{3}", "2\\frac{1}{3}", True),
    ("5\\sqrt{3} - 2", "-2+5\\sqrt{3}", True),
]

TOWER = "2^{" * 30 + "2" + "}" * 30  # issue 34: 121 characters
HOSTILE = [
    "\\Gamma(10^{6})",  # issue 34: 14 characters
    TOWER,
    "(" * 499 + "1" + ")" * 499,  # issue 34
    "\\Gamma(1000000)",
    "\\gamma(10^{6})",
    "\\Gamma(\\Gamma(10))",
    "\\Gamma(\\binom{40}{20})",
    "\\binom{1000000}{500000}",
    "{1000000 \\choose 500000}",
    "\\binom{10^{6}}{5 \\cdot 10^{5}}",
    "\\binom{100000}{50000}",
    "(10^{6})!",
    "2^" * 30 + "2",
    "e^{e^{e^{e^{e}}}}",
    "\\tan(\\tan(\\tan(\\tan(\\tan(1)))))",
    "\\sin(\\sin(\\sin(\\sin(\\sin(1)))))",
    "\\int_0^1 e^{x^{x}} dx",
    "\\prod_{k=1}^{1000000} k",
    "\\sum_{k=1}^{10^{6}} k^{k}",
    "{" * 30 + "4" + "}" * 30,
    "\\left(" * 10 + "4" + "\\right)" * 10,
    "9^{9^{9^{9}}}",
    "+".join(f"\\sin(\\sqrt{{{k}}})" for k in range(2, 60)),  # no cheap check refuses it: ~70 s of sympy
    "\\tan(\\tan(\\tan(2)))",
]


def rows(limit: int) -> list[dict]:
    from swarmrl.assets.prepare import default_cache  # here: a grading process runs this script again

    data = default_cache() / "data"
    out = []
    for name in FILES:
        path = data / name
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `make real-assets` first")
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out[:limit] if limit else out


def figures(seconds: list[float]) -> str:
    s = sorted(seconds)
    if not s:
        return "none"
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return (
        f"n={len(s):5d}  p50 {p(0.5) * 1e3:7.1f} ms  p90 {p(0.9) * 1e3:7.1f} ms  p99 {p(0.99) * 1e3:7.1f} ms  "
        f"max {s[-1] * 1e3:7.1f} ms"
    )


def grade(pool: VerifierPool, calls: list[tuple[dict, str]]) -> list:
    """Grade in groups of 8, as a submission's group is graded."""
    out = []
    for i in range(0, len(calls), 8):
        out += pool.map(math_task_reward, calls[i : i + 8])
    return out


def main() -> None:
    from swarmrl.config.task import RewardsConfig  # here: a grading process runs this script again

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=0, help="real rows to use (0: all 1349)")
    parser.add_argument("--timeout", type=float, default=10.0, help="the pool's per-answer timeout while measuring")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the honest LaTeX shapes")
    parser.add_argument("--cold", type=int, default=4, help="workers replaced after a timeout, and timed")
    budget = RewardsConfig().verify_timeout_s
    parser.add_argument(
        "--budget", type=float, default=budget, help="per-answer budget for parts 3-4 (default: the run's)"
    )
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load {os.getloadavg()}")

    # 1. real rows
    calls, kinds, right = [], [], []
    for row in rows(args.rows):
        gold = json.loads(row["verification_info"])["ground_truth"]
        for kind, (completion, ok) in honest_variants(gold).items():
            calls.append(({"ground_truth": gold}, completion))
            kinds.append(kind)
            right.append(ok)
    with VerifierPool(1, args.timeout) as pool:
        grade(pool, [({"ground_truth": "1"}, "\\boxed{1}")] * 8)  # warm: the pool starts, then grades
        t0 = time.monotonic()
        outcomes = grade(pool, calls)
        wall = time.monotonic() - t0
        print(f"\n1. real rows: {len(calls)} answers of {len(calls) // max(1, len(set(kinds)))}+ rows in {wall:.0f} s")
        print(f"  {'all':16s} {figures([o.seconds for o in outcomes])}")
        for kind in dict.fromkeys(kinds):
            mine = [(o, r) for o, k, r in zip(outcomes, kinds, right) if k == kind]
            graded_as_meant = sum((o.ok and o.value[0] == 1.0) == r for o, r in mine)
            times = figures([o.seconds for o, _ in mine])
            print(f"  {kind:16s} {times}  graded as meant {graded_as_meant}/{len(mine)}")
        # What a new key's lease costs the lane: 8 prompts x 8 answers (the shipped sizes).
        leases = [sum(o.seconds for o in outcomes[i : i + 64]) for i in range(0, len(outcomes) - 63, 64)]
        print(f"  {'a lease (64)':16s} {figures(leases)}  (answers in row order, all variants mixed)")
        errors = [o.error for o in outcomes if not o.ok]
        print(f"  errors (timeouts, crashes): {len(errors)} {errors[:3]}")
        slowest = sorted(zip(outcomes, calls), key=lambda x: -x[0].seconds)[:5]
        for o, (info, completion) in slowest:
            gold = info["ground_truth"]
            print(f"    slowest: {o.seconds * 1e3:7.1f} ms  gold {gold!r}  answer ...{completion[-40:]!r}")

        # 2. honest LaTeX shapes
        shape_calls = [({"ground_truth": g}, f"<think>x</think> \\boxed{{{a}}}") for g, a, _ in SHAPES]
        times: dict[int, list[float]] = {i: [] for i in range(len(SHAPES))}
        meant = 0
        for _ in range(args.repeat):
            for i, o in enumerate(grade(pool, shape_calls)):
                times[i].append(o.seconds)
                meant += (o.ok and o.value[0] == 1.0) == SHAPES[i][2]
        print(f"\n2. honest LaTeX shapes, {args.repeat} rounds (the first is the first time this worker sees them)")
        print(f"  {'first round':16s} {figures([t[0] for t in times.values()])}")
        print(f"  {'later rounds':16s} {figures([x for t in times.values() for x in t[1:]])}")
        print(f"  graded as meant {meant}/{len(SHAPES) * args.repeat}")
        for i in sorted(times, key=lambda i: -max(times[i]))[:5]:
            print(f"    slowest: {max(times[i]) * 1e3:7.1f} ms  {SHAPES[i][1]!r} against {SHAPES[i][0]!r}")

    # 3. a worker replaced after a timeout
    budget = args.budget
    sample = [c for c, k in zip(calls, kinds) if k in ("self", "fraction", "units")][:8] + shape_calls[:8]
    restarts, first = [], []
    with VerifierPool(1, budget, start_method="forkserver") as fork_pool:
        for _ in range(args.cold):
            t0 = time.monotonic()
            (stuck,) = fork_pool.map(time.sleep, [(3 * budget,)])
            restarts.append(time.monotonic() - t0 - stuck.seconds)
            first += [o.seconds for o in grade(fork_pool, sample)]
    t0 = time.monotonic()
    with VerifierPool(1, budget):
        spawned = time.monotonic() - t0
    print(f"\n3. a worker replaced after a timeout (fork server): {figures(restarts)}")
    print(f"  {'its first answers':16s} {figures(first)}")
    print(f"  (a spawned worker, importing sympy itself, starts in {spawned * 1e3:.0f} ms)")

    # 4. hostile answers under the budget
    print(f"\n4. hostile answers (gold '70') under the budget of {budget:g} s, each after an honest one")
    with VerifierPool(1, budget, start_method="forkserver") as pool:
        for answer in HOSTILE:
            grade(pool, [({"ground_truth": "70"}, "\\boxed{71}")])  # a ready, warm worker
            t0 = time.monotonic()
            o = pool.map(math_task_reward, [({"ground_truth": "70"}, f"\\boxed{{{answer}}}")])[0]
            cost = time.monotonic() - t0  # a timeout's replacement included
            what = o.error if not o.ok else o.value[1]
            label = answer if len(answer) <= 40 else f"{answer[:30]}... ({len(answer)} chars)"
            print(f"  {cost * 1e3:8.1f} ms  {label:45s} {str(what)[:80]}")
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
