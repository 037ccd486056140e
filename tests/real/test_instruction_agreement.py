"""The instruction checkers against the reference implementations on IFBench's 294 sample
responses (tests/data/instruction_reference.json, made by tests/data/make_instruction_reference.py):
IFBench's own instructions per row, and each of IFEval's 25 types applied to every response."""

from __future__ import annotations

import json
from pathlib import Path

from swarmrl.eval.formats import load_benchmark
from swarmrl.rewards.instructions import grade_instructions

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "instruction_reference.json"
# Measured when this test was written: every verdict the references could give agrees, strict and
# loose (329 IFBench verdicts per mode, 7,350 IFEval ones). words:start_verb has no reference
# verdict offline (nltk's tagger model is downloaded at run time).
AGREEMENT = 1.0


def test_checkers_agree_with_the_references(real_data):
    reference = json.loads(REFERENCE.read_text())
    rows = [json.loads(line) for line in (real_data / "ifbench-test.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (real_data / "ifbench-sample-output.jsonl").read_text().splitlines()]
    responses = {sample["prompt"]: sample["response"] for sample in samples}
    agree = total = 0
    for row in rows:
        info = {"instruction_id_list": row["instruction_id_list"], "kwargs": row["kwargs"]}
        graded = grade_instructions(info, responses[row["prompt"]])
        for j, verdict in enumerate(reference["ifbench"][str(row["key"])]):
            if isinstance(verdict, list):
                total += 2
                agree += (graded.strict[j] == verdict[0]) + (graded.loose[j] == verdict[1])
    for instruction_id, probe in reference["ifeval"].items():
        info = {"instruction_id_list": [instruction_id], "kwargs": [probe["kwargs"]]}
        for row, verdict in zip(rows, probe["verdicts"]):
            graded = grade_instructions(info, responses[row["prompt"]])
            total += 2
            agree += (graded.strict[0] == verdict[0]) + (graded.loose[0] == verdict[1])
    assert total == 2 * (329 + 25 * 294)
    assert agree / total >= AGREEMENT


def test_ifbench_loads_as_an_ifeval_benchmark(real_data):
    rows = load_benchmark(real_data / "ifbench-test.jsonl")
    assert len(rows) == 294 and {r["task_type"] for r in rows} == {"instruction_following"}
