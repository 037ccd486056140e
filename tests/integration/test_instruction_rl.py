"""Instruction following as an RL task, on the trusted side: a real orchestrator process leases
rows of a math + instructions mix and grades hand-written instruction completions with the run's
reward mode; held-out evaluation reports each source's accuracy. (The whole loop with sampled
completions: tests/e2e/test_instruction_rl_e2e.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from swarmrl.config import load_config
from swarmrl.eval.training import evaluate
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.rewards.pool import DEFAULT_PRELOAD, VerifierPool
from swarmrl.rewards.registry import preload_for
from swarmrl.tasks.source import task_rows

from orchestrator_harness import OrchestratorProcess, honest_proofs, make_run_dir

pytestmark = pytest.mark.timeout(240)

TOK = build_char_tokenizer()
# Two constraint types whose verdicts on a few words are known by hand: "no commas", and a word
# count ("fewer than N", N >= 30: met by any short answer; "at least N", N >= 15: never met).
MIX = [
    "--tasks.source",
    "mix",
    "--tasks.mix",
    "{arithmetic = 1, instructions = 1}",
    "--tasks.digits",
    "1",
    "--tasks.instruction_types",
    '["punctuation:no_comma", "length_constraints:number_words"]',
    "--tasks.max_constraints",
    "2",
]
WITH_COMMA, WITHOUT = "a, b c", "no comma"  # both short enough for SMALL's 16 new tokens


def expected_fraction(info: dict, text: str) -> float:
    met = []
    for iid, kwargs in zip(info["instruction_id_list"], info["kwargs"]):
        if iid == "punctuation:no_comma":
            met.append("," not in text)
        else:
            met.append(kwargs["relation"] == "less than")
    return sum(met) / len(met)


def ids_of(text: str) -> list[int]:
    return TOK(f"<think>ok</think>{text}<|im_end|>", add_special_tokens=False)["input_ids"]


def test_the_orchestrator_grades_instruction_groups_with_the_runs_reward_mode(tmp_path):
    run = make_run_dir(
        tmp_path / "run",
        *MIX,
        "--rewards.instruction_reward",
        "fraction",
        "--validator.rate",
        "0",
        "--orchestrator.proven_after",
        "0",
        "--async.max_pending_groups",
        "10000",
        "--sampling.prompts_per_step",
        "1000",
    )
    rows = {r["problem_id"]: r for r in task_rows(load_config(run / "config.toml"), log=lambda *_: None)[0]}
    policy = run / "policies" / "v000000"
    orch = OrchestratorProcess(run).start()
    try:
        orch.publish_v0()
        worker = orch.new_worker("w")
        seen: dict[str, list] = {"verifiable_math": [], "instruction_following": []}
        for _ in range(6):
            lease = worker.lease(0)["lease"]
            groups, expected = [], []
            for prompt in lease["prompts"]:
                row = rows[prompt["problem_id"]]
                assert prompt["task_type"] == row["task_type"]
                info = json.loads(row["verification_info"])
                if row["task_type"] == "verifiable_math":
                    texts = [f"\\boxed{{{info['ground_truth']}}}", "\\boxed{99}"]
                    want = [1.0, 0.0]
                else:
                    assert info["reward"] == "fraction"  # the run's mode, in the row the orchestrator grades
                    texts = [WITH_COMMA, WITHOUT]
                    want = [expected_fraction(info, t) for t in texts]
                samples = [
                    {
                        "token_ids": ids_of(t),
                        "logprobs": [-0.5] * len(ids_of(t)),
                        "finish_reason": "stop",
                        "proofs": honest_proofs(policy, prompt["prompt_ids"], ids_of(t)),
                    }
                    for t in texts
                ]
                groups.append({"slot": prompt["slot"], "policy_version": 0, "samples": samples})
                expected.append(want)
                seen[row["task_type"]].append(len(info.get("instruction_id_list", [])))
            result = worker.submit({"lease_id": lease["lease_id"], "groups": groups})
            assert result["rejected"] == []
            got = [a["rewards"] for a in result["accepted"]]
            assert len(got) == len(expected) and all(g == pytest.approx(e) for g, e in zip(got, expected)), got
        # Both sources were leased, and instruction rows with one and with two constraints.
        assert seen["verifiable_math"] and {1, 2} <= set(seen["instruction_following"])
    finally:
        orch.stop()


def test_held_out_evaluation_reports_each_source_of_a_mix():
    cfg = load_config(
        None,
        [
            *MIX,
            "--tasks.train_size",
            "20",
            "--tasks.eval_size",
            "3",
            "--sampling.max_new_tokens",
            "8",
            "--eval.samples",
            "2",
        ],
    )
    held = task_rows(cfg, log=lambda *_: None)[1]
    assert [r["source"] for r in held] == ["arithmetic"] * 3 + ["instructions"] * 3
    torch.manual_seed(0)
    model, tokenizer = build_tiny_policy(seed=0)
    with VerifierPool(1, 5.0, preload=(*DEFAULT_PRELOAD, *preload_for(held))) as pool:
        metrics = evaluate(model.eval(), tokenizer, held, cfg, pool)
    by_source = [metrics["eval/accuracy/arithmetic"], metrics["eval/accuracy/instructions"]]
    assert metrics["eval/problems"] == 6.0
    assert metrics["eval/accuracy"] == pytest.approx(sum(by_source) / 2)  # equal counts: the mean
    assert 0.0 <= metrics["eval/instruction_strict"] <= 1.0 and all(0.0 <= a <= 1.0 for a in by_source)
