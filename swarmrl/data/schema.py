"""The task schema: one row per problem, as in PrimeIntellect/INTELLECT-2-RL-Dataset.

A row carries ``problem_id``, ``task_type``, ``prompt`` and ``verification_info``
(a JSON *string*, because that is how the public dataset stores it and because a
string survives parquet/arrow round trips without the schema unification that
struct columns suffer). Any other column (solve rates, sources, ...) is kept
untouched as an extra, so filters and curricula can read it later.

Validation here is the only gate between files on disk and the trainer: a row
that passes can be scored without re-checking its shape. The shape of each task
type's ``verification_info`` is not known here: it is the task type's ``check``
in the registry (``swarmrl.rewards.registry``), which loaders pass in
(``parse_row(..., checks=registry.checks())``), so a task type is declared in
one place. What is deliberately NOT checked here:

* Unknown ``task_type`` values are accepted. Loading must not depend on which
  reward functions happen to be registered; the scoring stage refuses types it
  has no verifier for, with a message naming the type. Their
  ``verification_info`` must still be a JSON object.
* Whether a math ground truth is parseable, or whether code tests pass: that is
  the verifier's job.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

MATH = "verifiable_math"
CODE = "prime_rl_code"

#: A task type's check of its decoded ``verification_info``: the problem, or None.
Checks = Mapping[str, Callable[[dict], "str | None"]]

#: ``RowError.field`` used when the problem is the record as a whole
#: (a JSONL line that is not JSON, a list item that is not an object).
RECORD_FIELD = "<record>"


@dataclass(frozen=True)
class RowError:
    """One problem with one row, precise enough to find and fix it in the file.

    ``row`` is 1-based: the line number for JSONL, the record's position
    otherwise. ``source`` names the file when a directory held several files,
    since row numbers restart in each file.
    """

    row: int
    field: str
    message: str
    source: str | None = None

    def __str__(self) -> str:
        where = f"{self.source} row {self.row}" if self.source else f"row {self.row}"
        return f"{where}, field '{self.field}': {self.message}"


def describe_json_error(err: json.JSONDecodeError) -> str:
    """Render a decode error without the char offset, which is noise for humans."""
    return f"not valid JSON ({err.msg}: line {err.lineno} column {err.colno})"


def _nonempty(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"{what} is empty; every row needs a non-empty {what}")
    return value


def _decode_object(text: str, what: str) -> dict[str, Any]:
    """Decode ``text`` and insist on a JSON object, since verifiers look up keys."""
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(describe_json_error(err)) from None
    if not isinstance(decoded, dict):
        raise ValueError(f"{what} must decode to a JSON object, got {type(decoded).__name__}")
    return decoded


class TaskRow(BaseModel):
    """One validated task. Extra columns are kept (``row.column(name)`` reads them).

    Frozen because rows are shared between the loader, samplers and scorers;
    nobody should be able to change a task under someone else's feet.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    # Order matters: task_type is validated before verification_info so the
    # latter's validator can see it.
    problem_id: str = Field(strict=True)
    task_type: str = Field(strict=True)
    prompt: str = Field(strict=True)
    verification_info: str = Field(strict=True)

    @field_validator("problem_id", "task_type", "prompt")
    @classmethod
    def _not_blank(cls, value: str, info: ValidationInfo) -> str:
        return _nonempty(value, str(info.field_name))

    @field_validator("verification_info")
    @classmethod
    def _valid_verification(cls, value: str, info: ValidationInfo) -> str:
        decoded = _decode_object(value, "verification_info")
        task_type = info.data.get("task_type")  # absent if task_type itself failed
        checks = (info.context or {}).get("checks") or {}
        check = checks.get(task_type) if isinstance(task_type, str) else None
        problem = check(decoded) if check is not None else None
        if problem:
            raise ValueError(problem)
        return value

    def verification(self) -> dict[str, Any]:
        """The decoded ``verification_info``; a fresh dict, so callers may mutate it."""
        return json.loads(self.verification_info)

    def column(self, name: str, default: Any = None) -> Any:
        """Any column by name, including extras such as solve rates."""
        if name in type(self).model_fields:
            return getattr(self, name)
        return (self.model_extra or {}).get(name, default)


def _error_message(err: Mapping[str, Any]) -> str:
    """Turn a pydantic error into a sentence that says what to fix."""
    kind = err.get("type", "")
    if kind == "missing":
        return "required field is missing"
    if kind == "string_type":
        return f"must be a string, got {type(err.get('input')).__name__}"
    message = str(err.get("msg", "invalid"))
    prefix = "Value error, "
    return message[len(prefix) :] if message.startswith(prefix) else message


def parse_row(
    record: Any, row: int, source: str | None = None, *, checks: Checks | None = None
) -> tuple[TaskRow | None, list[RowError]]:
    """Validate one raw record; return the row or the reasons it was refused.

    ``checks`` maps a task type to its ``verification_info`` check (verification_info -> the
    problem or None): the task-type registry's, ``swarmrl.rewards.registry.checks()``. Types
    without a check only need a JSON object there.

    Returns errors instead of raising so a loader can collect every problem in
    a file in one pass rather than making the user fix them one run at a time.
    """
    if not isinstance(record, Mapping):
        problem = f"must be a JSON object, got {type(record).__name__}"
        return None, [RowError(row, RECORD_FIELD, problem, source)]
    try:
        return TaskRow.model_validate(dict(record), context={"checks": checks}), []
    except ValidationError as exc:
        errors = [
            RowError(
                row,
                str(e["loc"][0]) if e.get("loc") else RECORD_FIELD,
                _error_message(e),
                source,
            )
            for e in exc.errors()
        ]
        return None, errors
