"""End to end: `swarmrl rl` on a mix of arithmetic and instruction following, with the tiny base
(real processes, sampled completions, proofs, the validator): instruction groups are leased,
graded and stored, and held-out accuracy is reported per source."""

from __future__ import annotations

import json

from harness import metrics, store_rows
from runs import EASY, swarmrl_rl


def test_a_mixed_run_grades_instruction_groups_and_reports_each_sources_accuracy(easy_base, tmp_path):
    run = tmp_path / "run"
    swarmrl_rl(
        run,
        easy_base,
        1,
        *EASY,
        "--tasks.source",
        "mix",
        "--tasks.mix",
        "{arithmetic = 1, instructions = 1}",
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
    assert [r["step"] for r in evals] == [0, 1]  # before and after
    for r in evals:
        assert {"eval/accuracy/arithmetic", "eval/accuracy/instructions", "eval/instruction_strict"} <= set(r)
        assert r["eval/problems"] == 16.0  # eval_size 8 per source
    groups = [json.loads(p) for (p,) in store_rows(run, "SELECT payload FROM groups")]
    graded = [g for g in groups if g["task_type"] == "instruction_following"]
    assert graded and all(len(g["rewards"]) == len(g["samples"]) for g in graded)
    assert json.loads(graded[0]["verification_info"])["reward"] == "fraction"
