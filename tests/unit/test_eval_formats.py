"""Tests for swarmrl.eval.formats: benchmark files in, task-schema rows out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmrl.data.schema import parse_row
from swarmrl.eval.formats import FORMATS, MATH_SUFFIX, detect_format, load_benchmark
from swarmrl.rewards.choice import choice_task_reward
from swarmrl.rewards.code import parse_test_cases

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
