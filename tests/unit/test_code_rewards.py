"""The pure parts of code rewards, checked by hand: finding the program, reading the tests,
comparing outputs; and the cgroup discovery on v1 and (a fake) v2 tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmrl.data.schema import parse_row
from swarmrl.rewards import registry
from swarmrl.rewards.code import AssertTests, extract_program, parse_test_cases, stdout_matches, value_matches
from swarmrl.sandbox.cgroups import open_slot_cgroup, read_mounts, read_own_cgroups

# -- finding the program -------------------------------------------------------------------


def test_the_program_is_the_last_python_block_after_the_final_think():
    text = (
        "<think>```python\nprint('draft')\n```</think>\n"
        "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\nand\n```\nnot python\n```\n"
    )
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```Python3\nx = 1\n```") == "x = 1\n"  # no think block at all


@pytest.mark.parametrize(
    "text",
    [
        "<think>```python\nprint(1)\n```",  # opened, never closed
        "<think>```python\nprint(1)\n```</think> so the answer is above",  # only inside the thought
        "</think>```python\n   \n```",  # empty block
        "</think>```javascript\nconsole.log(1)\n```",
        "</think>```python\nprint(1)\n",  # unclosed fence
    ],
)
def test_no_program(text):
    assert extract_program(text) is None


# -- reading the tests ---------------------------------------------------------------------


def test_test_cases_as_string_or_object_with_and_without_fn_name():
    tests = parse_test_cases({"test_cases": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})})
    assert (tests.inputs, tests.outputs, tests.fn_name) == (["1\n"], ["2\n"], None)
    tests = parse_test_cases({"test_cases": {"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}})
    assert tests.fn_name == "f" and tests.inputs == [[1, 2]]
    lines = parse_test_cases({"test_cases": {"inputs": [["1", "2"]], "outputs": [["3"]]}})
    assert lines.inputs == [["1", "2"]]


@pytest.mark.parametrize(
    "info, says",
    [
        ({}, "needs a 'test_cases' key"),
        ({"test_cases": "{nope"}, "'test_cases' is not valid JSON"),
        ({"test_cases": "[1]"}, "must be a JSON object"),
        ({"test_cases": {"inputs": ["1"]}}, "'test_cases.outputs' must be a list"),
        ({"test_cases": {"inputs": ["1"], "outputs": []}}, "1 inputs but 0 outputs"),
        ({"test_cases": {"inputs": [], "outputs": []}}, "no test cases"),
        ({"test_cases": {"fn_name": "no such", "inputs": [[1]], "outputs": [1]}}, "identifier"),
        ({"test_cases": {"inputs": [5], "outputs": ["5"]}}, "test 1's input must be a string"),
    ],
)
def test_malformed_test_cases_name_the_problem(info, says):
    with pytest.raises(ValueError, match=says):
        parse_test_cases(info)


# -- assert-style tests (HumanEval, MBPP) -------------------------------------------------

ASSERTS = {"functions": ["f"], "tests": ["check(f)"], "setup": "def check(candidate):\n    assert candidate(1) == 2\n"}


def test_assert_tests_as_object_or_json_string():
    tests = parse_test_cases({"assert_tests": ASSERTS})
    assert tests == AssertTests(["f"], ["check(f)"], ASSERTS["setup"], "")
    assert parse_test_cases({"assert_tests": json.dumps(ASSERTS)}) == tests
    # The prefix (HumanEval's prompt) goes before the program, on a line of its own.
    prefixed = AssertTests(["f"], ["check(f)"], program_prefix='def f(x):\n    """doc"""')
    assert prefixed.program("    return x + 1\n") == 'def f(x):\n    """doc"""\n    return x + 1\n'
    assert tests.program("x = 1\n") == "x = 1\n"


def with_asserts(**changes) -> dict:
    tests = dict(ASSERTS, **changes)
    return {"assert_tests": {k: v for k, v in tests.items() if v is not None}}


@pytest.mark.parametrize(
    "info, says",
    [
        ({"assert_tests": ASSERTS, "test_cases": {"inputs": ["1"], "outputs": ["2"]}}, "not both"),
        ({"assert_tests": "{nope"}, "'assert_tests' is not valid JSON"),
        ({"assert_tests": ["check(f)"]}, "'assert_tests' must be a JSON object"),
        (with_asserts(check="x"), r"unknown keys \['check'\]"),
        (with_asserts(functions=None), "'assert_tests.functions' must be a non-empty list"),
        (with_asserts(functions=[]), "'assert_tests.functions' must be a non-empty list"),
        (with_asserts(functions=["f", "not a name"]), "must hold Python identifiers, got 'not a name'"),
        (with_asserts(functions=["f", "f"]), "names a function twice"),
        (with_asserts(tests=[]), "'assert_tests.tests' must be a non-empty list"),
        (with_asserts(tests="check(f)"), "'assert_tests.tests' must be a non-empty list"),
        (with_asserts(tests=["check(f)", "  "]), r"'assert_tests.tests\[1\]' is empty"),
        (with_asserts(tests=["check(f)", "assert f(1) =="]), r"'assert_tests.tests\[1\]' is not valid Python"),
        (with_asserts(setup="def check(candidate)\n    pass\n"), r"'assert_tests.setup' is not valid Python.*line 1"),
        (with_asserts(setup=7), "'assert_tests.setup' must be a string of Python code, got int"),
        (with_asserts(program_prefix=["def f(): pass"]), "'assert_tests.program_prefix' must be a string"),
    ],
)
def test_malformed_assert_tests_name_the_problem(info, says):
    with pytest.raises(ValueError, match=says):
        parse_test_cases(info)


def test_a_malformed_assert_row_is_refused_when_loaded():
    row = {"problem_id": "p", "task_type": "prime_rl_code", "prompt": "write f"}
    info = json.dumps({"assert_tests": ASSERTS})
    good, errors = parse_row(dict(row, verification_info=info), 3, checks=registry.checks())
    assert good is not None and errors == []
    info = json.dumps(with_asserts(tests=["check(f"]))
    refused, errors = parse_row(dict(row, verification_info=info), 3, checks=registry.checks())
    assert refused is None
    assert [(e.row, e.field) for e in errors] == [(3, "verification_info")]
    assert "'assert_tests.tests[0]' is not valid Python" in errors[0].message


# -- comparing stdout ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "got, expected",
    [
        ("3\n", "3\n"),
        ("3", "3\n"),  # missing final newline
        ("1 2  \r\n3\r\n\r\n", "1 2\n3\n"),  # CRLF, trailing spaces, trailing blank lines
        ("0.5\n", "0.50\n"),  # the expected token is a float: compared as numbers
        ("0.3333333\n", "0.333333333\n"),  # within 1e-6
        ("1e3\n", "1000.0\n"),
        ("1 2\n3\n", "1 2 3\n"),  # same tokens, other line breaks
    ],
)
def test_stdout_matches(got, expected):
    assert stdout_matches(got, expected)


@pytest.mark.parametrize(
    "got, expected",
    [
        ("4\n", "3\n"),
        ("3.0\n", "3\n"),  # the expected token is an integer: no float tolerance
        ("0.51\n", "0.50\n"),
        ("0.333\n", "0.333333333\n"),  # off by 3.3e-4
        ("", "3\n"),
        ("3 3\n", "3\n"),
        ("nan\n", "0.5\n"),
        ("YES\n", "yes\n"),
    ],
)
def test_stdout_does_not_match(got, expected):
    assert not stdout_matches(got, expected)


# -- comparing return values ---------------------------------------------------------------


@pytest.mark.parametrize(
    "got, expected",
    [
        (3, 3),
        (0.1 + 0.2, 0.3),
        (2, 2.0),
        ([1, [2, "a"]], [1, [2, "a"]]),
        ({"k": 1.0000001}, {"k": 1.0}),
        (5, [5]),  # APPS-style data wraps a return value in a one-element list
        ([5], [5]),
        (None, None),
    ],
)
def test_value_matches(got, expected):
    assert value_matches(got, expected)


@pytest.mark.parametrize(
    "got, expected",
    [
        (True, 1),  # a bool is not a number
        (1, True),
        ("3", 3),
        ([1, 2], [2, 1]),
        ([1, 2], [[1, 2, 3]]),
        ({"a": 1}, {"a": 1, "b": 2}),
        (0.31, 0.3),
        (None, [None, None]),
        (1e9, 999999999),  # an expected integer is exact: a float approximation of a count is wrong
        (1e18, 10**18 + 12345),
        (10**400, 1.5),  # too large for a float: not close to anything (and no OverflowError)
        (float("inf"), 1.5),
    ],
)
def test_value_does_not_match(got, expected):
    assert not value_matches(got, expected)


# -- cgroups: discovery ----------------------------------------------------------------------

MOUNTS_V1 = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
CGROUP_V1 = "8:pids:/\n4:memory:/process_api/abc\n0::/\n"


def test_reading_mounts_and_own_cgroups():
    mounts = read_mounts(MOUNTS_V1)
    assert [(str(m.path), m.kind) for m in mounts] == [
        ("/sys/fs/cgroup/pids", "cgroup"),
        ("/sys/fs/cgroup/memory", "cgroup"),
        ("/sys/fs/cgroup/unified", "cgroup2"),
    ]
    assert "pids" in mounts[0].controllers and "memory" in mounts[1].controllers
    assert read_own_cgroups(CGROUP_V1) == {"pids": "/", "memory": "/process_api/abc", "": "/"}


def _fake_v2(root: Path, own: str, controllers: str, enabled: str) -> Path:
    parent = root / own.lstrip("/")
    parent.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers)
    (parent / "cgroup.controllers").write_text(controllers)
    (parent / "cgroup.subtree_control").write_text(enabled)
    return parent


def test_v2_slot_in_a_delegated_cgroup(tmp_path):
    parent = _fake_v2(tmp_path, "/user.slice/me", "cpu memory pids", "")
    slot, why = open_slot_cgroup(
        "run1",
        max_procs=10,
        memory_bytes=1 << 20,
        mounts_text=f"cgroup2 {tmp_path} cgroup2 rw 0 0\n",
        cgroup_text="0::/user.slice/me\n",
    )
    assert why == "" and slot.version == 2 and slot.dirs == [parent / "run1"]
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (parent / "run1" / "cpu.max").read_text() == "100000 100000"  # one core
    assert (parent / "run1" / "pids.max").read_text() == "14"  # 10 + bwrap's own processes
    assert (parent / "run1" / "memory.max").read_text() == str((1 << 20) + (64 << 20))


def test_v2_without_delegated_controllers_says_why(tmp_path):
    _fake_v2(tmp_path, "/me", "cpu memory pids", "")
    (tmp_path / "me" / "cgroup.controllers").write_text("cpu")
    slot, why = open_slot_cgroup(
        "run1", max_procs=10, memory_bytes=1, mounts_text=f"cgroup2 {tmp_path} cgroup2 rw 0 0\n", cgroup_text="0::/me\n"
    )
    assert slot is None and "not delegated" in why and "memory" in why


def test_no_cgroup_filesystem():
    slot, why = open_slot_cgroup("x", max_procs=1, memory_bytes=1, mounts_text="", cgroup_text="")
    assert slot is None and "no cgroup filesystem" in why
