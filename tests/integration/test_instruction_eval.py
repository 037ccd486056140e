"""Instruction following end to end: `swarmrl eval` on a file in IFEval's row format (IFBench's
types and IFEval's) through --model and --endpoint with the tiny built-in model, and `swarmrl score`
on such rows with completions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_serve import Server

from swarmrl.model.checkpoint import build_tiny_policy, save_policy

from runs import swarmrl

pytestmark = pytest.mark.timeout(600)

ROWS = [
    {
        "key": 1,
        "prompt": "Describe the sea. Your response should not contain any whitespace.",
        "instruction_id_list": ["format:no_whitespace"],
        "kwargs": [{"N": None, "keyword": None}],
    },
    {
        "key": 2,
        "prompt": "Name a color. Do not use any commas, and end with the phrase 'Done.'",
        "instruction_id_list": ["punctuation:no_comma", "startend:end_checker"],
        "kwargs": [{}, {"end_phrase": "Done."}],
    },
    {
        "key": 3,
        "prompt": "Write about cats. Include at least 2 numbers.",
        "instruction_id_list": ["count:numbers", "keywords:existence"],
        "kwargs": [{"N": 2.0}, {"keywords": ["cat"]}],
    },
]
METRICS = ("ifeval/prompt_strict", "ifeval/prompt_loose", "ifeval/instruction_strict", "ifeval/instruction_loose")


def run_eval(out: Path, *args: str) -> tuple[dict, list[dict]]:
    swarmrl("eval", "--output-dir", str(out), *args)
    summary = json.loads((out / "summary.json").read_text())
    return summary, [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_eval_reports_ifevals_metrics_through_model_and_endpoint(tmp_path):
    model = tmp_path / "tiny"
    save_policy(*build_tiny_policy(seed=0), model)
    bench = tmp_path / "ifbench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["--benchmark", str(bench), "--k", "2", "--max-tokens", "16", "--seed", "0"]
    local, rows = run_eval(tmp_path / "local", "--model", str(model), *args)
    assert local["problems"] == 3 and local["errors"] == 0
    for key in METRICS:
        assert 0.0 <= local[key] <= 1.0
    assert local["ifeval/prompt_strict"] <= local["ifeval/prompt_loose"]
    assert "ifeval/type/punctuation:no_comma/strict" in local and "ifeval/type/count:numbers/loose" in local
    # Each sample's verdicts, one per instruction, strict and loose.
    detail = rows[1]["instructions"][0]
    assert detail["instruction_id_list"] == ["punctuation:no_comma", "startend:end_checker"]
    assert len(detail["follow_instruction_list_strict"]) == 2
    # Recomputed from the per-sample verdicts: the share of instructions followed (strict).
    verdicts = [v for r in rows for d in r["instructions"] for v in d["follow_instruction_list_strict"]]
    assert local["ifeval/instruction_strict"] == pytest.approx(sum(verdicts) / len(verdicts))
    server = Server(model, tmp_path)
    try:
        remote, _ = run_eval(tmp_path / "remote", "--endpoint", server.url, *args)
    finally:
        server.stop()
    for key in METRICS:
        assert remote[key] == local[key], key


def test_score_writes_strict_and_loose_per_instruction_and_row(tmp_path):
    rows = [
        {**ROWS[1], "completion": "Blue\nDone."},
        {**ROWS[1], "completion": "**Note**\nBlue, green.\nDone."},
        {**ROWS[0], "completion": "Intro line\nThe_sea_is_big."},
        {**ROWS[0], "instruction_id_list": ["format:no_such_thing"], "completion": "x"},
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = swarmrl("score", "--input", str(source), "--output", str(out), check=False)
    assert proc.returncode == 1 and "format:no_such_thing" in proc.stderr
    counts = json.loads(proc.stdout)
    assert counts["rows"] == 4 and counts["scored"] == 3 and counts["errors"] == 1
    graded = [json.loads(line) for line in out.read_text().splitlines()]
    assert graded[0]["follow_instruction_list_strict"] == [True, True]
    assert graded[0]["follow_all_instructions_strict"] is True
    assert graded[1]["follow_instruction_list_strict"] == [False, True]
    assert graded[1]["follow_instruction_list_loose"] == [False, True]
    assert graded[2]["follow_instruction_list_strict"] == [False]
    assert graded[2]["follow_instruction_list_loose"] == [True]  # without its first line
    assert "instruction_id_list[0]" in graded[3]["error"] and graded[3]["follow_instruction_list_strict"] is None
    assert counts["prompt_strict"] == pytest.approx(1 / 3) and counts["prompt_loose"] == pytest.approx(2 / 3)


def test_score_loads_the_checkers_models_before_the_first_answer(tmp_path):
    # langdetect's profiles and nltk's Punkt take ~0.4 s each to load here (more under load): inside
    # a 0.5 s answer budget a cold grading process was killed on such a row (issue 50). Preloaded,
    # the budget is the answer's.
    row = {
        "key": 1,
        "prompt": "Answer in English.",
        "instruction_id_list": ["language:response_language", "length_constraints:number_sentences"],
        "kwargs": [{"language": "en"}, {"relation": "at least", "num_sentences": 1}],
        "completion": "This is a short English sentence about the weather today.",
    }
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(row) + "\n")
    proc = swarmrl("score", "--input", str(source), "--output", str(out), "--workers", "1", "--timeout", "0.5")
    graded = json.loads(out.read_text().splitlines()[0])
    assert graded["error"] is None and graded["follow_instruction_list_strict"] == [True, True], (graded, proc.stderr)
