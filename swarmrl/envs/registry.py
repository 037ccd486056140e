"""Environments by name. Adding one: a module defining an `Environment` (respond, reward, check;
see base.py for what they may not do) and one `register(ENV)` call, or a line in builtin.BUILTIN
for an environment shipped with swarmrl. tests/unit/test_envs.py registers one of its own."""

from __future__ import annotations

from swarmrl.envs.base import Environment
from swarmrl.envs.builtin import BUILTIN

_ENVS: dict[str, Environment] = {e.name: e for e in BUILTIN}

TASK_TYPE_PREFIX = "env:"
"""A task row whose task_type is "env:NAME" is an episode of environment NAME; its
verification_info is the environment's task."""


def register(env: Environment) -> Environment:
    """Add an environment (or replace one of the same name: the last registration wins)."""
    if not isinstance(env, Environment):
        raise TypeError(f"register() takes a swarmrl.envs.base.Environment, got {type(env).__name__}")
    _ENVS[env.name] = env
    return env


def get(name: str) -> Environment:
    """The environment called `name`; ValueError listing the known ones otherwise."""
    if name not in _ENVS:
        raise ValueError(f"no environment named {name!r}; known: {', '.join(names())} (register yours first)")
    return _ENVS[name]


def names() -> list[str]:
    return sorted(_ENVS)


def task_type(name: str) -> str:
    return TASK_TYPE_PREFIX + name


def for_task_type(task_type: object) -> Environment | None:
    """The environment a row's task_type names ("env:NAME"), None for a single-turn task type;
    ValueError for an "env:" type naming no registered environment."""
    if not isinstance(task_type, str) or not task_type.startswith(TASK_TYPE_PREFIX):
        return None
    return get(task_type[len(TASK_TYPE_PREFIX) :])
