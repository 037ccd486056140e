"""Code tasks through the real entry points: `swarmrl tasks` and `swarmrl score` as commands,
the orchestrator process scoring code completions in its sandbox, and `swarmrl rl` refusing
code tasks where bubblewrap cannot run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.tasks import code as code_tasks

from orchestrator_harness import OrchestratorProcess, honest_proofs, make_run_dir

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "swarmrl.cli"]


def swarmrl(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kwargs)


def code_run_dir(tmp_path, *overrides: str):
    """A run directory whose task source is the built-in code tasks, one held out."""
    source = tmp_path / "code.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in code_tasks.generate()))
    return make_run_dir(tmp_path / "run", "--tasks.source", str(source), "--tasks.eval_size", "1", *overrides)


def test_tasks_and_score_commands_grade_reference_and_wrong_programs(tmp_path):
    rows = tmp_path / "code.jsonl"
    for kind in ("reference", "wrong"):
        made = swarmrl("tasks", "--kind", "code", "--completions", kind, "--output", str(rows.with_suffix(f".{kind}")))
        assert made.returncode == 0, made.stderr
    # One file: references, wrong programs, a math row and a broken code row side by side.
    lines = (rows.with_suffix(".reference").read_text() + rows.with_suffix(".wrong").read_text()).splitlines()
    math_row = {
        "problem_id": "m",
        "task_type": "verifiable_math",
        "prompt": "1+1?",
        "verification_info": json.dumps({"ground_truth": "2"}),
        "completion": "\\boxed{2}",
    }
    broken = {**json.loads(lines[0]), "problem_id": "broken", "verification_info": json.dumps({"test_cases": "{"})}
    rows.write_text("\n".join(lines + [json.dumps(math_row), json.dumps(broken)]) + "\n")
    out = tmp_path / "scored.jsonl"
    # The broken row makes the command exit 1 (it says which row); --allow-errors is the opt-out.
    scored = swarmrl("score", "--input", str(rows), "--output", str(out), "--sandbox.workers", "2", "--allow-errors")
    assert scored.returncode == 0, scored.stderr
    n = len(code_tasks.TASKS)
    summary = json.loads(scored.stdout)
    assert {k: summary[k] for k in ("rows", "scored", "errors")} == {
        "rows": 2 * n + 2,
        "scored": 2 * n + 1,
        "errors": 1,
    }
    assert summary["mean_reward"] == pytest.approx((n + 1) / (2 * n + 1))
    assert summary["first_errors"] == [{"line": 2 * n + 2, "error": summary["first_errors"][0]["error"]}]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward"] for r in results[:n]] == [1.0] * n
    assert all(r["reward"] == 0.0 and "wrong answer" in r["reason"] for r in results[n : 2 * n])
    assert results[2 * n]["reward"] == 1.0
    assert "'test_cases' is not valid JSON" in results[-1]["error"]


def test_score_refuses_code_rows_when_bubblewrap_cannot_run(tmp_path):
    rows = tmp_path / "code.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in code_tasks.generate(completions="reference")))
    out = tmp_path / "scored.jsonl"
    refused = swarmrl("score", "--input", str(rows), "--output", str(out), "--sandbox.bwrap", "/nonexistent/bwrap")
    assert refused.returncode == 2
    assert "apt-get install bubblewrap" in refused.stderr and "Traceback" not in refused.stderr
    assert not out.exists()
    unsafe = swarmrl(
        "score",
        "--input",
        str(rows),
        "--output",
        str(out),
        "--sandbox.bwrap",
        "/nonexistent/bwrap",
        "--sandbox.unsafe_no_sandbox",
        "true",
    )
    assert unsafe.returncode == 0 and "WARNING: sandbox.unsafe_no_sandbox is set" in unsafe.stderr
    assert json.loads(unsafe.stdout)["mean_reward"] == 1.0


def test_rl_refuses_code_tasks_without_a_sandbox_before_doing_any_work(tmp_path):
    rows = tmp_path / "code.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in code_tasks.generate()))
    run = tmp_path / "run"
    refused = swarmrl("rl", "--run-dir", str(run), "--tasks.source", str(rows), "--sandbox.bwrap", "/nonexistent/bwrap")
    assert refused.returncode == 2, refused.stderr
    assert "apt-get install bubblewrap" in refused.stderr and "Traceback" not in refused.stderr
    assert not (run / "config.toml").exists()  # refused before the run was prepared


def test_the_orchestrator_scores_code_completions_in_its_sandbox(tmp_path):
    tok = build_char_tokenizer()
    run = code_run_dir(
        tmp_path,
        "--sampling.max_new_tokens",
        "400",
        "--validator.rate",
        "0",
        "--sandbox.workers",
        "2",
    )
    by_id = {t.problem_id: t for t in code_tasks.TASKS}
    orch = OrchestratorProcess(run).start()
    try:
        orch.publish_v0()
        worker = orch.new_worker("coder")
        lease = worker.lease(0)["lease"]
        groups = []
        for prompt in lease["prompts"]:
            task = by_id[prompt["problem_id"]]
            samples = []
            for text in (code_tasks.reference_completion(task), code_tasks.wrong_completion(task)):
                ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
                assert len(ids) <= 400 and tok.decode(ids, skip_special_tokens=False).startswith(text)
                samples.append(
                    {
                        "token_ids": ids,
                        "logprobs": [-0.5] * len(ids),
                        "finish_reason": "stop",
                        "proofs": honest_proofs(run / "policies" / "v000000", prompt["prompt_ids"], ids),
                    }
                )
            groups.append({"slot": prompt["slot"], "policy_version": 0, "samples": samples})
        result = worker.submit({"lease_id": lease["lease_id"], "groups": groups})
        assert result["rejected"] == []
        assert [a["rewards"] for a in result["accepted"]] == [[1.0, 0.0]] * len(groups)
    finally:
        orch.stop()


def test_the_orchestrator_will_not_start_on_code_tasks_without_a_sandbox(tmp_path):
    run = code_run_dir(
        tmp_path,
        "--sandbox.bwrap",
        "/nonexistent/bwrap",
    )
    orch = OrchestratorProcess(run)
    with pytest.raises(RuntimeError, match="did not start"):
        orch.start(timeout_s=60)
    assert "apt-get install bubblewrap" in orch.log() and "Traceback" not in orch.log()
    orch.stop()


def test_the_char_tokenizer_round_trips_every_built_in_completion():
    tok = build_char_tokenizer()
    for task in code_tasks.TASKS:
        for text in (code_tasks.reference_completion(task), code_tasks.wrong_completion(task)):
            assert tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=False) == text
