"""Code rewards (``task_type = "prime_rl_code"``): run the completion's program against tests.

The program is the last fenced ```` ```python ```` block (also ```` ```py ```` and
```` ```python3 ````) after the final ``</think>``; a completion that opens ``<think>`` and never
closes it has no program. ``verification_info["test_cases"]`` is a JSON string (or object)
``{"inputs": [...], "outputs": [...], "fn_name": optional}``:

- without ``fn_name`` each input is the program's whole stdin (a list of lines is joined with
  newlines) and the output its expected stdout;
- with ``fn_name`` each input is the list of positional arguments of the function (or of the
  method of that name on ``Solution()``), and the output its expected return value.

How outputs are compared (``stdout_matches``, ``value_matches``):

- stdout: line endings are normalised, trailing whitespace on each line and trailing blank
  lines are ignored. Otherwise the whitespace-separated tokens must be equal, except that
  where the expected token is a float (has a ``.`` or an exponent) the printed number may
  differ by 1e-6 absolute or relative ("0.5" matches "0.50000001" and ".5", not "0.51");
- return values: compared as JSON values. Where the expected number is a float, the returned
  one may differ by 1e-6 absolute or relative; an expected integer must be met exactly (a
  float approximation of a count is wrong); a bool never equals a number; tuples are lists. As in the APPS-style
  data that the public dataset draws on, an expected value written as a one-element list
  ``[x]`` also accepts ``x``.

Reward 1.0 when every test passes (``partial_credit``: the fraction passed); tests run in
order and stop at the first failure unless partial credit is on. Every test has a time limit,
and the completion as a whole has one (tests that no longer fit fail as timed out).

Each test is its own sandboxed process that sees only its own input, never an expected
output, and the comparison runs here on the host: a program cannot fake success by patching
the comparison or builtins, by exiting early, or by printing another test's answer.

**Assert-style tests** (HumanEval, MBPP) are ``verification_info["assert_tests"]`` instead, a
JSON object (or a JSON string of one)::

    {"functions": ["f"],                 # the names the tests call in the program
     "tests": ["check(f)"],              # Python code; each item is one test
     "setup": "def check(candidate): ...",   # optional: run before each test, tests' side only
     "program_prefix": "def f(x):\n ..."}  # optional: put before the program (HumanEval's prompt)

Such tests carry their expected values and judge inside the sandbox, so there they run in a
process of their own (harness MODE assert): the program runs in a second process and the test
reaches its ``functions`` only through proxies that pass plain values (numbers, strings, lists,
tuples, dicts, sets); an object of the program stays in its process as an opaque handle. A test
passes when it returns without an exception and its process writes back a nonce the program
never sees. Rewards and partial credit are as above, counting each item of ``tests`` as one
test (HumanEval's single ``check(f)`` is all-or-nothing). A row whose setup fails, or whose test
never calls the program, is a data bug: grading raises ValueError, as for malformed tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from swarmrl.config import SandboxConfig
from swarmrl.data.schema import describe_json_error
from swarmrl.rewards.answer import answer_region, missing_answer_reason
from swarmrl.sandbox.harness import EXIT_BAD_TESTS, EXIT_PROGRAM_FAILED, EXIT_TEST_FAILED, EXIT_UNSAFE
from swarmrl.sandbox.runner import ExecResult, Sandbox, SandboxFailure, SandboxSettings

# ```python / ```py / ```python3 (any case) up to the closing fence.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_FLOAT_TOKEN = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][+-]?\d+)$")
FLOAT_TOLERANCE = 1e-6
_MAX_QUOTED = 60


@dataclass(frozen=True)
class CodeLimits:
    """Per-completion grading settings (see ``SandboxConfig``)."""

    test_timeout_s: float = SandboxConfig().test_timeout_s
    total_timeout_s: float = SandboxConfig().total_timeout_s
    partial_credit: bool = SandboxConfig().partial_credit


def decode_test_cases(info: Mapping[str, Any]) -> dict[str, Any]:
    """Return the code test cases as a dict, whether stored as a JSON string or inline.

    The public dataset double-encodes them (a JSON string inside the JSON
    string); hand-written files often do not. Both are accepted.
    """
    if "test_cases" not in info:
        raise ValueError(
            "prime_rl_code needs a 'test_cases' key (stdin/stdout or function tests) or an "
            f"'assert_tests' key (assert-style tests, e.g. HumanEval's); found keys {sorted(info)}"
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
        raise ValueError(f"'test_cases' has {n_in} inputs but {n_out} outputs; they must pair up")
    if n_in == 0:
        # Zero tests would make every program "pass": a free reward, not a task.
        raise ValueError("'test_cases' has no test cases")
    fn_name = cases.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.strip()):
        raise ValueError("'test_cases.fn_name', when present, must be a non-empty string")


@dataclass(frozen=True)
class TestCases:
    inputs: list
    outputs: list
    fn_name: str | None


@dataclass(frozen=True)
class AssertTests:
    """Assert-style tests (``verification_info["assert_tests"]``; see the module docstring)."""

    functions: list[str]
    tests: list[str]
    setup: str = ""
    program_prefix: str = ""

    def program(self, completion_program: str) -> str:
        """What runs in the program's process: the prefix (HumanEval's prompt), then the program."""
        if not self.program_prefix:
            return completion_program
        prefix = self.program_prefix if self.program_prefix.endswith("\n") else self.program_prefix + "\n"
        return prefix + completion_program


def _source(value: Any, where: str, *, required: bool) -> str:
    """A field of Python source: a string that compiles (checked here, so a broken row is refused
    when it is loaded rather than scoring every program 0)."""
    if isinstance(value, str) and required and not value.strip():
        raise ValueError(f"'{where}' is empty; it must be a non-empty string of Python code")
    if not isinstance(value, str):
        raise ValueError(f"'{where}' must be a string of Python code, got {type(value).__name__}")
    try:
        compile(value, where, "exec", dont_inherit=True)
    except SyntaxError as err:
        line = f" (line {err.lineno})" if err.lineno else ""
        raise ValueError(f"'{where}' is not valid Python: {err.msg}{line}") from None
    except ValueError as err:  # a NUL byte in the source
        raise ValueError(f"'{where}' is not valid Python: {err}") from None
    return value


def parse_assert_tests(verification_info: Mapping[str, Any]) -> AssertTests:
    """The ``assert_tests`` of a code row (a JSON string or object); ValueError naming the problem."""
    raw = verification_info["assert_tests"]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"'assert_tests' is {describe_json_error(err)}") from None
    if not isinstance(raw, dict):
        raise ValueError(
            "'assert_tests' must be a JSON object (or a JSON string of one) with 'functions' and "
            f"'tests' lists, got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - {"functions", "tests", "setup", "program_prefix"})
    if unknown:
        raise ValueError(
            f"'assert_tests' has unknown keys {unknown}; it takes functions, tests, setup and program_prefix"
        )
    functions = raw.get("functions")
    if not isinstance(functions, list) or not functions:
        raise ValueError(
            "'assert_tests.functions' must be a non-empty list of the names the tests call in the program "
            f"(HumanEval: [entry_point]), got {functions!r}"[:300]
        )
    for name in functions:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"'assert_tests.functions' must hold Python identifiers, got {name!r}")
    if len(set(functions)) != len(functions):
        raise ValueError("'assert_tests.functions' names a function twice")
    tests = raw.get("tests")
    if not isinstance(tests, list) or not tests:
        # Zero tests would make every program "pass": a free reward, not a task.
        raise ValueError("'assert_tests.tests' must be a non-empty list of test code (e.g. [\"check(f)\"])")
    for index, test in enumerate(tests):
        _source(test, f"assert_tests.tests[{index}]", required=True)
    setup = _source(raw.get("setup", ""), "assert_tests.setup", required=False)
    prefix = raw.get("program_prefix", "")
    if not isinstance(prefix, str):
        raise ValueError(f"'assert_tests.program_prefix' must be a string, got {type(prefix).__name__}")
    return AssertTests(list(functions), list(tests), setup, prefix)


def parse_test_cases(verification_info: dict) -> TestCases | AssertTests:
    """The tests of a code row; ValueError naming the problem for a malformed row.

    ``assert_tests`` rows are read by ``parse_assert_tests``. For ``test_cases`` the shape checks
    (``check_code``) come first; running them also needs ``fn_name`` to be a Python identifier
    and stdin tests to be text.
    """
    if "assert_tests" in verification_info:
        if "test_cases" in verification_info:
            raise ValueError(
                "a code row has either 'test_cases' or 'assert_tests', not both; "
                "one program is graded one way: keep one and drop the other"
            )
        return parse_assert_tests(verification_info)
    check_code(verification_info)
    raw = decode_test_cases(verification_info)
    inputs, outputs, fn_name = raw["inputs"], raw["outputs"], raw.get("fn_name")
    if fn_name is not None and not fn_name.isidentifier():
        raise ValueError(f"'test_cases.fn_name' must be a Python identifier, got {fn_name!r}")
    if fn_name is None:
        for index, (given, wanted) in enumerate(zip(inputs, outputs)):
            for what, value in (("input", given), ("output", wanted)):
                if not isinstance(value, str) and not (
                    isinstance(value, list) and all(isinstance(v, str) for v in value)
                ):
                    raise ValueError(
                        f"test {index + 1}'s {what} must be a string or a list of lines "
                        f"for a stdin/stdout test, got {type(value).__name__}"
                    )
    return TestCases(inputs, outputs, fn_name or None)


def extract_program(completion: str) -> str | None:
    """The last fenced python block after the final ``</think>``, or None."""
    region = answer_region(completion)
    if region is None:
        return None
    blocks = _FENCE.findall(region)
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


def _as_text(value: str | list[str]) -> str:
    return value if isinstance(value, str) else "\n".join(value) + "\n"


def _normalise_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(got: float, wanted: float) -> bool:
    return math.isclose(got, wanted, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def stdout_matches(got: str, expected: str) -> bool:
    """Whether a program's stdout matches the expected output (see the module docstring)."""
    if _normalise_lines(got) == _normalise_lines(expected):
        return True
    got_tokens, wanted_tokens = got.split(), expected.split()
    if len(got_tokens) != len(wanted_tokens):
        return False
    for g, w in zip(got_tokens, wanted_tokens):
        if g == w:
            continue
        if not _FLOAT_TOKEN.match(w):
            return False
        try:
            if not _close(float(g), float(w)):
                return False
        except ValueError:
            return False
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _values_equal(got: Any, wanted: Any) -> bool:
    if _is_number(got) and _is_number(wanted):
        if isinstance(wanted, float):
            try:
                return math.isfinite(wanted) and _close(float(got), wanted)
            except OverflowError:  # an int too large for a float is not close to any float
                return False
        return got == wanted  # an expected integer is exact (2.0 still equals 2)
    if isinstance(got, list) and isinstance(wanted, list):
        return len(got) == len(wanted) and all(_values_equal(g, w) for g, w in zip(got, wanted))
    if isinstance(got, dict) and isinstance(wanted, dict):
        return got.keys() == wanted.keys() and all(_values_equal(got[k], wanted[k]) for k in got)
    return type(got) is type(wanted) and got == wanted


def value_matches(got: Any, expected: Any) -> bool:
    """Whether a returned JSON value matches the expected one (see the module docstring)."""
    if _values_equal(got, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(got, expected[0])


def _quote(data: bytes | str) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = text.strip()
    return repr(text if len(text) <= _MAX_QUOTED else text[:_MAX_QUOTED] + "...")


def _failure(result: ExecResult, timeout_s: float) -> str | None:
    """Why an execution failed before its output could be compared; None if it ran to the end."""
    if result.status == "timeout":
        return f"time limit exceeded ({timeout_s:g} s)"
    if result.status == "output_limit":
        return "output limit exceeded"
    if result.status == "sandbox_error":  # not the program's fault: the row errors, it does not score 0
        raise SandboxFailure(f"the sandbox failed to start: {result.last_error_line()}")
    if result.status == "memory_limit":
        return "memory limit exceeded (a process was killed by the sandbox's cgroup)"
    if result.status == "signal":
        return f"killed by signal {-result.exit_code} (a resource limit)"
    if result.status == "exit":
        detail = result.last_error_line()
        return f"runtime error (exit code {result.exit_code})" + (f": {detail}" if detail else "")
    return None


def run_test(sandbox: Sandbox, program: str, tests: TestCases, index: int, timeout_s: float) -> str | None:
    """Run test ``index``; None if it passed, else the reason it failed."""
    given, wanted = tests.inputs[index], tests.outputs[index]
    if tests.fn_name is None:
        result = sandbox.run(program, mode="stdio", stdin=_as_text(given).encode("utf-8"), timeout_s=timeout_s)
    else:
        args = given if isinstance(given, list) else [given]
        request = json.dumps({"fn_name": tests.fn_name, "args": args}).encode("utf-8")
        result = sandbox.run(program, mode="call", stdin=request, timeout_s=timeout_s)
    failure = _failure(result, timeout_s)
    if failure is not None:
        return failure
    if tests.fn_name is None:
        got = result.stdout.decode("utf-8", "replace")
        if stdout_matches(got, _as_text(wanted)):
            return None
        return f"wrong answer: expected {_quote(_as_text(wanted))}, got {_quote(got)}"
    try:  # the program can write anything here: nesting too deep, a 5000-digit number...
        value = json.loads(result.stdout)
    except (ValueError, RecursionError):
        return f"no return value came back (stdout {_quote(result.stdout[:200])})"
    if value_matches(value, wanted):
        return None
    return f"wrong answer: expected {_quote(json.dumps(wanted))}, got {_quote(json.dumps(value))}"


def run_assert_test(sandbox: Sandbox, program: str, tests: AssertTests, index: int, timeout_s: float) -> str | None:
    """Run assert test ``index`` (harness MODE assert); None if it passed, else the reason.

    It passed only if the harness's test process wrote back this run's nonce: fresh random bytes
    that never reach the program's process, so no exit code or output the program can produce
    stands in for it.
    """
    nonce = secrets.token_hex(16)
    request = {"nonce": nonce, "setup": tests.setup, "test": tests.tests[index], "functions": tests.functions}
    result = sandbox.run(
        tests.program(program), mode="assert", stdin=json.dumps(request).encode("utf-8"), timeout_s=timeout_s
    )
    detail = result.last_error_line()
    if result.status == "exit" and result.exit_code == EXIT_BAD_TESTS:
        raise ValueError(f"the row's assert_tests are broken, whatever the program: {detail}")
    if result.status == "exit" and result.exit_code == EXIT_UNSAFE:
        raise SandboxFailure(f"the assert-test harness refused to run: {detail}")
    if result.status == "exit" and result.exit_code == EXIT_TEST_FAILED:
        return f"wrong answer: {detail}"
    if result.status == "exit" and result.exit_code == EXIT_PROGRAM_FAILED:
        return f"runtime error: {detail}"
    failure = _failure(result, timeout_s)
    if failure is not None:
        return failure
    if result.stdout.strip() != nonce.encode("ascii"):
        return "the tests did not report a pass"
    return None


def grade_code(
    sandbox: Sandbox, verification_info: dict, completion: str, limits: CodeLimits = CodeLimits()
) -> tuple[float, str | None]:
    """Reward for a ``prime_rl_code`` row and, below 1, the reason.

    Malformed test cases raise ValueError (a data bug, not a wrong answer).
    """
    tests = parse_test_cases(verification_info)
    program = extract_program(completion)
    if program is None:
        return 0.0, missing_answer_reason(completion, "```python code block")
    count = len(tests.tests) if isinstance(tests, AssertTests) else len(tests.inputs)
    deadline = time.monotonic() + limits.total_timeout_s
    passed, first_failure = 0, None
    for index in range(count):
        left = deadline - time.monotonic()
        failure: str | None
        if left <= 0:
            failure = f"total time limit exceeded ({limits.total_timeout_s:g} s)"
        elif isinstance(tests, AssertTests):
            failure = run_assert_test(sandbox, program, tests, index, min(limits.test_timeout_s, left))
        else:
            failure = run_test(sandbox, program, tests, index, min(limits.test_timeout_s, left))
        if failure is None:
            passed += 1
            continue
        first_failure = first_failure or f"test {index + 1} of {count}: {failure}"
        if not limits.partial_credit:
            return 0.0, first_failure
    if limits.partial_credit:
        return passed / count, first_failure
    return 1.0, None


class CodeGrader:
    """Grades code rows on a :class:`Sandbox`, one completion per slot at a time.

    ``grade_many`` runs up to ``sandbox.settings.workers`` completions at once (each one's
    tests in order), which is also the number of sandboxes alive at any moment.
    """

    def __init__(self, sandbox: Sandbox, limits: CodeLimits = CodeLimits()):
        self.sandbox = sandbox
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=sandbox.settings.workers, thread_name_prefix="swarmrl-code")

    def describe(self) -> str:
        return self.sandbox.describe()

    def grade_many(self, jobs: list[tuple[dict, str]]) -> list[tuple[float, str | None] | Exception]:
        """``(verification_info, completion)`` -> ``(reward, reason)``, in order; or, for a row
        that could not be graded (malformed tests, a sandbox that failed to start, a bug of
        ours), the exception, which the caller turns into the row's error."""

        def one(job):
            try:
                return grade_code(self.sandbox, job[0], job[1], self.limits)
            except (ValueError, SandboxFailure) as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 - never let one row take the scorer down
                return RuntimeError(f"grading failed: {type(exc).__name__}: {exc}")

        return list(self._executor.map(one, jobs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.sandbox.close()


def sandbox_settings(cfg: SandboxConfig) -> SandboxSettings:
    """The sandbox's settings from the `[sandbox]` config section."""
    return SandboxSettings(
        workers=cfg.workers or os.cpu_count() or 1,
        memory_bytes=cfg.memory_mb << 20,
        max_procs=cfg.max_procs,
        max_file_bytes=cfg.max_file_mb << 20,
        max_open_files=cfg.max_open_files,
        max_output_bytes=cfg.max_output_kb << 10,
        tmp_bytes=cfg.tmp_mb << 20,
        startup_grace_s=cfg.startup_grace_s,
        uid_base=cfg.uid_base,
        cgroups=cfg.cgroups,
        bwrap=cfg.bwrap,
        python=cfg.python,
        unsafe_no_sandbox=cfg.unsafe_no_sandbox,
    )


def open_code_grader(cfg: SandboxConfig, log=None) -> CodeGrader:
    """Start the sandbox pool for code rows; raises SandboxUnavailable with the fix."""
    sandbox = Sandbox(sandbox_settings(cfg), log=log)
    limits = CodeLimits(cfg.test_timeout_s, cfg.total_timeout_s, cfg.partial_credit)
    return CodeGrader(sandbox, limits)
