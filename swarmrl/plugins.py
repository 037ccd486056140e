"""Plug-ins: modules from outside swarmrl that register what a run uses.

A plug-in is an importable module (from a package installed with pip, or on PYTHONPATH) whose
import registers things with swarmrl's registries, as the built-in ones are registered:

    task sources      swarmrl.tasks.registry.register(TaskSource(...))
    environments      swarmrl.envs.registry.register(Environment)
    engine backends   swarmrl.inference.backends.register(EngineBackend(...))
    reward functions  swarmrl.rewards.registry.register(TaskType(...))

A run names its plug-ins in its config (`plugins = ["my_pkg.swarmrl_plugin"]`); every role also
takes `--plugin MODULE` (repeatable). Both are imported before anything else is resolved, so a
plug-in's source, environment or engine can be named in the same config or on the same command
line. A worker or validator also learns the run's plug-ins from the orchestrator (GET /v1/status)
and imports them before its first lease; one that lacks a plug-in stops and names it.

Importing a module runs its code: name only modules you installed. A worker imports the
plug-ins an orchestrator names only when they are installed on its machine (installing them is
the operator's consent) and never a module of Python's standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Iterable
from typing import Generic, TypeVar

from swarmrl.errors import SwarmrlError

T = TypeVar("T")

FLAG = "--plugin"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_LOADED: list[str] = []


class PluginError(SwarmrlError, ValueError):
    """A plug-in that cannot be named, found or imported; the message says which and what to do."""


def check_name(name: object) -> str:
    """`name` if it can name a plug-in module (a dotted Python name outside the standard library)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise PluginError(f"plug-in {name!r}: give a module's dotted import name, e.g. 'my_pkg.swarmrl_plugin'")
    if name.split(".")[0] in sys.stdlib_module_names:
        raise PluginError(f"plug-in {name!r} is a module of Python's standard library, not a plug-in")
    return name


def installed(name: str) -> bool:
    """Whether `name` can be imported here (without importing it, as far as Python allows: a
    dotted name imports its parent packages)."""
    try:
        return importlib.util.find_spec(check_name(name)) is not None
    except (ImportError, ValueError):
        return False


def load(names: Iterable[str], *, where: str = "--plugin") -> list[str]:
    """Import each plug-in once (a second load of one is free); `where` says who named them, for
    the error. Returns the names, in order."""
    out = []
    for name in names:
        check_name(name)
        if name not in _LOADED:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                    raise PluginError(
                        f"plug-in {name!r} ({where}) is not installed here: install the package that provides "
                        f"it (pip install ...) or put its folder on PYTHONPATH"
                    ) from None
                raise PluginError(
                    f"plug-in {name!r} ({where}) failed to import: it needs {e.name!r}, not installed"
                ) from e
            except SwarmrlError:
                raise
            except Exception as e:  # a plug-in's own bug: say whose, keep the traceback as the cause
                raise PluginError(f"plug-in {name!r} ({where}) failed to import: {type(e).__name__}: {e}") from e
            _LOADED.append(name)
        out.append(name)
    return out


def follow(names: Iterable[str], *, where: str) -> list[str]:
    """Import the plug-ins a run names (a worker or validator reads them from the orchestrator):
    each installed one is imported; when any is missing, PluginError names them all, so the
    operator installs them in one go rather than one restart each."""
    names = [check_name(n) for n in names]
    missing = [n for n in names if n not in _LOADED and not installed(n)]
    if missing:
        raise PluginError(
            f"this run uses the plug-in{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} ({where}), "
            "not installed here: install the package that provides each (pip install ...), or put its folder on "
            "PYTHONPATH, and start again"
        )
    return load(names, where=where)


def loaded() -> list[str]:
    """The plug-ins this process imported, in order."""
    return list(_LOADED)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`--plugin` modules, the other arguments) of a command line: `--plugin M` and `--plugin=M`,
    anywhere, as often as needed, taken out before the command's own flags are parsed (the
    plug-ins may add to them)."""
    found, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise PluginError(f"{FLAG} needs a module name: {FLAG} my_pkg.swarmrl_plugin")
            found.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(FLAG + "="):
            found.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return found, rest


class Registry(Generic[T]):
    """Entries of one kind by name (task sources, engine backends): the built-in ones and the ones
    plug-ins add, with no difference between them. The last registration of a name wins."""

    def __init__(self, kind: str, entry_type: type, builtin: Iterable[T] = ()):
        self.kind, self.entry_type = kind, entry_type
        self._entries: dict[str, T] = {}
        for entry in builtin:
            self.register(entry)

    def register(self, entry: T) -> T:
        if not isinstance(entry, self.entry_type):
            raise TypeError(f"register() takes a {self.entry_type.__qualname__}, got {type(entry).__name__}")
        self._entries[entry.name] = entry  # type: ignore[attr-defined]
        return entry

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[T]:
        return list(self._entries.values())

    def find(self, name: str) -> T | None:
        return self._entries.get(name)

    def get(self, name: str) -> T:
        """The entry called `name`; ValueError listing the registered ones otherwise."""
        if name not in self._entries:
            raise ValueError(
                f"no {self.kind} named {name!r}; registered: {', '.join(self.names())} (a plug-in adds its own: "
                "docs/plugins.md)"
            )
        return self._entries[name]
