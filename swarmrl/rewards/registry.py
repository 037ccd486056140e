"""Task types: the one table that says how each `task_type` is checked and graded.

A task type names
  check   verification_info -> error message or None, run in the scoring process before any
          grading (a row that cannot be graded gets the message as its error);
  grade   (verification_info, completion) -> (reward, reason), run in the grading pool, so a
          module-level function; or
  open    for a grader that owns a resource (the code sandbox's processes and uids):
          open(sandbox config, log) -> an object with grade_many(jobs) and close(). It is opened
          once per scorer, only when the rows hold this task type (`open_graders`);
  preload modules a grading process imports at start when the rows hold this task type
          (`preload_for`): what its grader would otherwise load inside an answer's time budget.

Adding a task type is one module with these functions and one `TaskType` line: in `BUILTIN`
below for a type shipped with swarmrl, or, without touching swarmrl, a module on the Python path
named in the config (`tasks.types = ["my_tasks:TASK"]`), which every process of a run loads
(`load`). docs/architecture.md walks through it; tests/integration/test_task_registry.py does it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from swarmrl.data.schema import CODE, MATH
from swarmrl.rewards.choice import MULTIPLE_CHOICE, check_choice, choice_task_reward
from swarmrl.rewards.code import open_code_grader, parse_test_cases
from swarmrl.rewards.gym import REASONING_GYM, check_gym, gym_task_reward
from swarmrl.rewards.instructions import INSTRUCTION_FOLLOWING, check_instructions, instructions_task_reward
from swarmrl.rewards.math import ground_truth_text, math_task_reward


class ResourceGrader(Protocol):
    def grade_many(self, jobs: list[tuple[dict, str]]) -> list[tuple[float, str | None] | Exception]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TaskType:
    name: str
    check: Callable[[dict], str | None]
    grade: Callable[[dict, str], tuple[float, str | None]] | None = None
    open: Callable[..., ResourceGrader] | None = None
    preload: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.grade is None) == (self.open is None):
            raise ValueError(f"task type {self.name!r} needs exactly one of grade (pool) or open (resource)")


def problem_of(parse: Callable[[dict], object]) -> Callable[[dict], str | None]:
    """A check from a parser that raises ValueError naming the problem (as the built-in ones do)."""

    def check(verification_info: dict) -> str | None:
        try:
            parse(verification_info)
        except ValueError as exc:
            return str(exc)
        return None

    return check


BUILTIN = (
    TaskType(MATH, check=problem_of(ground_truth_text), grade=math_task_reward),
    TaskType(CODE, check=problem_of(parse_test_cases), open=open_code_grader),
    TaskType(MULTIPLE_CHOICE, check=check_choice, grade=choice_task_reward),
    # IFEval/IFBench constraints, graded in the pool like math (so charged to an unproven sender
    # the same way); reward 1.0 when all are followed (swarmrl/rewards/instructions).
    TaskType(
        INSTRUCTION_FOLLOWING,
        check=check_instructions,
        grade=instructions_task_reward,
        preload=("swarmrl.rewards.instructions.preload",),  # its language and sentence models
    ),
    # reasoning-gym's procedural problems, graded by each dataset's own scorer (rewards/gym.py).
    TaskType(REASONING_GYM, check=check_gym, grade=gym_task_reward, preload=("reasoning_gym",)),
)

_TYPES: dict[str, TaskType] = {t.name: t for t in BUILTIN}


def register(task: TaskType) -> TaskType:
    """Add a task type (or replace one of the same name: the last registration wins)."""
    if not isinstance(task, TaskType):
        raise TypeError(f"register() takes a swarmrl.rewards.registry.TaskType, got {type(task).__name__}")
    _TYPES[task.name] = task
    return task


def get(name: Any) -> TaskType | None:
    return _TYPES.get(name) if isinstance(name, str) else None


def names() -> list[str]:
    return sorted(_TYPES)


def types() -> list[TaskType]:
    return list(_TYPES.values())


def checks() -> dict[str, Callable[[dict], str | None]]:
    """Each task type's check of its verification_info, for the loaders
    (`swarmrl.data.schema.parse_row(..., checks=...)`)."""
    return {name: task.check for name, task in _TYPES.items()}


def preload_for(rows: Iterable[dict]) -> tuple[str, ...]:
    """The modules a grading pool for `rows` should preload, beyond its defaults: those of the
    task types the rows hold (for `VerifierPool(preload=...)`)."""
    present = {row.get("task_type") for row in rows}
    return tuple(dict.fromkeys(m for task in types() if task.name in present for m in task.preload))


def load(specs: Iterable[str]) -> list[TaskType]:
    """Import and register task types named as "module:ATTRIBUTE" (a TaskType, or a list of them)."""
    loaded = []
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"task type {spec!r}: write it as 'module:ATTRIBUTE', e.g. 'my_tasks:TASK'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"task type {spec!r}: cannot import {module_name!r} ({e}); put it on PYTHONPATH or install it"
            ) from None
        value = getattr(module, attr, None)
        found = value if isinstance(value, (list, tuple)) else [value]
        if not found or not all(isinstance(t, TaskType) for t in found):
            raise ValueError(f"task type {spec!r}: {module_name}.{attr} is not a TaskType (or a list of them)")
        loaded += [register(t) for t in found]
    return loaded


class Graders:
    """The resource-owning graders one scorer holds open, by task type (e.g. the code sandbox).
    Empty when no row needs one. Close it (or use it as a context manager) when done."""

    def __init__(self, graders: dict[str, ResourceGrader] | None = None):
        self._graders = dict(graders or {})

    def get(self, task_type: str) -> ResourceGrader | None:
        return self._graders.get(task_type)

    def __bool__(self) -> bool:
        return bool(self._graders)

    def items(self):
        return self._graders.items()

    def close(self) -> None:
        for grader in self._graders.values():
            grader.close()
        self._graders.clear()

    def __enter__(self) -> Graders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_graders(rows: Iterable[dict], sandbox, log=None) -> Graders:
    """Open the resource graders the task types in `rows` need; a type's `open` raises with the
    fix when its resource is unavailable (SandboxUnavailable for code without bubblewrap)."""
    present = {row.get("task_type") for row in rows}
    opened: dict[str, ResourceGrader] = {}
    try:
        for task in types():
            if task.open is not None and task.name in present:
                opened[task.name] = task.open(sandbox, log=log)
    except BaseException:
        Graders(opened).close()
        raise
    return Graders(opened)
