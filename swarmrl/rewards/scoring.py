"""Score completions for rows in the INTELLECT-2 task schema.

A row has ``problem_id``, ``task_type``, ``prompt``, ``verification_info`` (a
JSON string: for math ``{"ground_truth": ...}``, for code ``{"test_cases": ...}``,
see :mod:`swarmrl.rewards.code`), the model's ``completion``,
and optionally ``target_length`` (a thinking budget in tokens) and
``completion_length`` (its length in tokens, if already known).

Two kinds of failure are kept apart on purpose:

- ``Score.error`` means the row could not be scored: a missing or
  wrong-typed field, ``verification_info`` that is not JSON, an unknown ``task_type``, a
  code row given no sandbox, a verifier that timed out or crashed. Such
  rows get reward 0 and should be fixed or dropped, not learned from.
- A well-formed row whose answer is simply wrong (or missing, or written in
  an unclosed ``<think>``) gets ``error=None`` and reward 0; ``Score.reason``
  says why, for debugging.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from swarmrl.data.schema import CODE
from swarmrl.rewards import registry
from swarmrl.rewards.length import LENGTH_MODES, length_reward
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import Graders

CODE_NEEDS_SANDBOX = (
    "code rows are graded in the bubblewrap sandbox, and this scorer was started "
    "without one; pass graders=open_graders(rows, sandbox config) (swarmrl.rewards.registry)"
)

# Fields every row must have, with the types they may take.
_REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "problem_id": (str, int),
    "task_type": (str,),
    "prompt": (str,),
    "verification_info": (str, dict),
    "completion": (str,),
}

# Fields score_file adds to every output row.
OUTPUT_FIELDS = ("task_reward", "length_penalty", "reward", "error", "reason")


@dataclass(frozen=True)
class Score:
    """Reward for one row; ``length_penalty = task_reward - reward`` (0 without a target).

    ``error`` is set only when the row could not be scored; ``reason`` says
    why a scorable row got a task reward of 0 (see the module docstring).
    """

    task_reward: float
    length_penalty: float
    reward: float
    error: str | None
    reason: str | None = None


def _failed(error: str) -> Score:
    return Score(task_reward=0.0, length_penalty=0.0, reward=0.0, error=error)


def _is_instance(value: object, types: tuple[type, ...]) -> bool:
    """isinstance that does not let bools pass as ints (JSON true is not a number)."""
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _optional_int(row: dict, field: str, minimum: int) -> tuple[int | None, str | None]:
    """An optional integer field (absent or null means not given), or an error."""
    value = row.get(field)
    if value is None:
        return None, None
    if not _is_instance(value, (int,)) or value < minimum:
        kind = "a positive" if minimum > 0 else "a non-negative"
        return None, f"field '{field}' must be {kind} integer, got {value!r}"
    return value, None


class _Job(NamedTuple):
    """A validated row, ready to grade."""

    task_type: str
    verification_info: dict
    completion: str
    target_length: int | None
    completion_length: int | None


def _validate_row(row: Any) -> tuple[_Job | None, str | None]:
    """Turn a raw row into a job, or return an error naming the field and the problem."""
    if not isinstance(row, dict):
        return None, f"row must be a JSON object, got {type(row).__name__}"
    for field, types in _REQUIRED_FIELDS.items():
        if field not in row:
            return None, f"missing field '{field}'"
        if not _is_instance(row[field], types):
            allowed = " or ".join(t.__name__ for t in types)
            return None, f"field '{field}' must be {allowed}, got {type(row[field]).__name__}"
    info = row["verification_info"]
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as exc:
            return None, f"field 'verification_info' is not valid JSON: {exc.msg} at position {exc.pos}"
    if not isinstance(info, dict):
        return None, f"field 'verification_info' must hold a JSON object, got {type(info).__name__}"
    task_type = row["task_type"]
    grader = registry.get(task_type)
    if grader is None:
        known = ", ".join(registry.names())
        return None, (
            f"field 'task_type' has unknown value {task_type!r}; known task types: {known} "
            "(others can be added: swarmrl/rewards/registry.py)"
        )
    problem = grader.check(info)
    if problem is not None:
        return None, problem
    target_length, problem = _optional_int(row, "target_length", minimum=1)
    if problem is not None:
        return None, problem
    completion_length, problem = _optional_int(row, "completion_length", minimum=0)
    if problem is not None:
        return None, problem
    return _Job(task_type, info, row["completion"], target_length, completion_length), None


def _check_length_settings(length_mode: str, length_coef: float) -> None:
    """Reject a bad configuration up front rather than failing every row."""
    if length_mode not in LENGTH_MODES:
        raise ValueError(f"unknown length_mode {length_mode!r}; use one of {', '.join(LENGTH_MODES)}")
    if isinstance(length_coef, bool) or not isinstance(length_coef, (int, float)) or length_coef < 0:
        raise ValueError(f"length_coef must be a non-negative number, got {length_coef!r}")


def score_rows(
    rows: list[dict],
    *,
    pool: VerifierPool,
    count_tokens: Callable[[str], int],
    length_mode: str = "max",
    length_coef: float = 0.001,
    graders: Graders | None = None,
) -> list[Score]:
    """Score each row; one Score per row, in order.

    Rows that cannot be scored get reward 0 and an ``error`` naming the field
    and the problem; the others are still scored. Grading runs in ``pool``,
    grouped by task type; a task type whose grader owns a resource (code rows:
    the sandbox) is graded by its grader in ``graders`` (without one its rows get an error). When a row has
    ``target_length`` the task reward is
    shaped by :func:`~swarmrl.rewards.length.length_reward`; the length is the
    row's ``completion_length`` if given, else ``count_tokens(completion)``
    (which is only called for rows with a target).
    """
    _check_length_settings(length_mode, length_coef)
    scores: list[Score | None] = [None] * len(rows)
    jobs: dict[int, _Job] = {}
    for index, row in enumerate(rows):
        job, error = _validate_row(row)
        if job is None:
            scores[index] = _failed(error)
        else:
            jobs[index] = job
    for task in registry.types():
        indices = [index for index, job in jobs.items() if job.task_type == task.name]
        if not indices:
            continue
        calls = [(jobs[i].verification_info, jobs[i].completion) for i in indices]
        resource = graders.get(task.name) if graders is not None else None
        if task.grade is not None:
            outcomes = [(o.value, o.error) for o in pool.map(task.grade, calls)]
        elif resource is None:
            missing = (
                CODE_NEEDS_SANDBOX
                if task.name == CODE
                else (f"{task.name} rows need their grader opened; pass graders=open_graders(...)")
            )
            outcomes = [(None, missing)] * len(calls)
        else:
            outcomes = [(None, str(r)) if isinstance(r, Exception) else (r, None) for r in resource.grade_many(calls)]
        for index, (value, error) in zip(indices, outcomes):
            if error is not None:
                scores[index] = _failed(error)
                continue
            task_reward, reason = value
            scores[index] = _shape(float(task_reward), reason, jobs[index], count_tokens, length_mode, length_coef)
    return scores  # type: ignore[return-value]


def _shape(
    task_reward: float,
    reason: str | None,
    job: _Job,
    count_tokens: Callable[[str], int],
    length_mode: str,
    length_coef: float,
) -> Score:
    """Apply length control to a graded row."""
    if job.target_length is None:
        return Score(task_reward, 0.0, task_reward, None, reason)
    length = job.completion_length
    if length is None:
        length = count_tokens(job.completion)
    reward = length_reward(task_reward, length, job.target_length, length_mode, length_coef)
    return Score(task_reward, task_reward - reward, reward, None, reason)


def _read_jsonl(path: Path) -> list[tuple[int, dict | None, str | None]]:
    """``(line_number, row, error)`` for each non-blank line; a bad line keeps its number."""
    entries = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                entries.append((line_number, None, f"line {line_number} is not valid JSON: {exc.msg}"))
                continue
            if not isinstance(row, dict):
                message = f"line {line_number} must hold a JSON object, got {type(row).__name__}"
                entries.append((line_number, None, message))
                continue
            entries.append((line_number, row, None))
    return entries


def score_file(
    input_path: str | Path,
    output_path: str | Path,
    *,
    pool: VerifierPool,
    count_tokens: Callable[[str], int],
    length_mode: str = "max",
    length_coef: float = 0.001,
    graders: Graders | None = None,
) -> dict:
    """Score a JSONL file of rows into another JSONL file; return summary counts.

    Each output row keeps every input field and adds ``task_reward``,
    ``length_penalty``, ``reward``, ``error`` and ``reason`` (overwriting input
    fields of the same name). A line that is not a JSON object becomes
    ``{"line": N, ...}`` with the error, in its place. Blank lines are skipped.
    Returns ``{"rows", "scored", "errors", "mean_reward", "mean_reward_all_rows", "first_errors"}``:
    ``mean_reward`` averages the scored rows only (0.0 when there are none),
    ``mean_reward_all_rows`` counts rows that could not be scored as 0, and ``first_errors``
    lists up to 5 of those as ``{"line", "error"}``.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    entries = _read_jsonl(input_path)
    good = [row for _, row, _ in entries if row is not None]
    scores = score_rows(
        good,
        pool=pool,
        count_tokens=count_tokens,
        length_mode=length_mode,
        length_coef=length_coef,
        graders=graders,
    )
    good_scores = iter(scores)
    output_rows = []
    for line_number, row, error in entries:
        if row is None:
            output_rows.append({"line": line_number, **_score_fields(_failed(error))})
        else:
            output_rows.append({**row, **_score_fields(next(good_scores))})
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with output_path.open("w", encoding="utf-8") as handle:
        for row in output_rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    scored = [row["reward"] for row in output_rows if row["error"] is None]
    failed = [
        {"line": line_number, "error": row["error"]}
        for (line_number, _, _), row in zip(entries, output_rows)
        if row["error"] is not None
    ]
    return {
        "rows": len(output_rows),
        "scored": len(scored),
        "errors": len(failed),
        "mean_reward": sum(scored) / len(scored) if scored else 0.0,
        "mean_reward_all_rows": sum(scored) / len(output_rows) if output_rows else 0.0,
        "first_errors": failed[:5],
    }


def _score_fields(score: Score) -> dict:
    return {field: getattr(score, field) for field in OUTPUT_FIELDS}


# Fields score_instruction_file adds to every output row: IFEval's reference output fields.
INSTRUCTION_OUTPUT_FIELDS = (
    "follow_instruction_list_strict",
    "follow_instruction_list_loose",
    "follow_all_instructions_strict",
    "follow_all_instructions_loose",
    "error",
)


def is_instruction_row(row: Any) -> bool:
    """An IFEval-format row (``instruction_id_list``, ``kwargs``) rather than a task-schema one."""
    return isinstance(row, dict) and "instruction_id_list" in row and "task_type" not in row


def score_instruction_file(input_path: str | Path, output_path: str | Path, *, pool: VerifierPool) -> dict:
    """Grade IFEval-format rows (``key``, ``prompt``, ``instruction_id_list``, ``kwargs``) plus a
    ``completion`` field, in ``pool``; write each row with the strict and loose verdict of each
    instruction and of the row (IFEval's field names) and ``error`` (a bad row, or grading that
    failed: its verdicts are null). Returns the counts ``score_file`` returns, with
    ``prompt_strict``, ``prompt_loose``, ``instruction_strict`` and ``instruction_loose`` over
    the graded rows in place of the rewards."""
    from swarmrl.rewards.instructions import check_instructions, instructions_detail

    input_path, output_path = Path(input_path), Path(output_path)
    entries = _read_jsonl(input_path)
    out: list[dict] = []
    calls, slots = [], []
    for line_number, row, error in entries:
        if row is None:
            out.append({"line": line_number, **dict.fromkeys(INSTRUCTION_OUTPUT_FIELDS), "error": error})
            continue
        info = {"instruction_id_list": row.get("instruction_id_list"), "kwargs": row.get("kwargs")}
        completion = row.get("completion")
        problem = check_instructions(info)
        if problem is None and not isinstance(completion, str):
            problem = f"field 'completion' must be a string, got {type(completion).__name__}"
        out.append({**row, **dict.fromkeys(INSTRUCTION_OUTPUT_FIELDS), "error": problem})
        if problem is None:
            calls.append((info, completion))
            slots.append(len(out) - 1)
    for slot, outcome in zip(slots, pool.map(instructions_detail, calls)):
        if not outcome.ok:
            out[slot]["error"] = outcome.error
            continue
        detail = outcome.value
        out[slot].update({field: detail[field] for field in INSTRUCTION_OUTPUT_FIELDS if field != "error"})
        if detail["refused"]:
            out[slot]["reason"] = detail["refused"]
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with output_path.open("w", encoding="utf-8") as handle:
        for row in out:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    graded = [row for row in out if row["error"] is None]
    failed = [
        {"line": line_number, "error": row["error"]}
        for (line_number, _, _), row in zip(entries, out)
        if row["error"] is not None
    ]
    verdicts = {
        mode: [v for row in graded for v in row[f"follow_instruction_list_{mode}"]] for mode in ("strict", "loose")
    }

    def share(values: list) -> float:
        return sum(values) / len(values) if values else 0.0

    return {
        "rows": len(out),
        "scored": len(graded),
        "errors": len(failed),
        "prompt_strict": share([row["follow_all_instructions_strict"] for row in graded]),
        "prompt_loose": share([row["follow_all_instructions_loose"] for row in graded]),
        "instruction_strict": share(verdicts["strict"]),
        "instruction_loose": share(verdicts["loose"]),
        "first_errors": failed[:5],
    }
