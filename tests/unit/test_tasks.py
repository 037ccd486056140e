"""Tests for swarmrl.tasks.arithmetic: traces, slips, splits, schema, limits."""

from __future__ import annotations

import json
import random
import re

import pytest

from swarmrl.tasks.arithmetic import (
    SLIPS,
    TASK_TYPE,
    Problem,
    generate,
    is_held_out,
    possible_slips,
    prompt_for,
    sample_problem,
    trace_for,
)

BOXED = re.compile(r"\\boxed\{(-?\d+)\}$")


def _boxed(trace: str) -> int:
    m = BOXED.search(trace)
    assert m, f"no final \\boxed{{int}} in {trace!r}"
    return int(m.group(1))


def _drops_a_carry(p: Problem) -> bool:
    """Whether column arithmetic passes a carry (or borrow) into a later column, worked out
    here independently of the module."""
    a, b = (p.b, p.a) if p.op == "-" and p.a < p.b else (p.a, p.b)
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    carry = 0
    for i in range(width - 1):  # a carry out of the last column is written, not passed on
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        carry = int(x + y + carry >= 10) if p.op == "+" else int(x - y - carry < 0)
        if carry:
            return True
    return False


def _random_problems(n: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        digits = 1 + i % 3
        yield sample_problem(rng, digits, "+-")
    # Mixed widths too: the column loop must pad the shorter operand.
    for _ in range(n // 4):
        yield Problem(rng.randint(0, 999), rng.randint(0, 99), rng.choice("+-"))
        yield Problem(rng.randint(0, 99), rng.randint(0, 999), rng.choice("+-"))


def test_trace_answer_is_ground_truth():
    problems = list(_random_problems(1500))
    assert {p.op for p in problems} == {"+", "-"}
    assert any(p.a < p.b for p in problems if p.op == "-")  # negative results covered
    for p in problems:
        trace = trace_for(p)
        assert trace.startswith("<think>") and "</think>\n\\boxed{" in trace
        assert _boxed(trace) == p.answer == (p.a + p.b if p.op == "+" else p.a - p.b), p


@pytest.mark.parametrize(
    ("a", "b", "op", "answer"),
    [
        (99, 1, "+", 100),
        (0, 0, "+", 0),
        (5, 7, "+", 12),
        (100, 1, "-", 99),
        (3, 10, "-", -7),
        (10, 10, "-", 0),
        (999, 999, "+", 1998),
    ],
)
def test_trace_edge_cases(a, b, op, answer):
    assert _boxed(trace_for(Problem(a, b, op))) == answer


def test_carry_slip_differs_exactly_when_a_carry_is_passed_and_is_then_wrong():
    problems = list(_random_problems(1500, seed=1))
    slipped = 0
    for p in problems:
        good, slip = trace_for(p), trace_for(p, slip="carry")
        if _drops_a_carry(p):
            slipped += 1
            assert slip != good
            assert _boxed(slip) != p.answer, (p, slip)
            assert "carry" in possible_slips(p)
        else:
            assert slip == good
            assert "carry" not in possible_slips(p)
    # Both kinds are common enough that the checks above are exercised.
    assert 0.2 * len(problems) < slipped < 0.8 * len(problems)


@pytest.mark.parametrize(
    ("a", "b", "op", "carries"),
    [
        (15, 17, "+", True),
        (12, 34, "+", False),
        (32, 17, "-", True),
        (47, 23, "-", False),
        (9, 9, "+", False),  # the carry out of the last column is not passed anywhere
        (17, 32, "-", True),
        (5, 123, "-", True),
        (995, 5, "+", True),
    ],
)
def test_carry_slip_known_cases(a, b, op, carries):
    p = Problem(a, b, op)
    assert _drops_a_carry(p) == carries
    assert (trace_for(p, slip="carry") != trace_for(p)) == carries


def test_every_slip_is_wrong_and_possible_slips_lists_exactly_those():
    assert set(SLIPS) >= {"carry"}
    for p in _random_problems(600, seed=2):
        wrong = [s for s in SLIPS if _boxed(trace_for(p, slip=s)) != p.answer]
        assert possible_slips(p) == wrong, p
        for s in SLIPS:
            trace = trace_for(p, slip=s)
            # A slip changes the answer, never the worked steps' format.
            assert trace.startswith("<think>") and "</think>\n\\boxed{" in trace
            if s not in wrong:
                assert _boxed(trace) == p.answer


def test_splits_are_disjoint_and_deterministic():
    train = generate(1000, digits=2, split="train", seed=3)
    test = generate(300, digits=2, split="test", seed=3)
    assert generate(1000, digits=2, split="train", seed=3) == train
    assert generate(300, digits=2, split="test", seed=3) == test
    train_ids = {r["problem_id"] for r in train}
    test_ids = {r["problem_id"] for r in test}
    assert len(train_ids) == 1000 and len(test_ids) == 300  # distinct within a split
    assert not train_ids & test_ids
    # Membership is a property of the problem, so other seeds never cross over either.
    other_test = {r["problem_id"] for r in generate(300, digits=2, split="test", seed=4)}
    assert not train_ids & other_test
    assert generate(1000, digits=2, split="train", seed=4) != train


def test_held_out_fraction_is_roughly_respected():
    rng = random.Random(0)
    problems = {sample_problem(rng, 3, "+-") for _ in range(5000)}
    share = sum(is_held_out(p, 0.1) for p in problems) / len(problems)
    assert 0.07 < share < 0.13


def test_rows_follow_the_schema():
    rows = generate(200, digits=2, ops="+-", split="train", seed=0, with_trace=True, slip_rate=0.5)
    for row in rows:
        assert set(row) >= {"problem_id", "task_type", "prompt", "verification_info"}
        assert isinstance(row["problem_id"], str) and row["problem_id"].startswith("arith-")
        assert row["task_type"] == TASK_TYPE == "verifiable_math"
        assert isinstance(row["verification_info"], str)
        info = json.loads(row["verification_info"])
        assert isinstance(info["ground_truth"], str)
        m = re.fullmatch(r"Compute (\d+) ([+-]) (\d+)\.", row["prompt"])
        assert m, row["prompt"]
        p = Problem(int(m.group(1)), int(m.group(3)), m.group(2))
        assert 10 <= p.a <= 99 and 10 <= p.b <= 99
        assert prompt_for(p) == row["prompt"] and p.problem_id == row["problem_id"]
        assert int(info["ground_truth"]) == p.answer
        assert row["trace"] in [trace_for(p)] + [trace_for(p, slip=s) for s in possible_slips(p)]
    slipped = sum(_boxed(r["trace"]) != int(json.loads(r["verification_info"])["ground_truth"]) for r in rows)
    assert 0 < slipped < len(rows)
    assert all("trace" not in r for r in generate(10, digits=2))


@pytest.mark.timeout(15)
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("ops", ["+", "-", "+-"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_asking_for_more_problems_than_exist_raises(digits, ops, split):
    """Never loop forever looking for problems that do not exist: raise instead."""
    lo = 10 ** (digits - 1) if digits > 1 else 0
    every = [Problem(a, b, op) for a in range(lo, 10**digits) for b in range(lo, 10**digits) for op in ops]
    available = sum(is_held_out(p, 0.1) == (split == "test") for p in every)
    with pytest.raises(ValueError, match="distinct"):
        generate(available + 1, digits=digits, ops=ops, split=split)
    n = max(1, available // 4)
    rows = generate(n, digits=digits, ops=ops, split=split)
    assert len({r["problem_id"] for r in rows}) == n


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="split"):
        generate(10, split="validation")
    with pytest.raises(ValueError, match="ops"):
        generate(10, digits=2, ops="*")
    with pytest.raises(ValueError, match="ops"):
        generate(10, digits=2, ops="")
    with pytest.raises(ValueError, match="digits"):
        generate(1, digits=0)


def test_verbosity_levels_say_the_same_computation_at_growing_length():
    # By hand: 36+47 at each level, and the subtraction that goes negative.
    p = Problem(36, 47, "+")
    assert trace_for(p, verbosity=0) == "<think>6+7=13\n3+4+1=8</think>\n\\boxed{83}"
    assert trace_for(p, verbosity=1) == "<think>6+7=13, write 3\n3+4+1=8, write 8</think>\n\\boxed{83}"
    assert trace_for(p, verbosity=2) == (
        "<think>ones: 6+7=13, write 3, carry 1\ntens: 3+4+1=8, write 8</think>\n\\boxed{83}"
    )
    assert trace_for(Problem(52, 87, "-"), verbosity=2).startswith(
        "<think>52 is less than 87, so compute -(87-52)\nones: 7-2=5, write 5\n"
    )
    assert "borrow 1" in trace_for(Problem(52, 17, "-"), verbosity=2)
    # Every level, with or without a slip, boxes the same answer as level 0 and is longer.
    for p in _random_problems(400, seed=5):
        for slip in (None, *possible_slips(p)):
            traces = [trace_for(p, slip=slip, verbosity=v) for v in (0, 1, 2)]
            assert len({_boxed(t) for t in traces}) == 1, traces
            assert len(traces[0]) < len(traces[1]) < len(traces[2]), traces
    with pytest.raises(ValueError, match="verbosity"):
        trace_for(p, verbosity=3)


def test_verbosity_draw_leaves_the_default_stream_alone():
    terse = generate(50, digits=2, ops="+-", with_trace=True, slip_rate=0.5, seed=3)
    assert terse == generate(50, digits=2, ops="+-", with_trace=True, slip_rate=0.5, seed=3, verbosity=(0,))
    mixed = generate(300, digits=2, ops="+-", with_trace=True, slip_rate=0.5, seed=3, verbosity=(0, 1, 2))
    assert any("write" not in r["trace"] for r in mixed)
    assert any("ones:" in r["trace"] for r in mixed)
    assert any("write" in r["trace"] and "ones:" not in r["trace"] for r in mixed)
