"""What an instruction is: an id, the arguments it takes (its ``kwargs``), and a check.

A check is a pure function ``check(response, **args) -> bool``: True when ``response`` follows
the instruction. Arguments are validated before any check runs (``parse_args``), so a check never
sees a missing or mistyped argument; a bad row is refused with the row's field named, not graded 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# IFEval's comparison relations, shared by every "how many" instruction that takes one.
LESS_THAN = "less than"
AT_LEAST = "at least"
RELATIONS = (LESS_THAN, AT_LEAST)

# Argument kinds.
COUNT = "count"  # a non-negative integer (JSON files often write it as 3.0)
NUMBER = "number"  # any finite number (a percentage)
TEXT = "text"  # a non-empty string
TEXTS = "texts"  # a list of non-empty strings
RELATION = "relation"  # one of RELATIONS

_KIND_HELP = {
    COUNT: "a non-negative integer",
    NUMBER: "a number",
    TEXT: "a non-empty string",
    TEXTS: "a list of non-empty strings",
    RELATION: f"one of {list(RELATIONS)}",
}


@dataclass(frozen=True)
class Instruction:
    """One instruction type: ``id`` (e.g. "punctuation:no_comma"), its arguments by kind, and its
    check. Every argument is required: the references pick a random value for a missing one,
    which would grade the same response differently on two runs."""

    id: str
    check: Callable[..., bool]
    params: Mapping[str, str]


def _convert(value: Any, kind: str) -> Any:
    """``value`` as ``kind`` wants it, or ValueError saying what it must be."""
    if kind == COUNT:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    elif kind == NUMBER:
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value == value
            and abs(value) != float("inf")
        ):
            return value
    elif kind == TEXT:
        if isinstance(value, str) and value.strip():
            return value
    elif kind == TEXTS:
        if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
            return list(value)
    elif kind == RELATION:
        if value in RELATIONS:
            return value
    raise ValueError(f"must be {_KIND_HELP[kind]}, got {value!r}")


def parse_args(instruction: Instruction, kwargs: Any) -> dict[str, Any]:
    """The arguments for ``instruction.check`` from a row's kwargs entry for it.

    A null argument counts as absent (IFBench's files write every argument of every type, null
    where unused). Raises ValueError naming the argument and what it must be.
    """
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"must be an object of arguments, got {type(kwargs).__name__}")
    given = {name: value for name, value in kwargs.items() if value is not None}
    unknown = sorted(set(given) - set(instruction.params))
    if unknown:
        takes = ", ".join(instruction.params) or "no arguments"
        raise ValueError(f"{instruction.id} takes {takes}; it does not take {', '.join(unknown)}")
    args = {}
    for name, kind in instruction.params.items():
        if name not in given:
            raise ValueError(f"{instruction.id} needs '{name}' ({_KIND_HELP[kind]})")
        try:
            args[name] = _convert(given[name], kind)
        except ValueError as e:
            raise ValueError(f"{instruction.id} argument '{name}' {e}") from None
    return args


def compare(count: int, relation: str, threshold: int) -> bool:
    """IFEval's comparison: ``count < threshold`` for "less than", ``count >= threshold`` for
    "at least"."""
    return count < threshold if relation == LESS_THAN else count >= threshold
