"""End to end: `swarmrl rl` on a mix of arithmetic, instruction following and a reasoning-gym
dataset, with the tiny base (real processes, sampled completions, proofs, the validator):
instruction and reasoning-gym groups are leased, graded (the latter by reasoning-gym's own
scorer) and stored, and held-out accuracy is reported per source."""

from __future__ import annotations

import json

from harness import metrics, store_rows
from runs import EASY, swarmrl_rl

GYM = '{reasoning_gym = {dataset = "basic_arithmetic", config = {min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, operators = ["+", "-"]}}}'  # noqa: E501


def test_a_mixed_run_grades_instruction_groups_and_reports_each_sources_accuracy(easy_base, tmp_path):
    run = tmp_path / "run"
    swarmrl_rl(
        run,
        easy_base,
        2,
        *EASY,
        "--tasks.source",
        "mix",
        # reasoning-gym's basic_arithmetic ("Calculate 5 - 3."), which the tiny base half knows; its
        # weight makes its groups most of each batch (16 groups over 2 steps: none would be 1 in 65,536).
        "--tasks.mix",
        "{arithmetic = 1, instructions = 1, reasoning_gym = 2}",
        "--tasks.options",
        GYM,
        # The tiny base writes `<think>...</think>\boxed{N}`: no commas, so these groups grade 1
        # (all equal: the arithmetic groups carry the signal; this run checks the plumbing).
        "--tasks.instruction_types",
        '["punctuation:no_comma"]',
        "--tasks.max_constraints",
        "1",
        "--rewards.instruction_reward",
        "fraction",
        # One worker, fetching from the origin: nothing here is about relays or several workers,
        # and two processes fewer is CPU the suite's other tests get on 2 cores (issue 51).
        "--async.workers",
        "1",
        "--broadcast.relays",
        "0",
    )
    records = metrics(run)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # before and after
    for r in evals:
        assert {"eval/accuracy/arithmetic", "eval/accuracy/instructions", "eval/instruction_strict"} <= set(r)
        assert "eval/accuracy/reasoning_gym" in r
        assert r["eval/problems"] == 24.0  # eval_size 8 per source
    groups = [(json.loads(p), v) for p, v in store_rows(run, "SELECT payload, verdict FROM groups")]
    graded = [g for g, _ in groups if g["task_type"] == "instruction_following"]
    assert graded and all(len(g["rewards"]) == len(g["samples"]) for g in graded)
    assert json.loads(graded[0]["verification_info"])["reward"] == "fraction"
    # reasoning-gym groups: graded by its scorer (1 for the right number, less otherwise) and proven.
    gym = [(g, v) for g, v in groups if g["task_type"] == "reasoning_gym"]
    assert gym and all(0.0 <= r <= 1.0 for g, _ in gym for r in g["task_rewards"])
    assert all(json.loads(v)["ok"] for _, v in gym if v is not None)
    assert all(json.loads(g["verification_info"])["dataset"] == "basic_arithmetic" for g, _ in gym)
