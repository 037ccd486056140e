"""The package's shape, read from its source: imports point down the layers, no module imports
itself through others, no module uses another's private names, and no file or function grows past
what one reader can hold.

Private names: a name with a leading underscore (`_x`, not a dunder like `__version__`) belongs to
the module that binds it. Another swarmrl module may not name it, by `from m import _x` (absolute
or relative, inside functions too) nor by `m._x` after `import m` or `from pkg import m`. A package's
`__init__` is a module like any other: it may not import its submodules' private names either (a
name it needs, or re-exports, is part of that submodule's interface: make it public). A module
naming its own private names is fine; tests and benchmarks are not checked (they may test private
helpers). Reaching into a private attribute of an object (`obj._x`) cannot be told from the source
alone and is left to review.

The layers are docs/architecture.md's; a new package gets a line here and there.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "swarmrl"

# Lower layers never import higher ones; rooms in the same layer do not import each other.
LAYERS = {
    "errors": -2,  # swarmrl/errors.py: the base of errors meant for the user, under every layer
    "plugins": -1,  # swarmrl/plugins.py: imports the run's plug-ins (outside modules) before the config
    "config": 0,
    "protocol": 0,
    "data": 1,
    "model": 1,
    "algorithm": 1,
    "proofs": 1,
    "sandbox": 1,
    "transport": 1,
    "rewards": 2,
    "envs": 2,
    "assets": 2,
    "tasks": 3,
    "inference": 3,
    "eval": 4,
    "sft": 4,
    "validator": 4,
    "orchestrator": 4,
    "serve": 4,
    "trainer": 5,
    "adversary": 5,
    "launch": 5,
    "entrypoints": 6,
    "cli": 7,
}
MAX_FILE_LINES = 800
# A function's size is its statements (the lines a statement starts on), not its physical lines:
# ruff format puts one argument a line when a call does not fit, which says nothing about how much
# a reader must hold. 100 is what the longest functions held when the limit was 120 dense lines.
MAX_FUNCTION_STATEMENTS = 100


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """swarmrl modules imported anywhere in the file (inside functions too: lazy imports hide loops)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found - {module}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(module: str, source: str, known: set[str], is_package: bool = False) -> list[str]:
    """Where `module` (whose text is `source`; `is_package` for an `__init__`) names another
    swarmrl module's private names: `from m import _x`, or `m._x` with `m` bound by an import."""
    package = module if is_package else module.rsplit(".", 1)[0]
    tree = ast.parse(source)
    out, bound = [], {}  # bound: local name -> the swarmrl module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if _is_private(alias.name) and base in known and base != module:
                    out.append(f"{module}:{node.lineno} imports {alias.name} from {base}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:  # `import a.b` binds `a`; `import a.b as c` binds `c` to a.b
                    top = alias.name.split(".")[0]
                    bound[alias.asname or top] = alias.name if alias.asname else top
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                target = ".".join([bound[value.id], *reversed(chain)])
                if target in known and target != module:
                    out.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    return sorted(out)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "swarmrl"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, set(modules)) for m, p in modules.items()}


def test_every_package_has_a_layer():
    rooms = {_room(m) for m in _modules()} - {"swarmrl"}
    assert rooms <= set(LAYERS), (
        f"new package(s) {sorted(rooms - set(LAYERS))}: give them a layer here and in docs/architecture.md"
    )


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    out = []
    for module, targets in graph.items():
        for target in targets:
            a, b = _room(module), _room(target)
            if a != b and "swarmrl" not in (a, b) and layers[b] >= layers[a]:
                out.append(f"{module} (layer {layers[a]}) imports {target} (layer {layers[b]})")
    return sorted(out)


def import_loops(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk, as the loop it closes."""
    state, loops = {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue  # a package's __init__ importing its own submodules is not a loop
            if state.get(nxt) == "open":
                loops.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return loops


def test_imports_point_down_the_layers():
    upward = upward_imports(_graph(), LAYERS)
    assert not upward, "imports that do not point down:\n  " + "\n  ".join(upward)


def test_no_import_loops():
    loops = import_loops(_graph())
    assert not loops, "import loops:\n  " + "\n  ".join(loops)


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    found = [
        line
        for module, path in sorted(modules.items())
        for line in private_imports(module, path.read_text(), set(modules), path.name == "__init__.py")
    ]
    assert not found, (
        "private names used outside their module (make them public, or move the shared "
        "helper where it belongs):\n  " + "\n  ".join(found)
    )


def test_the_checkers_catch_what_they_look_for():
    # The loop that existed before the protocol package (config -> adversary -> worker -> adversary).
    graph = {
        "swarmrl.config": {"swarmrl.inference.adversary"},
        "swarmrl.inference.adversary": {"swarmrl.inference.worker"},
        "swarmrl.inference.worker": {"swarmrl.inference.adversary"},
    }
    assert import_loops(graph) == [
        "swarmrl.inference.adversary -> swarmrl.inference.worker -> swarmrl.inference.adversary"
    ]
    assert upward_imports(graph, LAYERS) == ["swarmrl.config (layer 0) imports swarmrl.inference.adversary (layer 3)"]
    assert import_loops({"swarmrl.a": {"swarmrl.a.b"}, "swarmrl.a.b": {"swarmrl.a"}}) == []
    # The real graph is read, lazy imports inside functions included.
    real = _graph()
    assert "swarmrl.protocol.rollouts" in real["swarmrl.trainer.batch"]
    assert "swarmrl.validator.runner" in real["swarmrl.entrypoints.orchestrator"]  # imported inside main()
    # Private names: relative and absolute imports, attribute access through an imported module,
    # lazily inside a function; not dunders, not the module's own names, not public ones.
    known = {"swarmrl.a", "swarmrl.a.b", "swarmrl.a.c", "swarmrl.a.d"}
    planted = (
        "from .b import _x, y, __version__\n"
        "from swarmrl.a import c\n"
        "import swarmrl.a.b, swarmrl.a.c as cc\n"
        "from swarmrl.a.d import _mine\n"
        "def f():\n"
        "    from swarmrl.a.b import _lazy\n"
        "    return c._z + swarmrl.a.b._w + cc._q + c.__name__ + c.public\n"
    )
    assert private_imports("swarmrl.a.d", planted, known) == [
        "swarmrl.a.d:1 imports _x from swarmrl.a.b",
        "swarmrl.a.d:6 imports _lazy from swarmrl.a.b",
        "swarmrl.a.d:7 uses swarmrl.a.b._w",
        "swarmrl.a.d:7 uses swarmrl.a.c._q",
        "swarmrl.a.d:7 uses swarmrl.a.c._z",
    ]
    # A package's __init__ is no exception: `from .b import _x` in swarmrl.a reaches into swarmrl.a.b.
    assert private_imports("swarmrl.a", "from .b import _x\n", known, is_package=True) == [
        "swarmrl.a:1 imports _x from swarmrl.a.b"
    ]


def test_files_and_functions_stay_readable():
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(
                f"{path.relative_to(ROOT.parent)}: {lines} lines (max {MAX_FILE_LINES}): split it by concern"
            )
        source = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len({inner.lineno for inner in ast.walk(node) if isinstance(inner, ast.stmt)})
                # A long function may stay long if the line above it says why ("long: ...").
                said = node.lineno >= 2 and "long:" in source[node.lineno - 2 - len(node.decorator_list)]
                if n > MAX_FUNCTION_STATEMENTS and not said:
                    too_long.append(
                        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {n} statements "
                        f"(max {MAX_FUNCTION_STATEMENTS}, or a '# long: why' comment above it)"
                    )
    assert not too_long, "\n  ".join(["too big:", *too_long])


def test_layers_match_the_architecture_doc():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [room for room in LAYERS if f"`{room}`" not in doc]
    assert not missing, f"docs/architecture.md does not describe {missing}"


# ---------------------------------------------------------------------------- test tiers

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_sits_in_a_tier():
    """tests/conftest.py refuses to run a test outside tests/{unit,integration,e2e,real}; this says so
    before collection, from the tree."""
    stray = [p.name for p in TESTS.glob("test_*.py")]
    assert not stray, f"move {stray} into tests/unit, tests/integration or tests/e2e (by cost)"
    for tier in ("unit", "integration", "e2e", "real"):
        assert list((TESTS / tier).glob("test_*.py")), tier


def test_test_module_names_are_unique_across_tiers():
    """The tiers are not packages: pytest imports each test module by its basename, so a second
    module of the same name in another tier is an import-mismatch error at collection (CI lost a
    run to tests/unit and tests/integration both holding test_grading_charge.py)."""
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    twice = {name: where for name, where in seen.items() if len(where) > 1}
    assert not twice, f"rename one of each: {twice}"


def test_the_unit_guard_refuses_a_process_and_a_socket():
    """tests/unit/conftest.py's guard is on in this module too (it is a unit test)."""
    import socket
    import subprocess

    import pytest

    with pytest.raises(AssertionError, match="started a process.*tests/integration"):
        subprocess.run(["true"])
    with pytest.raises(AssertionError, match="network socket"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    a, b = socket.socketpair()  # unix-domain: allowed
    a.close(), b.close()
