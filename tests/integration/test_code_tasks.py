"""Tests for swarmrl.tasks.code: schema rows, and every expected output checked by running
the reference solutions for real (and the wrong ones, which must fail a test)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from swarmrl.data.schema import CODE, parse_row
from swarmrl.tasks.code import (
    FUNCTION,
    STDIN,
    TASK_TYPE,
    TASKS,
    CodeTask,
    generate,
    reference_completion,
    row_for,
    wrong_completion,
)

CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _program_of(completion: str) -> str:
    blocks = CODE_BLOCK.findall(completion)
    assert blocks, f"no ```python block in {completion!r}"
    return blocks[-1]


def _run(program: str, stdin: str) -> subprocess.CompletedProcess:
    # -I: isolated mode, so the repository and user site-packages cannot leak in.
    # check=False: a crash is a failed case, reported by the caller, not an exception here.
    return subprocess.run(
        [sys.executable, "-I", "-c", program], input=stdin, check=False, capture_output=True, text=True, timeout=10
    )


def _same(got, want) -> bool:
    """JSON values equal, floats within 1e-9; bool is not a number here (True != 1)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        if isinstance(want, float) or isinstance(got, float):
            return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        return got == want
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return got == want


def _failures(task: CodeTask, program: str, *, stop_at_first: bool = False) -> list[str]:
    """Run `program` on every test case of `task`; describe each case it fails."""
    failures = []
    for args, want in zip(task.inputs, task.outputs):
        if task.kind == STDIN:
            proc = _run(program, args)
            ok = proc.returncode == 0 and proc.stdout == want
            got = proc.stdout if proc.returncode == 0 else proc.stderr[-300:]
        else:
            caller = f"{program}\nimport json, sys\nprint(json.dumps({task.fn_name}(*json.loads(sys.stdin.read()))))\n"
            proc = _run(caller, json.dumps(args))
            try:
                ok = proc.returncode == 0 and _same(json.loads(proc.stdout), want)
            except json.JSONDecodeError:  # stray prints: a failed case, not a test error
                ok = False
            got = proc.stdout if proc.returncode == 0 else proc.stderr[-300:]
        if not ok:
            failures.append(f"input {args!r}: want {want!r}, got {got!r}")
            if stop_at_first:
                break
    return failures


def test_task_ids_unique_and_kinds_balanced():
    ids = [t.problem_id for t in TASKS]
    assert len(ids) == len(set(ids))
    assert all(i.startswith("code-") for i in ids)
    kinds = [t.kind for t in TASKS]
    assert kinds.count(STDIN) >= 5 and kinds.count(FUNCTION) >= 5
    assert set(kinds) == {STDIN, FUNCTION}


def test_task_type_is_schema_code():
    assert TASK_TYPE == CODE == "prime_rl_code"


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.problem_id)
def test_row_schema(task: CodeTask):
    row = row_for(task)
    assert set(row) == {"problem_id", "task_type", "prompt", "verification_info", "difficulty"}
    assert row["problem_id"] == task.problem_id
    assert row["task_type"] == "prime_rl_code"
    assert row["prompt"] == task.statement and "```python" in row["prompt"]
    assert isinstance(row["difficulty"], int) and 1 <= row["difficulty"] <= 3
    assert isinstance(row["verification_info"], str)
    info = json.loads(row["verification_info"])
    assert isinstance(info, dict) and isinstance(info["test_cases"], str)
    cases = json.loads(info["test_cases"])
    assert isinstance(cases, dict)
    assert len(cases["inputs"]) == len(cases["outputs"]) >= 4
    assert cases["inputs"] == task.inputs and cases["outputs"] == task.outputs
    if task.kind == FUNCTION:
        assert cases["fn_name"] == task.fn_name and task.fn_name
        assert f"def {task.fn_name}(" in task.solution
        assert all(isinstance(args, list) for args in cases["inputs"])
    else:
        assert "fn_name" not in cases and task.fn_name is None
        assert all(isinstance(s, str) and s.endswith("\n") for s in cases["inputs"])
        assert all(isinstance(s, str) and s.endswith("\n") for s in cases["outputs"])
    # The project's own loader accepts it as is.
    parsed, errors = parse_row(row, 1)
    assert errors == [] and parsed is not None


def test_edge_cases_covered():
    stdin_floats = [t for t in TASKS if t.kind == STDIN and any("." in o for o in t.outputs)]
    fn_floats = [t for t in TASKS if t.kind == FUNCTION and any(isinstance(o, float) for o in t.outputs)]
    assert stdin_floats and fn_floats
    assert 4 <= min(len(t.inputs) for t in TASKS) and max(len(t.inputs) for t in TASKS) <= 6


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.problem_id)
def test_reference_solution_passes_every_case(task: CodeTask):
    assert task.solution.endswith("\n")
    assert _failures(task, task.solution) == []


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.problem_id)
def test_completions_shape(task: CodeTask):
    for completion in (reference_completion(task), wrong_completion(task)):
        assert completion.startswith("<think>\n")
        assert "\n</think>\n" in completion
        assert completion.endswith("```\n")
        assert len(CODE_BLOCK.findall(completion)) == 1
    assert _program_of(reference_completion(task)) == task.solution
    assert _program_of(wrong_completion(task)) != task.solution


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.problem_id)
def test_wrong_completion_fails_a_case(task: CodeTask):
    program = _program_of(wrong_completion(task))
    assert _failures(task, program, stop_at_first=True), "the wrong program passed every case"


def test_generate_variants():
    plain = generate()
    assert [r["problem_id"] for r in plain] == [t.problem_id for t in TASKS]
    assert plain == [row_for(t) for t in TASKS]
    assert all("completion" not in r for r in plain)
    for mode, make in (("reference", reference_completion), ("wrong", wrong_completion)):
        rows = generate(completions=mode)
        assert [r["completion"] for r in rows] == [make(t) for t in TASKS]
        assert [{k: v for k, v in r.items() if k != "completion"} for r in rows] == plain


def test_generate_rejects_unknown_completions():
    with pytest.raises(ValueError, match="reference"):
        generate(completions="right")
