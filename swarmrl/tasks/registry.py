"""Task sources by name: where a run's problems come from when `tasks.source` names one.

A source is a name and a function `rows(tasks, options, n, split) -> list[dict]` returning `n`
rows of the "train" or "test" split in the task schema (swarmrl/data/schema.py: prompt, task_type,
verification_info, ...). `tasks` is the run's TasksConfig; `options` is `tasks.options` checked by
the source's own options model (None for a source without one). The held-out split must not share
problems with the training split (the built-in ones split by a hash of each problem).

The built-in sources below are registrations like any other; a plug-in (docs/plugins.md) adds one
with `register(TaskSource(...))`. `tasks.source` that names no registered source is read as a file
or a Hugging Face dataset folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from swarmrl.plugins import Registry
from swarmrl.tasks import arithmetic, episodes, instructions
from swarmrl.tasks.gym import GymOptions, gym_rows

RowsFn = Callable[..., list[dict]]


@dataclass(frozen=True)
class TaskSource:
    name: str
    rows: RowsFn
    """(tasks config, options, n, split) -> n rows of that split ("train" or "test")."""
    options: type[BaseModel] | None = None
    """The model `tasks.options` is checked against (None: the source takes no options)."""
    mixable: bool = True
    """Whether `tasks.source = "mix"` may draw from it (episode sources are run alone)."""
    help: str = ""


def _arithmetic(tasks, options, n: int, split: str) -> list[dict]:
    return arithmetic.generate(
        n, digits=tasks.digits, ops=tasks.ops, split=split, seed=tasks.seed, **arithmetic.options(tasks)
    )


def _instructions(tasks, options, n: int, split: str) -> list[dict]:
    return instructions.generate(n, split=split, seed=tasks.seed, **instructions.options(tasks))


def _calculator(tasks, options, n: int, split: str) -> list[dict]:
    return episodes.calculator_rows(
        n, digits=tasks.digits, split=split, held_out_fraction=tasks.held_out_fraction, seed=tasks.seed
    )


def _guess(tasks, options, n: int, split: str) -> list[dict]:
    return episodes.guess_rows(n, high=tasks.guess_high, split=split, turn_cost=tasks.guess_turn_cost)


BUILTIN = (
    TaskSource("arithmetic", _arithmetic, help="procedural math (tasks.digits, tasks.ops, tasks.style)"),
    TaskSource("instructions", _instructions, help="plain requests with IFEval constraints (docs/instructions.md)"),
    TaskSource("calculator", _calculator, mixable=False, help="episodes of the calculator environment"),
    TaskSource("guess", _guess, mixable=False, help="episodes of the guess-the-number environment"),
    TaskSource(
        "reasoning_gym",
        gym_rows,
        GymOptions,
        help="any reasoning-gym dataset by name with its config, graded by its own scorer (tasks.options)",
    ),
)

SOURCES: Registry[TaskSource] = Registry("task source", TaskSource, BUILTIN)
register, names, find, get = SOURCES.register, SOURCES.names, SOURCES.find, SOURCES.get


def options_of(source: TaskSource, options: dict) -> BaseModel | None:
    """`tasks.options` checked against the source's options model; ValueError naming the fields."""
    if source.options is None:
        if options:
            raise ValueError(f"tasks.options is set but task source {source.name!r} takes no options: remove it")
        return None
    try:
        return source.options.model_validate(options)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'options'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"tasks.options for task source {source.name!r}: {problems}") from None


def source_rows(tasks, name: str, n: int, split: str) -> list[dict]:
    """`n` rows of one split of the registered source `name`, as the run's tasks config sets it."""
    source = get(name)
    # In a mix each source's options are under its name: tasks.options = {my_source = {...}}.
    options = tasks.options.get(name, {}) if tasks.source == "mix" else tasks.options
    return source.rows(tasks, options_of(source, options), n, split)


def weights(tasks) -> dict[str, float]:
    """The registered sources of a run and their weights (summing to 1); empty for a file."""
    if tasks.source == "mix":
        total = sum(tasks.mix.values())
        return {name: weight / total for name, weight in tasks.mix.items()}
    return {tasks.source: 1.0} if find(tasks.source) is not None else {}
