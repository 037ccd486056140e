"""The task schema: one row per problem, as in PrimeIntellect/INTELLECT-2-RL-Dataset.

A row carries ``problem_id``, ``task_type``, ``prompt`` and ``verification_info``
(a JSON *string*, because that is how the public dataset stores it and because a
string survives parquet/arrow round trips without the schema unification that
struct columns suffer). Any other column (solve rates, sources, ...) is kept
untouched as an extra, so filters and curricula can read it later.

Validation here is the only gate between files on disk and the trainer: a row
that passes can be scored without re-checking its shape. What is deliberately
NOT checked here:

* Unknown ``task_type`` values are accepted. Loading must not depend on which
  reward functions happen to be registered; the scoring stage refuses types it
  has no verifier for, with a message naming the type. Their
  ``verification_info`` must still be a JSON object.
* Whether a math ground truth is parseable, or whether code tests pass: that is
  the verifier's job.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

MATH = "verifiable_math"
CODE = "prime_rl_code"

#: Task types whose ``verification_info`` shape this module knows and checks.
#: Add new types here together with a ``_check_<type>`` function below.
TASK_TYPES: frozenset[str] = frozenset({MATH, CODE})

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
        raise ValueError(
            f"{what} must decode to a JSON object, got {type(decoded).__name__}"
        )
    return decoded


def _check_math(info: Mapping[str, Any]) -> None:
    """Math rows are scored by comparing to ``ground_truth``; without it nothing can score."""
    if "ground_truth" not in info:
        raise ValueError(
            f"verifiable_math needs a 'ground_truth' key; found keys {sorted(info)}"
        )
    truth = info["ground_truth"]
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise ValueError(
            f"'ground_truth' must be a string or a number, got {type(truth).__name__}"
        )
    if isinstance(truth, str) and not truth.strip():
        raise ValueError("'ground_truth' is an empty string")
    if isinstance(truth, float) and not math.isfinite(truth):
        raise ValueError(f"'ground_truth' must be finite, got {truth}")


def decode_test_cases(info: Mapping[str, Any]) -> dict[str, Any]:
    """Return the code test cases as a dict, whether stored as a JSON string or inline.

    The public dataset double-encodes them (a JSON string inside the JSON
    string); hand-written files often do not. Both are accepted.
    """
    if "test_cases" not in info:
        raise ValueError(
            f"prime_rl_code needs a 'test_cases' key; found keys {sorted(info)}"
        )
    raw = info["test_cases"]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"'test_cases' is {describe_json_error(err)}") from None
    if not isinstance(raw, dict):
        raise ValueError(
            "'test_cases' must be a JSON object (or a JSON string of one) with "
            f"'inputs' and 'outputs' lists, got {type(raw).__name__}"
        )
    return raw


def check_code(info: Mapping[str, Any]) -> None:
    """Code rows pair each input with an expected output; a mismatch would misalign scoring."""
    cases = decode_test_cases(info)
    for key in ("inputs", "outputs"):
        if not isinstance(cases.get(key), list):
            got = type(cases[key]).__name__ if key in cases else "nothing"
            raise ValueError(f"'test_cases.{key}' must be a list, got {got}")
    n_in, n_out = len(cases["inputs"]), len(cases["outputs"])
    if n_in != n_out:
        raise ValueError(
            f"'test_cases' has {n_in} inputs but {n_out} outputs; they must pair up"
        )
    if n_in == 0:
        # Zero tests would make every program "pass": a free reward, not a task.
        raise ValueError("'test_cases' has no test cases")
    fn_name = cases.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.strip()):
        raise ValueError("'test_cases.fn_name', when present, must be a non-empty string")


_CHECKS = {MATH: _check_math, CODE: check_code}


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
        check = _CHECKS.get(task_type) if isinstance(task_type, str) else None
        if check is not None:
            check(decoded)
        return value

    def verification(self) -> dict[str, Any]:
        """The decoded ``verification_info``; a fresh dict, so callers may mutate it."""
        return json.loads(self.verification_info)

    def test_cases(self) -> dict[str, Any]:
        """Decoded ``{"inputs", "outputs", "fn_name"?}`` of a code task."""
        return decode_test_cases(self.verification())

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
    return message[len(prefix):] if message.startswith(prefix) else message


def parse_row(
    record: Any, row: int, source: str | None = None
) -> tuple[TaskRow | None, list[RowError]]:
    """Validate one raw record; return the row or the reasons it was refused.

    Returns errors instead of raising so a loader can collect every problem in
    a file in one pass rather than making the user fix them one run at a time.
    """
    if not isinstance(record, Mapping):
        problem = f"must be a JSON object, got {type(record).__name__}"
        return None, [RowError(row, RECORD_FIELD, problem, source)]
    try:
        return TaskRow.model_validate(dict(record)), []
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
