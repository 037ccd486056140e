"""Turn local benchmark files into task-schema rows the eval runner can score.

Public benchmarks come in their own column layouts (AIME-style math,
LiveCodeBench, HumanEval and MBPP code, GPQA multiple choice, IFEval-style instruction
following). ``load_benchmark`` maps each to the
task schema of :mod:`swarmrl.data.schema` (``problem_id``, ``task_type``,
``prompt``, ``verification_info`` as a JSON string) so evaluation reuses the
training graders unchanged. Only those four fields are kept: benchmark
metadata (difficulty, dates, explanations) must not leak into prompts or be
mistaken for schema extras.

Files are read with the readers of :mod:`swarmrl.data.loading` (JSONL, JSON,
parquet); nothing is downloaded. Every problem is reported with its 1-based
row (the line number in JSONL), the field and what to do, and the whole file
is refused rather than silently dropping rows, because a benchmark with
missing problems gives scores that do not compare with anyone else's.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

from swarmrl.data.loading import read_records
from swarmrl.data.schema import (
    CODE,
    MATH,
    RECORD_FIELD,
    RowError,
    describe_json_error,
    parse_row,
)
from swarmrl.rewards import registry
from swarmrl.rewards.choice import (
    MAX_CHOICES,
    MIN_CHOICES,
    MULTIPLE_CHOICE,
    check_choice,
)
from swarmrl.rewards.instructions import INSTRUCTION_FOLLOWING, parse_instructions

FORMATS = ("auto", "schema", "math", "code", "mcq", "ifeval")

MATH_SUFFIX = "\n\nPut your final answer within \\boxed{}."
STARTER_TEMPLATE = "\n\nStart from this code:\n```python\n{starter}\n```"
STDIN_INSTRUCTION = (
    "\n\nWrite a Python program that reads from standard input and writes the answer to "
    "standard output. Put the program in one ```python code block at the end of your answer."
)
FUNCTIONAL_INSTRUCTION = (
    "\n\nWrite the function `{fn_name}` in Python (a method of class Solution if the starter "
    "code has one). Put it in one ```python code block at the end of your answer."
)
HUMANEVAL_TEMPLATE = (
    "Complete this Python function:\n\n```python\n{prompt}```\n\n"
    "The code above runs before yours, so you may use what it defines. Write the whole function "
    "`{entry_point}`, with the imports it needs, in one ```python code block at the end of your answer."
)
MBPP_TEMPLATE = (
    "{text}\n\nYour code should pass these tests:\n\n```python\n{tests}\n```\n\n"
    "Write {names} in Python. Put the code in one ```python code block at the end of your answer."
)
MCQ_INSTRUCTION = "\n\nAnswer with the letter of the correct choice in \\boxed{}, e.g. \\boxed{A}."

#: Columns a problem id is taken from, first present wins.
ID_FIELDS = ("problem_id", "id", "question_id", "ID", "Record ID", "task_id", "key")
_GPQA_INCORRECT = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class _RowProblem(ValueError):
    """A problem with one field of the row being converted; the row number is added later."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


# ---------------------------------------------------------------------------
# Small field readers shared by the formats.


def _missing(value: Any) -> bool:
    """None, or NaN as pandas writes a null into a parquet column."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _text(record: Mapping[str, Any], keys: tuple[str, ...], what: str) -> str:
    """The first of ``keys`` holding a non-blank string, stripped."""
    for key in keys:
        value = record.get(key)
        if _missing(value):
            continue
        if not isinstance(value, str):
            raise _RowProblem(key, f"{what} must be a string, got {type(value).__name__}")
        if value.strip():
            return value.strip()
    names = " or ".join(repr(k) for k in keys)
    raise _RowProblem(keys[0], f"no {what}: the row needs a non-empty {names}")


def _problem_id(record: Mapping[str, Any], default: str) -> str:
    for key in ID_FIELDS:
        value = record.get(key)
        if _missing(value) or (isinstance(value, str) and not value.strip()):
            continue
        # A numeric id column with a null somewhere comes back from pandas as float.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value).strip()
    return default


def _json_or_value(value: Any, field: str, what: str) -> Any:
    """``value`` itself, or what a JSON string decodes to."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise _RowProblem(field, f"{what} is not valid JSON ({err.msg})") from None


# ---------------------------------------------------------------------------
# schema: rows already in the task schema.


def _from_schema(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    task_type = record.get("task_type")
    if not isinstance(task_type, str) or not task_type.strip():
        raise _RowProblem("task_type", "must be a non-empty string such as 'verifiable_math'")
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        raise _RowProblem("prompt", f"must be a string, got {type(prompt).__name__}")
    info = record.get("verification_info")
    if isinstance(info, dict):  # hand-written files often inline it; store it as the schema does
        info = json.dumps(info)
    if not isinstance(info, str):
        raise _RowProblem("verification_info", f"must be a JSON string, got {type(info).__name__}")
    return {"problem_id": problem_id, "task_type": task_type, "prompt": prompt, "verification_info": info}


# ---------------------------------------------------------------------------
# math: AIME-style question + answer.


def _from_math(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    question = _text(record, ("problem", "question", "prompt"), "question text")
    answer = record.get("answer")
    if _missing(answer):
        raise _RowProblem("answer", "is missing; a math row needs the final answer in 'answer'")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise _RowProblem("answer", f"must be a string or a number, got {type(answer).__name__}")
    if isinstance(answer, float):
        if not math.isfinite(answer):
            raise _RowProblem("answer", f"must be finite, got {answer}")
        # Parquet turns an int column with nulls into floats; 33.0 means 33.
        # Plain decimals: repr's 1e-07 would be read by math_verify as 1*e - 7.
        answer = str(int(answer)) if answer.is_integer() else format(Decimal(repr(answer)), "f")
    answer = str(answer).strip()
    if not answer:
        raise _RowProblem("answer", "is empty; put the final answer in 'answer'")
    return {
        "problem_id": problem_id,
        "task_type": MATH,
        "prompt": question + MATH_SUFFIX,
        "verification_info": json.dumps({"ground_truth": answer}),
    }


# ---------------------------------------------------------------------------
# code: LiveCodeBench-style tests.


def _test_list(record: Mapping[str, Any], field: str) -> list[Any]:
    raw = record.get(field)
    if _missing(raw) or (isinstance(raw, str) and not raw.strip()):
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            # LiveCodeBench ships private tests as base64(zlib(pickle)). Unpickling
            # runs arbitrary code, so an eval harness must never do it on a file.
            raise _RowProblem(
                field,
                "is a string that is not JSON (LiveCodeBench's private tests are a "
                "base64/zlib/pickle blob, which this loader refuses to unpickle); decode it "
                'offline with code you trust into the JSON list form [{"input": ..., '
                '"output": ..., "testtype": ...}], or drop the column',
            ) from None
    if not isinstance(raw, list):
        raise _RowProblem(field, f"must be a list of tests (or a JSON string of one), got {type(raw).__name__}")
    return raw


def _functional_args(text: str, field: str) -> list[Any]:
    """LiveCodeBench writes a call's arguments as JSON values, one per line."""
    args = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            args.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise _RowProblem(
                field,
                f"line {line_no} of the input is not a JSON value "
                f"({err.msg}); functional inputs hold one JSON "
                "argument per line",
            ) from None
    return args


def _from_code(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    question = _text(record, ("question_content", "question"), "question text")
    tests: list[tuple[str, int, Any]] = []
    for field in ("public_test_cases", "private_test_cases"):
        tests.extend((field, i, t) for i, t in enumerate(_test_list(record, field), start=1))
    if not tests:
        raise _RowProblem(
            "public_test_cases",
            "no tests in public_test_cases or private_test_cases; a code problem "
            "without tests would reward any program",
        )
    kinds = set()
    for field, number, test in tests:
        where = f"{field}[{number}]"
        if not isinstance(test, Mapping):
            raise _RowProblem(where, f"must be an object with input, output and testtype, got {type(test).__name__}")
        for key in ("input", "output"):
            if not isinstance(test.get(key), str):
                raise _RowProblem(where, f"'{key}' must be a string, got {type(test.get(key)).__name__}")
        if test.get("testtype") not in ("stdin", "functional"):
            raise _RowProblem(where, f"'testtype' must be 'stdin' or 'functional', got {test.get('testtype')!r}")
        kinds.add(test["testtype"])
    if len(kinds) > 1:
        raise _RowProblem(
            "public_test_cases",
            "mixes stdin and functional tests; one problem must be graded one way, split or fix its tests",
        )
    kind = kinds.pop()

    starter = record.get("starter_code")
    if _missing(starter):
        starter = ""
    if not isinstance(starter, str):
        raise _RowProblem("starter_code", f"must be a string, got {type(starter).__name__}")
    starter = starter.rstrip().lstrip("\n")
    prompt = question + (STARTER_TEMPLATE.format(starter=starter) if starter else "")

    if kind == "stdin":
        cases: dict[str, Any] = {
            "inputs": [t["input"] for _, _, t in tests],
            "outputs": [t["output"] for _, _, t in tests],
        }
        prompt += STDIN_INSTRUCTION
    else:
        metadata = record.get("metadata")
        if _missing(metadata) or metadata == "":
            metadata = {}
        metadata = _json_or_value(metadata, "metadata", "metadata")
        if not isinstance(metadata, Mapping):
            raise _RowProblem("metadata", f"must be an object, got {type(metadata).__name__}")
        fn_name = metadata.get("func_name")
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise _RowProblem(
                "metadata", f"functional tests need 'func_name' (a Python identifier) in metadata, got {fn_name!r}"
            )
        inputs, outputs = [], []
        for field, number, test in tests:
            where = f"{field}[{number}]"
            inputs.append(_functional_args(test["input"], where))
            outputs.append(_json_or_value(test["output"], where, "the expected output"))
        cases = {"fn_name": fn_name, "inputs": inputs, "outputs": outputs}
        prompt += FUNCTIONAL_INSTRUCTION.format(fn_name=fn_name)
    return {
        "problem_id": problem_id,
        "task_type": CODE,
        "prompt": prompt,
        "verification_info": json.dumps({"test_cases": json.dumps(cases)}),
    }


# ---------------------------------------------------------------------------
# code: HumanEval and MBPP, graded by their own asserts (``assert_tests``, rewards/code.py).


def _python(record: Mapping[str, Any], field: str, what: str) -> ast.Module:
    """A field of Python source, kept verbatim (indentation matters), parsed."""
    value = record.get(field)
    if _missing(value) or (isinstance(value, str) and not value.strip()):
        raise _RowProblem(field, f"is missing or empty; the row needs {what} in {field!r}")
    if not isinstance(value, str):
        raise _RowProblem(field, f"must be a string of Python code, got {type(value).__name__}")
    try:
        return ast.parse(value)
    except SyntaxError as err:
        raise _RowProblem(field, f"is not valid Python ({err.msg}, line {err.lineno}); fix the row") from None


def _top_level_names(tree: ast.Module) -> list[str]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [node.name for node in tree.body if isinstance(node, kinds)]


def _from_humaneval(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    """HumanEval: ``prompt`` (signature + docstring), ``test`` (defines ``check(candidate)``),
    ``entry_point``. The program runs after the prompt, as in HumanEval's own harness
    (prompt + completion), so a completion may be the whole function or only its body; the tests
    run ``check(entry_point)`` with the prompt's helpers, in their own process."""
    prompt_tree = _python(record, "prompt", "the function's signature and docstring")
    entry_point = _text(record, ("entry_point",), "entry point")
    if not entry_point.isidentifier():
        raise _RowProblem("entry_point", f"must be the function's name (a Python identifier), got {entry_point!r}")
    if entry_point not in _top_level_names(prompt_tree):
        raise _RowProblem(
            "entry_point", f"{entry_point!r} is not a function the prompt defines; name the prompt's function"
        )
    if "check" not in _top_level_names(_python(record, "test", "the test program defining check(candidate)")):
        raise _RowProblem("test", "defines no top-level check(candidate) function; HumanEval's tests call check(f)")
    prompt = record["prompt"] if record["prompt"].endswith("\n") else record["prompt"] + "\n"
    tests = {
        "functions": [entry_point],
        "tests": [f"check({entry_point})"],
        "setup": prompt + "\n" + record["test"],
        "program_prefix": prompt,
    }
    return {
        "problem_id": problem_id,
        "task_type": CODE,
        "prompt": HUMANEVAL_TEMPLATE.format(prompt=prompt.lstrip("\n"), entry_point=entry_point),
        "verification_info": json.dumps({"assert_tests": tests}),
    }


def _string_list(record: Mapping[str, Any], field: str, *, required: bool) -> list[str]:
    raw = record.get(field)
    if _missing(raw) or (isinstance(raw, str) and not raw.strip()):
        raw = []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise _RowProblem(field, "is a string that is not a JSON list; make it a list of strings") from None
    if not isinstance(raw, (list, tuple)) or not all(isinstance(item, str) for item in raw):
        raise _RowProblem(field, f"must be a list of strings, got {type(raw).__name__}")
    if required and not [item for item in raw if item.strip()]:
        raise _RowProblem(field, "is empty; a problem without tests would reward any program")
    return [item for item in raw if item.strip()]


def _from_mbpp(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    """MBPP (original or sanitized): ``text`` or ``prompt``, ``test_list`` (assert statements),
    ``code`` (the reference, whose function names tell which names the asserts call),
    ``test_setup_code`` and ``test_imports`` optional. ``challenge_test_list`` is not graded,
    as in MBPP's reported scores."""
    text = _text(record, ("text", "prompt"), "problem description")
    asserts = _string_list(record, "test_list", required=True)
    names = set()
    for index, statement in enumerate(asserts):
        try:
            names |= {node.id for node in ast.walk(ast.parse(statement)) if isinstance(node, ast.Name)}
        except SyntaxError as err:
            raise _RowProblem(f"test_list[{index}]", f"is not valid Python ({err.msg}); fix the row") from None
    defined = _top_level_names(_python(record, "code", "the reference solution"))
    functions = [name for name in dict.fromkeys(defined) if name in names]
    if not functions:
        raise _RowProblem(
            "test_list", f"calls none of the functions the reference 'code' defines ({', '.join(defined) or 'none'})"
        )
    setup_code = record.get("test_setup_code")
    if _missing(setup_code):
        setup_code = ""
    if not isinstance(setup_code, str):
        raise _RowProblem("test_setup_code", f"must be a string of Python code, got {type(setup_code).__name__}")
    setup = "\n".join(_string_list(record, "test_imports", required=False) + [setup_code])
    tests = {"functions": functions, "tests": asserts, "setup": setup}
    names_text = ", ".join(f"`{name}`" for name in functions)
    return {
        "problem_id": problem_id,
        "task_type": CODE,
        "prompt": MBPP_TEMPLATE.format(text=text, tests="\n".join(asserts), names=names_text),
        "verification_info": json.dumps({"assert_tests": tests}),
    }


def code_flavour(record: Mapping[str, Any]) -> str:
    """Which code benchmark a row comes from: "humaneval", "mbpp" or "livecodebench"."""
    keys = set(record)
    if "test_list" in keys:
        return "mbpp"
    if "entry_point" in keys or {"canonical_solution", "test"} <= keys:
        return "humaneval"
    return "livecodebench"


_CODE_FLAVOURS: dict[str, Callable[[Mapping[str, Any], str], dict[str, Any]]] = {
    "humaneval": _from_humaneval,
    "mbpp": _from_mbpp,
    "livecodebench": _from_code,
}
_FLAVOUR_NAMES = {"humaneval": "HumanEval", "mbpp": "MBPP", "livecodebench": "LiveCodeBench"}


# ---------------------------------------------------------------------------
# mcq: question + choices, or GPQA's raw columns.


def _answer_index(answer: Any, choices: list[str]) -> int:
    """Index of the correct choice from a letter, a 0-based index or the choice's text."""
    n = len(choices)
    if isinstance(answer, bool) or _missing(answer):
        raise _RowProblem("answer", f"must be a letter, a 0-based index or the correct choice's text, got {answer!r}")
    if isinstance(answer, int):
        if not 0 <= answer < n:
            raise _RowProblem("answer", f"index {answer} is out of range for {n} choices (0-based, 0 to {n - 1})")
        return answer
    if not isinstance(answer, str):
        raise _RowProblem(
            "answer", f"must be a letter, a 0-based index or the correct choice's text, got {type(answer).__name__}"
        )
    by_text = choices.index(answer.strip()) if answer.strip() in choices else None
    if len(answer) == 1 and answer in _LETTERS:
        by_letter = _LETTERS.index(answer)
        if by_letter >= n:
            raise _RowProblem("answer", f"letter {answer} is not among the {n} choices (A-{_LETTERS[n - 1]})")
        if by_text is not None and by_text != by_letter:
            raise _RowProblem(
                "answer",
                f"{answer!r} is both letter {answer} and the text of choice {_LETTERS[by_text]}; give a 0-based index",
            )
        return by_letter
    if by_text is None:
        raise _RowProblem("answer", f"{answer!r} is neither a capital letter nor the exact text of one of the choices")
    return by_text


def _listed_choices(record: Mapping[str, Any]) -> tuple[list[str], int]:
    choices = record.get("choices")
    if not isinstance(choices, (list, tuple)):
        raise _RowProblem("choices", f"must be a list of strings, got {type(choices).__name__}")
    if not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
        raise _RowProblem("choices", f"has {len(choices)} choices; need {MIN_CHOICES} to {MAX_CHOICES}")
    texts = []
    for index, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice.strip():
            raise _RowProblem("choices", f"choice {index} must be a non-empty string, got {choice!r}")
        texts.append(choice.strip())
    if len(set(texts)) != len(texts):
        raise _RowProblem("choices", "two choices have the same text; make them distinct")
    return texts, _answer_index(record.get("answer"), texts)


def _gpqa_choices(record: Mapping[str, Any], problem_id: str) -> tuple[list[str], int]:
    """GPQA's correct and three incorrect answers, in an order fixed by the problem id.

    GPQA always lists the correct answer first; presenting it as A would let
    a model score by always answering A. The order comes from a Random seeded
    with sha256(problem_id), so it is the same on every machine and every run
    (Python's hash() is salted per process) but differs between problems.
    """
    correct = _text(record, ("Correct Answer",), "correct answer")
    texts = [correct] + [_text(record, (key,), key.lower()) for key in _GPQA_INCORRECT]
    if len(set(texts)) != len(texts):
        raise _RowProblem(
            "Correct Answer", "two of the four answers have the same text, so the correct letter would be ambiguous"
        )
    rng = random.Random(hashlib.sha256(problem_id.encode("utf-8")).digest())
    rng.shuffle(texts)
    return texts, texts.index(correct)


def _from_mcq(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    if "choices" in record:
        question = _text(record, ("question", "Question"), "question text")
        choices, correct = _listed_choices(record)
    elif "Correct Answer" in record:
        question = _text(record, ("Question", "question"), "question text")
        choices, correct = _gpqa_choices(record, problem_id)
    else:
        raise _RowProblem(
            "choices",
            "an mcq row needs 'choices' (with 'question' and "
            "'answer') or GPQA's 'Question', 'Correct Answer' and "
            "'Incorrect Answer 1..3'",
        )
    info = {"answer": _LETTERS[correct], "num_choices": len(choices)}
    listing = "\n".join(f"{_LETTERS[i]}) {text}" for i, text in enumerate(choices))
    return {
        "problem_id": problem_id,
        "task_type": MULTIPLE_CHOICE,
        "prompt": question + "\n\n" + listing + MCQ_INSTRUCTION,
        "verification_info": json.dumps(info),
    }


# ---------------------------------------------------------------------------
# ifeval: IFEval's row format (key, prompt, instruction_id_list, kwargs), IFBench's too.


def _from_ifeval(record: Mapping[str, Any], problem_id: str) -> dict[str, Any]:
    """The prompt goes to the model as it is (the constraints are written in it); the instruction
    ids and their arguments become verification_info. An unknown id or a bad argument is refused
    here, with the field and the known ids, before anything is sampled."""
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _RowProblem("prompt", f"must be a non-empty string, got {type(prompt).__name__}")
    info = {"instruction_id_list": record.get("instruction_id_list"), "kwargs": record.get("kwargs")}
    try:
        parse_instructions(info)
    except ValueError as e:
        field = str(e).split("'")[1] if str(e).startswith("'") else "instruction_id_list"
        raise _RowProblem(field, str(e)) from None
    return {
        "problem_id": problem_id,
        "task_type": INSTRUCTION_FOLLOWING,
        "prompt": prompt,
        "verification_info": json.dumps(info),
    }


def _check_choice_row(info_text: str) -> None:
    """Refuse a multiple-choice row now rather than at grading time, after sampling.

    The schema module does not know this task type, so it would only check
    that verification_info is a JSON object.
    """
    try:
        info = json.loads(info_text)
    except json.JSONDecodeError as err:
        raise _RowProblem("verification_info", describe_json_error(err)) from None
    problem = check_choice(info)
    if problem is not None:
        raise _RowProblem("verification_info", problem)


_CONVERTERS: dict[str, Callable[[Mapping[str, Any], str], dict[str, Any]]] = {
    "schema": _from_schema,
    "math": _from_math,
    "code": _from_code,
    "mcq": _from_mcq,
    "ifeval": _from_ifeval,
}


def detect_format(record: Mapping[str, Any]) -> str | None:
    """The format a record's keys point to, or None if they fit none."""
    keys = set(record)
    if {"task_type", "verification_info"} <= keys:
        return "schema"
    if "instruction_id_list" in keys:
        return "ifeval"
    if keys & {"question_content", "public_test_cases", "entry_point", "test_list"}:
        return "code"
    if {"canonical_solution", "test"} <= keys:
        return "code"
    if keys & {"choices", "Correct Answer"}:
        return "mcq"
    if "answer" in keys and keys & {"problem", "question", "prompt"}:
        return "math"
    return None


# ---------------------------------------------------------------------------


def load_benchmark(path: str | Path, fmt: str = "auto") -> list[dict]:
    """Read a local benchmark file and return its problems as task-schema rows.

    ``fmt`` is one of ``FORMATS``; "auto" picks the format from the first
    row's keys. Each returned dict has exactly ``problem_id``, ``task_type``,
    ``prompt`` and ``verification_info`` (a JSON string). The id comes from
    the first of ``ID_FIELDS`` present, else ``"<file stem>-<i>"`` with ``i``
    the 0-based position of the row in the file. Raises FileNotFoundError for
    a missing file and ValueError, naming the row and field, for anything
    that cannot be converted; duplicate ids and empty files are refused too.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown benchmark format {fmt!r}; choose one of {FORMATS}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"benchmark file {path} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; load_benchmark reads one .jsonl or .parquet file")

    def fail(row: int, field: str, message: str) -> ValueError:
        return ValueError(f"{path}: {RowError(row, field, message)}")

    rows: list[dict] = []
    first_row_of: dict[str, int] = {}
    chosen = None if fmt == "auto" else fmt
    convert, label = None, ""
    records = read_records(path)
    try:
        for index, (row_no, record, parse_error) in enumerate(records):
            if parse_error is not None:
                raise fail(row_no, RECORD_FIELD, f"{parse_error}; fix or delete the line")
            if not isinstance(record, Mapping):
                raise fail(row_no, RECORD_FIELD, f"must be a JSON object, got {type(record).__name__}")
            if chosen is None:
                chosen = detect_format(record)
                if chosen is None:
                    raise ValueError(
                        f"{path}: cannot tell the benchmark format from the first row's keys "
                        f"{sorted(record)}; pass fmt= one of {FORMATS[1:]} (schema needs "
                        "task_type + verification_info, code question_content or "
                        "public_test_cases (LiveCodeBench), entry_point (HumanEval) or "
                        "test_list (MBPP), mcq choices or 'Correct Answer', math answer + "
                        "problem/question)"
                    )
            if convert is None:
                # A code file is HumanEval, MBPP or LiveCodeBench throughout: decided by its first
                # row, so a later row missing a field is told which field, not another format's.
                convert, label = _CONVERTERS[chosen], repr(chosen)
                if chosen == "code":
                    flavour = code_flavour(record)
                    convert, label = _CODE_FLAVOURS[flavour], f"{chosen!r}, {_FLAVOUR_NAMES[flavour]}"
            problem_id = _problem_id(record, f"{path.stem}-{index}")
            try:
                row = convert(record, problem_id)
                if row["task_type"] == MULTIPLE_CHOICE:
                    _check_choice_row(row["verification_info"])
            except _RowProblem as problem:
                raise fail(row_no, problem.field, f"{problem.message} (format {label})") from None
            _, errors = parse_row(row, row_no, checks=registry.checks())
            if errors:
                raise ValueError(f"{path}: " + "; ".join(str(e) for e in errors))
            if problem_id in first_row_of:
                raise fail(
                    row_no,
                    "problem_id",
                    f"id {problem_id!r} is also the id of row {first_row_of[problem_id]}; "
                    "ids must be unique so scores can be matched to problems",
                )
            first_row_of[problem_id] = row_no
            rows.append(row)
    finally:
        getattr(records, "close", lambda: None)()
    if not rows:
        raise ValueError(f"{path} holds no rows; expected one benchmark problem per row")
    return rows
