"""Tests for swarmrl.eval.formats: benchmark files in, task-schema rows out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmrl.data.schema import parse_row
from swarmrl.eval.formats import FORMATS, MATH_SUFFIX, detect_format, load_benchmark
from swarmrl.rewards.choice import choice_task_reward
from swarmrl.rewards.code import AssertTests, parse_test_cases

SCHEMA_KEYS = {"problem_id", "task_type", "prompt", "verification_info"}
MCQ_TAIL = "\n\nAnswer with the letter of the correct choice in \\boxed{}, e.g. \\boxed{A}."
STDIN_TAIL = (
    "\n\nWrite a Python program that reads from standard input and writes the answer to "
    "standard output. Put the program in one ```python code block at the end of your answer."
)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def assert_schema_rows(rows: list[dict]) -> None:
    for number, row in enumerate(rows, start=1):
        assert set(row) == SCHEMA_KEYS
        task, errors = parse_row(row, number)
        assert task is not None, errors


# -- math ------------------------------------------------------------------------


def test_math_rows(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "aime.jsonl",
        [
            {"id": "2024-I-1", "problem": "  Find $x$.\n", "answer": 33, "solution": "long", "year": 2024},
            {"question": "What is 1/2 + 1/4?", "answer": "3/4"},
            {"prompt": "Compute 0.1 * 2.", "answer": 0.2},
            {"problem": "Count.", "answer": 7.0},
        ],
    )
    rows = load_benchmark(path)
    assert_schema_rows(rows)
    assert rows[0] == {
        "problem_id": "2024-I-1",
        "task_type": "verifiable_math",
        "prompt": "Find $x$.\n\nPut your final answer within \\boxed{}.",
        "verification_info": '{"ground_truth": "33"}',
    }
    assert MATH_SUFFIX == "\n\nPut your final answer within \\boxed{}."
    # Rows without an id column are named after the file and their 0-based position.
    assert [r["problem_id"] for r in rows[1:]] == ["aime-1", "aime-2", "aime-3"]
    truths = [json.loads(r["verification_info"])["ground_truth"] for r in rows]
    assert truths == ["33", "3/4", "0.2", "7"]


def test_math_missing_answer_names_row_and_field(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"problem": "ok", "answer": "1"},
            {"problem": "no answer", "answer": None},
        ],
    )
    with pytest.raises(ValueError, match=r"row 2, field 'answer': is missing"):
        load_benchmark(path)


def test_math_bool_answer_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": True}])
    with pytest.raises(ValueError, match=r"row 1, field 'answer': must be a string or a number"):
        load_benchmark(path, "math")


def test_math_missing_question(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"answer": "1", "problem": "  "}])
    with pytest.raises(ValueError, match=r"row 1, field 'problem': no question text"):
        load_benchmark(path, "math")


# -- code ------------------------------------------------------------------------


def lcb_stdin_record() -> dict:
    return {
        "question_id": "abc301_a",
        "question_title": "Overall Winner",
        "question_content": "Print the sum of two integers.",
        "platform": "atcoder",
        "starter_code": "",
        "public_test_cases": json.dumps(
            [
                {"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
            ]
        ),
        "private_test_cases": [{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}],
        "metadata": "{}",
        "difficulty": "easy",
    }


def lcb_functional_record() -> dict:
    starter = "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        "
    return {
        "question_id": "1",
        "question_content": "Return indices of two numbers adding up to target.",
        "starter_code": starter,
        "public_test_cases": json.dumps(
            [
                {"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
                {"input": "[3,2,4]\n6\n", "output": "[1,2]", "testtype": "functional"},
            ]
        ),
        "private_test_cases": json.dumps(
            [
                {"input": '"a b"\n{"k": [1, null]}\ntrue', "output": '"x"', "testtype": "functional"},
            ]
        ),
        "metadata": json.dumps({"func_name": "twoSum"}),
    }


def test_code_stdin_row(tmp_path: Path) -> None:
    rows = load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [lcb_stdin_record()]))
    assert_schema_rows(rows)
    (row,) = rows
    assert row["problem_id"] == "abc301_a"
    assert row["task_type"] == "prime_rl_code"
    assert row["prompt"] == "Print the sum of two integers." + STDIN_TAIL
    info = json.loads(row["verification_info"])
    assert isinstance(info["test_cases"], str)  # double-encoded like the public dataset
    assert json.loads(info["test_cases"]) == {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    tests = parse_test_cases(info)
    assert tests.fn_name is None and len(tests.inputs) == 2


def test_code_functional_row_parses_multi_line_args(tmp_path: Path) -> None:
    rows = load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [lcb_functional_record()]))
    assert_schema_rows(rows)
    (row,) = rows
    cases = json.loads(json.loads(row["verification_info"])["test_cases"])
    assert cases == {
        "fn_name": "twoSum",
        "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6], ["a b", {"k": [1, None]}, True]],
        "outputs": [[0, 1], [1, 2], "x"],
    }
    assert row["prompt"] == (
        "Return indices of two numbers adding up to target."
        "\n\nStart from this code:\n```python\n"
        "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:"
        "\n```"
        "\n\nWrite the function `twoSum` in Python (a method of class Solution if the starter "
        "code has one). Put it in one ```python code block at the end of your answer."
    )
    assert parse_test_cases(json.loads(row["verification_info"])).fn_name == "twoSum"


def test_code_metadata_as_dict_and_no_private_tests(tmp_path: Path) -> None:
    record = lcb_functional_record()
    record["metadata"] = {"func_name": "twoSum"}
    del record["private_test_cases"]
    (row,) = load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [record]), "code")
    assert len(json.loads(json.loads(row["verification_info"])["test_cases"])["inputs"]) == 2


def test_code_refuses_pickled_private_tests(tmp_path: Path) -> None:
    record = lcb_stdin_record()
    record["private_test_cases"] = "eJzLSM3JyVcozy/KSQEAGgQEXQ=="  # base64 of zlib data
    with pytest.raises(ValueError) as raised:
        load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [record]))
    message = str(raised.value)
    assert "row 1, field 'private_test_cases'" in message
    assert "refuses to unpickle" in message
    assert "drop the column" in message


def test_code_functional_needs_func_name(tmp_path: Path) -> None:
    record = lcb_functional_record()
    record["metadata"] = "{}"
    with pytest.raises(ValueError, match=r"row 1, field 'metadata': functional tests need 'func_name'"):
        load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [record]))


def test_code_mixed_test_types_refused(tmp_path: Path) -> None:
    record = lcb_stdin_record()
    record["private_test_cases"] = [{"input": "1", "output": "1", "testtype": "functional"}]
    with pytest.raises(ValueError, match="mixes stdin and functional"):
        load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [record]))


def test_code_bad_argument_line_names_the_test(tmp_path: Path) -> None:
    record = lcb_functional_record()
    record["public_test_cases"] = json.dumps([{"input": "[1]\nnot json", "output": "1", "testtype": "functional"}])
    with pytest.raises(ValueError, match=r"field 'public_test_cases\[1\]': line 2 of the input"):
        load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [record]))


def test_code_without_tests_refused(tmp_path: Path) -> None:
    record = lcb_stdin_record()
    record["public_test_cases"] = "[]"
    record["private_test_cases"] = ""
    with pytest.raises(ValueError, match="no tests"):
        load_benchmark(write_jsonl(tmp_path / "lcb.jsonl", [record]))


# -- code: HumanEval and MBPP ------------------------------------------------------


HUMANEVAL_PROMPT = (
    "from typing import List\n\n\n"
    "def below_zero(operations: List[int]) -> bool:\n"
    '    """ Whether the balance, starting at zero, ever falls below zero.\n'
    "    >>> below_zero([1, 2, -4, 5])\n"
    "    True\n"
    '    """\n'
)
HUMANEVAL_TEST = (
    "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\n"
    "def check(candidate):\n"
    "    assert candidate([]) == False\n"
    "    assert candidate([1, 2, -4, 5, 6]) == True\n"
)


def humaneval_record(task: int = 3) -> dict:
    return {
        "task_id": f"HumanEval/{task}",
        "prompt": HUMANEVAL_PROMPT,
        "canonical_solution": "    balance = 0\n    for op in operations:\n        balance += op\n"
        "        if balance < 0:\n            return True\n    return False\n",
        "test": HUMANEVAL_TEST,
        "entry_point": "below_zero",
    }


def test_humaneval_rows(tmp_path: Path) -> None:
    rows = load_benchmark(write_jsonl(tmp_path / "HumanEval.jsonl", [humaneval_record(3), humaneval_record(4)]))
    assert_schema_rows(rows)
    assert [r["problem_id"] for r in rows] == ["HumanEval/3", "HumanEval/4"]  # from task_id
    row = rows[0]
    assert row["task_type"] == "prime_rl_code"
    assert row["prompt"] == (
        "Complete this Python function:\n\n```python\n" + HUMANEVAL_PROMPT + "```\n\n"
        "The code above runs before yours, so you may use what it defines. Write the whole function "
        "`below_zero`, with the imports it needs, in one ```python code block at the end of your answer."
    )
    # The tests' process gets the prompt's helpers and check(); the program's gets the prompt
    # (HumanEval's harness runs prompt + completion); the one test calls check(entry_point).
    tests = parse_test_cases(json.loads(row["verification_info"]))
    assert tests == AssertTests(
        functions=["below_zero"],
        tests=["check(below_zero)"],
        setup=HUMANEVAL_PROMPT + "\n" + HUMANEVAL_TEST,
        program_prefix=HUMANEVAL_PROMPT,
    )
    # Nothing of the reference solution reaches the row.
    assert "balance = 0" not in row["verification_info"] + row["prompt"]


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"test": None}, "test", "is missing or empty; the row needs the test program defining check"),
        ({"test": "def check(candidate):\n    assert candidate(1) = 2\n"}, "test", "is not valid Python"),
        ({"test": "def test(candidate):\n    assert candidate([])\n"}, "test", "defines no top-level check"),
        ({"entry_point": None}, "entry_point", "no entry point: the row needs a non-empty 'entry_point'"),
        ({"entry_point": "belowZero"}, "entry_point", "'belowZero' is not a function the prompt defines"),
        ({"entry_point": "below zero"}, "entry_point", "must be the function's name"),
        ({"prompt": "   "}, "prompt", "is missing or empty; the row needs the function's signature"),
    ],
)
def test_humaneval_row_missing_a_field_is_refused(tmp_path: Path, change: dict, field: str, says: str) -> None:
    broken = {k: v for k, v in {**humaneval_record(1), **change}.items() if v is not None}
    path = write_jsonl(tmp_path / "he.jsonl", [humaneval_record(0), broken])
    with pytest.raises(ValueError) as raised:
        load_benchmark(path)
    message = str(raised.value)
    assert f"row 2, field '{field}': {says}" in message, message
    assert "(format 'code', HumanEval)" in message


def mbpp_record() -> dict:
    return {  # the original file's shape
        "task_id": 2,
        "text": "Write a function to find the shared elements from the given two lists.",
        "code": "def similar_elements(test_tup1, test_tup2):\n"
        "  res = tuple(set(test_tup1) & set(test_tup2))\n  return (res) ",
        "test_list": [
            "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
            "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    }


def test_mbpp_rows_original_and_sanitized_shapes(tmp_path: Path) -> None:
    (row,) = load_benchmark(write_jsonl(tmp_path / "mbpp.jsonl", [mbpp_record()]))
    assert_schema_rows([row])
    assert row["problem_id"] == "2"
    assert row["prompt"] == (
        "Write a function to find the shared elements from the given two lists."
        "\n\nYour code should pass these tests:\n\n```python\n"
        "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"
        "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))\n```\n\n"
        "Write `similar_elements` in Python. Put the code in one ```python code block at the end of your answer."
    )
    tests = parse_test_cases(json.loads(row["verification_info"]))
    assert tests.functions == ["similar_elements"] and tests.tests == mbpp_record()["test_list"]
    assert (tests.setup.strip(), tests.program_prefix) == ("", "")
    # The sanitized file: 'prompt' for the text, test_imports; a class the asserts build is a
    # function of the program too, a helper they never name is not.
    sanitized = {
        "source_file": "x.py",
        "task_id": 601,
        "prompt": "Write a function to find the longest chain which can be formed from the given set of pairs.",
        "code": "class Pair(object):\n  def __init__(self, a, b):\n    self.a = a\n    self.b = b\n"
        "def helper(x):\n  return x\n"
        "def max_chain_length(arr, n):\n  return n - 1\n",
        "test_imports": ["import math"],
        "test_list": ["assert max_chain_length([Pair(5, 24), Pair(15, 25)], 2) == 1"],
    }
    (row,) = load_benchmark(write_jsonl(tmp_path / "sanitized.jsonl", [sanitized]))
    tests = parse_test_cases(json.loads(row["verification_info"]))
    assert tests.functions == ["Pair", "max_chain_length"]
    assert tests.setup == "import math\n"
    assert "Write `Pair`, `max_chain_length` in Python." in row["prompt"]


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"test_list": []}, "test_list", "is empty; a problem without tests would reward any program"),
        ({"test_list": "assert f(1) == 2"}, "test_list", "is a string that is not a JSON list"),
        ({"test_list": [1, 2]}, "test_list", "must be a list of strings"),
        ({"test_list": ["assert similar_elements((1,), (1,) =="]}, "test_list[0]", "is not valid Python"),
        ({"code": None}, "code", "is missing or empty; the row needs the reference solution"),
        ({"code": "def other(a, b):\n  return a\n"}, "test_list", "calls none of the functions the reference"),
        ({"text": None}, "text", "no problem description: the row needs a non-empty 'text' or 'prompt'"),
        ({"test_setup_code": ["import math"]}, "test_setup_code", "must be a string of Python code"),
    ],
)
def test_mbpp_row_missing_a_field_is_refused(tmp_path: Path, change: dict, field: str, says: str) -> None:
    broken = {k: v for k, v in {**mbpp_record(), "task_id": 3, **change}.items() if v is not None}
    with pytest.raises(ValueError) as raised:
        load_benchmark(write_jsonl(tmp_path / "mbpp.jsonl", [mbpp_record(), broken]))
    message = str(raised.value)
    assert f"row 2, field '{field}': {says}" in message, message
    assert "(format 'code', MBPP)" in message


# -- mcq -------------------------------------------------------------------------


def test_mcq_listed_choices_exact_prompt(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mcq.jsonl",
        [
            {
                "id": "q1",
                "question": "Which is a noble gas?",
                "choices": ["N", "Ne", "Na"],
                "answer": "B",
                "subject": "chemistry",
            },
            {"id": "q2", "question": "2+2?", "choices": ["3", "4"], "answer": 1},
            {"id": "q3", "question": "Sky?", "choices": ["green", " blue ", "red", "grey"], "answer": "blue"},
        ],
    )
    rows = load_benchmark(path)
    assert_schema_rows(rows)
    assert rows[0] == {
        "problem_id": "q1",
        "task_type": "multiple_choice",
        "prompt": "Which is a noble gas?\n\nA) N\nB) Ne\nC) Na" + MCQ_TAIL,
        "verification_info": '{"answer": "B", "num_choices": 3}',
    }
    infos = [json.loads(r["verification_info"]) for r in rows]
    assert infos[1:] == [{"answer": "B", "num_choices": 2}, {"answer": "B", "num_choices": 4}]
    assert choice_task_reward(infos[0], "\\boxed{B}") == (1.0, None)


@pytest.mark.parametrize(
    ("answer", "choices", "message"),
    [
        ("D", ["a", "b", "c"], "letter D is not among the 3 choices"),
        (3, ["a", "b", "c"], "index 3 is out of range"),
        ("d", ["a", "b", "c"], "neither a capital letter nor the exact text"),
        ("A", ["B", "A"], "is both letter A and the text of choice B"),
        (None, ["a", "b"], "must be a letter"),
        (True, ["a", "b"], "must be a letter"),
    ],
)
def test_mcq_bad_answer(tmp_path: Path, answer, choices, message: str) -> None:
    path = write_jsonl(tmp_path / "mcq.jsonl", [{"question": "q", "choices": choices, "answer": answer}])
    with pytest.raises(ValueError, match=rf"row 1, field 'answer': .*{message}"):
        load_benchmark(path, "mcq")


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        (["only one"], "has 1 choices"),
        ([str(i) for i in range(27)], "has 27 choices"),
        (["a", "a"], "same text"),
        (["a", ""], "choice 1 must be a non-empty string"),
        ("a,b", "must be a list"),
    ],
)
def test_mcq_bad_choices(tmp_path: Path, choices, message: str) -> None:
    path = write_jsonl(tmp_path / "mcq.jsonl", [{"question": "q", "choices": choices, "answer": 0}])
    with pytest.raises(ValueError, match=rf"row 1, field 'choices': .*{message}"):
        load_benchmark(path, "mcq")


def gpqa_record(record_id: str) -> dict:
    return {
        "Record ID": record_id,
        "Question": "Which particle is a lepton?",
        "Correct Answer": "electron ",
        "Incorrect Answer 1": "proton",
        "Incorrect Answer 2": "neutron",
        "Incorrect Answer 3": "pion",
        "Explanation": "Leptons do not feel the strong force.",
        "Subdomain": "Physics",
    }


def choices_of(row: dict) -> list[str]:
    listing = row["prompt"].split("\n\n")[1]
    return [line[3:] for line in listing.split("\n")]


def test_gpqa_shuffle_is_deterministic_and_tracks_the_correct_text(tmp_path: Path) -> None:
    ids = [f"rec{i}" for i in range(24)]
    first = load_benchmark(write_jsonl(tmp_path / "gpqa.jsonl", [gpqa_record(i) for i in ids]))
    # Same ids in another file, in reverse order: each id keeps its order.
    again = load_benchmark(write_jsonl(tmp_path / "again.jsonl", [gpqa_record(i) for i in reversed(ids)]))
    assert_schema_rows(first)
    by_id = {row["problem_id"]: row for row in again}
    letters = set()
    for row in first:
        assert by_id[row["problem_id"]] == row
        choices = choices_of(row)
        assert sorted(choices) == ["electron", "neutron", "pion", "proton"]
        info = json.loads(row["verification_info"])
        assert info["num_choices"] == 4
        assert choices["ABCD".index(info["answer"])] == "electron"
        letters.add(info["answer"])
        assert row["prompt"].startswith("Which particle is a lepton?\n\nA) ")
        assert row["prompt"].endswith(MCQ_TAIL)
    # The correct answer is not always A (24 ids all landing on one letter: p = 4 * 4**-24).
    assert len(letters) > 1


def test_gpqa_missing_incorrect_answer(tmp_path: Path) -> None:
    record = gpqa_record("r")
    del record["Incorrect Answer 3"]
    with pytest.raises(ValueError, match=r"row 1, field 'Incorrect Answer 3'"):
        load_benchmark(write_jsonl(tmp_path / "gpqa.jsonl", [record]))


# -- schema ----------------------------------------------------------------------


def test_schema_rows_pass_through_four_fields(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "problem_id": 7,
                "task_type": "verifiable_math",
                "prompt": "p",
                "verification_info": '{"ground_truth": "1"}',
                "solve_rate": 0.5,
            },
            {
                "problem_id": "m",
                "task_type": "multiple_choice",
                "prompt": "q",
                "verification_info": {"answer": "A", "num_choices": 2},
            },
        ],
    )
    rows = load_benchmark(path)
    assert_schema_rows(rows)
    assert rows[0] == {
        "problem_id": "7",
        "task_type": "verifiable_math",
        "prompt": "p",
        "verification_info": '{"ground_truth": "1"}',
    }
    assert json.loads(rows[1]["verification_info"]) == {"answer": "A", "num_choices": 2}


def test_schema_rows_are_validated(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {"problem_id": "a", "task_type": "verifiable_math", "prompt": "p", "verification_info": '{"answer": "1"}'},
        ],
    )
    with pytest.raises(ValueError, match=r"row 1, field 'verification_info'.*ground_truth"):
        load_benchmark(path)


def test_schema_multiple_choice_info_is_checked(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "problem_id": "a",
                "task_type": "multiple_choice",
                "prompt": "p",
                "verification_info": '{"answer": "E", "num_choices": 4}',
            },
        ],
    )
    with pytest.raises(ValueError, match=r"row 1, field 'verification_info'.*only A-D"):
        load_benchmark(path)


# -- auto detection, ids, files ----------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"task_type": "x", "verification_info": "{}", "prompt": "p"}, "schema"),
        ({"question_content": "q"}, "code"),
        ({"public_test_cases": "[]", "question": "q"}, "code"),
        ({"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}, "code"),
        ({"task_id": 1, "prompt": "p", "canonical_solution": "", "test": ""}, "code"),
        ({"text": "t", "code": "", "test_list": []}, "code"),
        ({"question": "q", "choices": ["a", "b"], "answer": "A"}, "mcq"),
        ({"Question": "q", "Correct Answer": "a"}, "mcq"),
        ({"problem": "p", "answer": 1}, "math"),
        ({"question": "q", "answer": 1}, "math"),
        ({"answer": 1}, None),
        ({"text": "t"}, None),
    ],
)
def test_detect_format(record: dict, expected: str | None) -> None:
    assert detect_format(record) == expected


def test_auto_detection_error_lists_formats_and_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "t", "label": 1}])
    with pytest.raises(ValueError) as raised:
        load_benchmark(path)
    message = str(raised.value)
    assert "['label', 'text']" in message
    for fmt in FORMATS[1:]:
        assert repr(fmt) in message


def test_explicit_format_overrides_detection(tmp_path: Path) -> None:
    # Looks like math to "auto"; as "mcq" it lacks choices.
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "A"}])
    assert load_benchmark(path)[0]["task_type"] == "verifiable_math"
    with pytest.raises(ValueError, match=r"row 1, field 'choices'.*format 'mcq'"):
        load_benchmark(path, "mcq")


def test_unknown_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"problem": "p", "answer": 1}])
    with pytest.raises(ValueError, match="unknown benchmark format 'aime'"):
        load_benchmark(path, "aime")


def test_duplicate_ids_refused(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": 1, "problem": "a", "answer": 1},
            {"id": 2, "problem": "b", "answer": 2},
            {"id": "1", "problem": "c", "answer": 3},
        ],
    )
    with pytest.raises(ValueError, match=r"row 3, field 'problem_id': id '1' is also the id of row 1"):
        load_benchmark(path)


def test_id_field_precedence(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "ids.jsonl",
        [
            {"problem_id": "p", "id": "i", "problem": "a", "answer": 1},
            {"id": None, "question_id": 12, "problem": "b", "answer": 2},
            {"ID": "upper", "problem": "c", "answer": 3},
        ],
    )
    assert [r["problem_id"] for r in load_benchmark(path)] == ["p", "12", "upper"]


def test_malformed_line_is_numbered_by_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "answer": 1}\n\n{"problem": "b", answer: 2}\n')
    with pytest.raises(ValueError, match=r"row 3, field '<record>': not valid JSON"):
        load_benchmark(path)


def test_non_object_record(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": 1}, [1, 2]])
    with pytest.raises(ValueError, match=r"row 2, field '<record>': must be a JSON object"):
        load_benchmark(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        load_benchmark(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark(path)


def test_folder_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a folder"):
        load_benchmark(tmp_path)


def test_parquet_mcq(tmp_path: Path) -> None:
    # swarmrl.data.loading._read_parquet reads with pyarrow.parquet.
    pytest.importorskip("pyarrow", reason="reading parquet needs pyarrow")
    pd = pytest.importorskip("pandas", reason="writing the test file needs pandas")
    path = tmp_path / "gpqa.parquet"
    pd.DataFrame([gpqa_record("a"), gpqa_record("b")]).to_parquet(path)
    rows = load_benchmark(path)
    assert_schema_rows(rows)
    assert [r["problem_id"] for r in rows] == ["a", "b"]
    jsonl_rows = load_benchmark(write_jsonl(tmp_path / "gpqa.jsonl", [gpqa_record("a"), gpqa_record("b")]))
    assert rows == jsonl_rows


def test_schema_multiple_choice_info_must_be_json(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {"problem_id": "a", "task_type": "multiple_choice", "prompt": "p", "verification_info": "{answer: E}"},
        ],
    )
    with pytest.raises(ValueError, match=r"row 1, field 'verification_info': not valid JSON"):
        load_benchmark(path)
