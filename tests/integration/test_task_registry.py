"""Adding a task type takes one new module and one registration (issue 14): a toy type, written
to a temp folder, registered through the config, graded by the real `swarmrl score` process
(its checks in-process, its grader in the grading pool's processes)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from swarmrl.rewards import registry
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import Graders, TaskType, open_graders
from swarmrl.rewards.scoring import score_rows

from runs import swarmrl

TOY_MODULE = textwrap.dedent('''
    """A toy task type: the completion must contain verification_info's word."""
    from swarmrl.rewards.registry import TaskType


    def check(info):
        return None if isinstance(info.get("word"), str) else "verification_info needs a 'word' string"


    def grade(info, completion):
        return (1.0, None) if info["word"] in completion else (0.0, "the word is missing")


    TASK = TaskType("toy_echo", check=check, grade=grade)
''')


def _row(word, completion, task_type="toy_echo"):
    return {
        "problem_id": word,
        "task_type": task_type,
        "prompt": f"say {word}",
        "verification_info": json.dumps({"word": word}),
        "completion": completion,
    }


def test_a_toy_task_type_is_one_module_plus_one_registration(tmp_path):
    (tmp_path / "toy_tasks.py").write_text(TOY_MODULE)
    rows = [_row("apple", "I say apple"), _row("pear", "I say plum"), {**_row("fig", "fig"), "verification_info": "{}"}]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    toy_path = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def score(*args: str) -> subprocess.CompletedProcess:
        cli = ("score", "--input", str(src), "--workers", "1", *args)
        return swarmrl(*cli, env=toy_path, timeout=120, check=False)

    proc = score("--output", str(tmp_path / "out.jsonl"), "--tasks.types", '["toy_tasks:TASK"]')
    # The "fig" row cannot be scored: written with its error, and the command exits 1 saying so.
    assert proc.returncode == 1 and "1 of 3 rows could not be scored" in proc.stderr, proc.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in out] == [1.0, 0.0, 0.0]
    assert out[1]["error"] is None and out[1]["reason"] == "the word is missing"
    assert out[2]["error"] == "verification_info needs a 'word' string"  # its check ran before grading

    # Without the registration the same rows are refused, naming the known types.
    proc = score("--output", str(tmp_path / "plain.jsonl"), "--allow-errors")
    assert proc.returncode == 0, proc.stderr
    plain = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert all("unknown value 'toy_echo'" in r["error"] and "verifiable_math" in r["error"] for r in plain)

    # A bad registration fails before any row is read, saying what to write.
    proc = score("--output", str(tmp_path / "x.jsonl"), "--tasks.types", '["toy_tasks"]')
    assert proc.returncode == 2 and "module:ATTRIBUTE" in proc.stderr and "Traceback" not in proc.stderr


class _CountingGrader:
    """A grader that owns a resource (as the code sandbox does): opened once, closed once."""

    opened = closed = 0

    def __init__(self, sandbox, log=None):
        type(self).opened += 1

    def grade_many(self, jobs):
        return [
            (float(len(completion)), None) if info["word"] != "boom" else RuntimeError("grader crashed")
            for info, completion in jobs
        ]

    def close(self):
        type(self).closed += 1


def test_a_task_type_whose_grader_owns_a_resource():
    task = TaskType("toy_resource", check=lambda info: None, open=_CountingGrader)
    before = registry.get("toy_resource")
    registry.register(task)
    try:
        rows = [_row("ab", "xyz", "toy_resource"), _row("boom", "q", "toy_resource"), _row("m", "1", "verifiable_math")]
        assert not open_graders([rows[2]], sandbox=None)  # only types present in the rows are opened
        with VerifierPool(1, 5.0) as pool, open_graders(rows, sandbox=None) as graders:
            scores = score_rows(rows, pool=pool, count_tokens=len, graders=graders)
            assert _CountingGrader.opened == 1
        assert _CountingGrader.closed == 1
        assert scores[0].reward == 3.0 and scores[1].error == "grader crashed"
        # Without its grader the rows say so instead of crashing the scorer.
        with VerifierPool(1, 5.0) as pool:
            lone = score_rows(rows[:1], pool=pool, count_tokens=len, graders=Graders())
        assert "toy_resource rows need their grader opened" in lone[0].error
    finally:
        registry._TYPES.pop("toy_resource")
        assert before is None


def test_task_type_definitions_are_checked():
    with pytest.raises(ValueError, match="exactly one of grade"):
        TaskType("neither", check=lambda info: None)
    with pytest.raises(TypeError):
        registry.register("not a task type")
    with pytest.raises(ValueError, match="cannot import"):
        registry.load(["no_such_module_here:TASK"])
    assert {"verifiable_math", "prime_rl_code", "multiple_choice"} <= set(registry.names())
