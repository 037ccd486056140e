"""Task schema and loading: every format, every kind of bad row, the solve-rate filter."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from swarmrl.data import loading, schema
from swarmrl.data.loading import LoadResult, write_jsonl
from swarmrl.data.schema import RowError, TaskRow
from swarmrl.rewards import registry
from swarmrl.rewards.code import parse_test_cases

# The loaders as the project calls them: with the task-type registry's checks.
CHECKS = registry.checks()


def parse_row(record, row, source=None):
    return schema.parse_row(record, row, source, checks=CHECKS)


def load_tasks(source, **kwargs):
    return loading.load_tasks(source, checks=CHECKS, **kwargs)


SOLVE = "solve_rate_qwen_r1_distill_7b"


def math_row(i: int, rate: float | None = 0.5, **over) -> dict:
    row = {
        "problem_id": f"math-{i}",
        "task_type": "verifiable_math",
        "prompt": f"What is {i} + {i}?",
        "verification_info": json.dumps({"ground_truth": str(2 * i)}),
        SOLVE: rate,
    }
    row.update(over)
    return row


def code_row(i: int, rate: float | None = 0.5, n_in: int = 2, n_out: int = 2, **over) -> dict:
    cases = {"inputs": [f"{k}\n" for k in range(n_in)], "outputs": [f"{k}\n" for k in range(n_out)]}
    row = {
        "problem_id": f"code-{i}",
        "task_type": "prime_rl_code",
        "prompt": "Echo the input.",
        "verification_info": json.dumps({"test_cases": json.dumps(cases)}),
        SOLVE: rate,
    }
    row.update(over)
    return row


def good_rows() -> list[dict]:
    return [math_row(1, 0.1), code_row(2, 0.4), math_row(3, 0.9), code_row(4, 0.6)]


def write_lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def ids(result: LoadResult) -> list[str]:
    return [row.problem_id for row in result.rows]


def assert_balanced(result: LoadResult) -> None:
    c = result.counts
    dropped = c["malformed"] + c["filtered_solve_rate"] + c["missing_solve_rate"]
    assert c["read"] == dropped + c["kept"]
    assert c["kept"] == len(result.rows)


# --- schema ----------------------------------------------------------------


def test_taskrow_keeps_extra_columns_and_decodes_verification():
    row = TaskRow.model_validate(code_row(7, 0.25, source="synthetic"))
    assert row.column(SOLVE) == 0.25
    assert row.column("source") == "synthetic"
    assert row.column("absent", "dflt") == "dflt"
    assert row.verification()["test_cases"]
    assert parse_test_cases(row.verification()).inputs == ["0\n", "1\n"]
    assert TaskRow.model_validate(math_row(3)).verification() == {"ground_truth": "6"}
    assert {"verifiable_math", "prime_rl_code"} <= set(CHECKS)


def test_type_checks_come_from_the_registry():
    """The schema knows no task type: without checks only the common shape is checked, and a
    registered type's check is what refuses its rows."""
    no_truth = math_row(1, verification_info='{"answer": "2"}')
    assert schema.parse_row(no_truth, 1)[0] is not None
    assert schema.parse_row(no_truth, 1, checks=CHECKS)[0] is None
    row = math_row(1, task_type="countdown", verification_info='{"target": 24}')
    checks = {**CHECKS, "countdown": lambda info: None if "numbers" in info else "countdown needs 'numbers'"}
    task, errors = schema.parse_row(row, 4, checks=checks)
    assert task is None and errors[0].field == "verification_info" and "needs 'numbers'" in errors[0].message


def test_numeric_ground_truth_and_inline_test_cases_are_accepted():
    assert parse_row(math_row(1, verification_info='{"ground_truth": 42}'), 1)[0] is not None
    inline = json.dumps({"test_cases": {"inputs": [[1]], "outputs": [1], "fn_name": "f"}})
    assert parse_row(code_row(1, verification_info=inline), 1)[0] is not None


def test_unknown_task_type_loads_but_needs_json_object():
    ok = math_row(1, task_type="countdown", verification_info='{"target": 24}')
    assert parse_row(ok, 1)[0] is not None
    bad = math_row(1, task_type="countdown", verification_info="[1, 2]")
    task, errors = parse_row(bad, 3)
    assert task is None and errors[0].field == "verification_info"


@pytest.mark.parametrize(
    "record, field, fragment",
    [
        ({k: v for k, v in math_row(1).items() if k != "prompt"}, "prompt", "missing"),
        (math_row(1, prompt="   "), "prompt", "empty"),
        (math_row(1, problem_id=5), "problem_id", "must be a string, got int"),
        (math_row(1, verification_info="nope"), "verification_info", "not valid JSON"),
        (math_row(1, verification_info={"ground_truth": "1"}), "verification_info", "must be a string"),
        (math_row(1, verification_info='{"answer": "2"}'), "verification_info", "ground_truth"),
        (math_row(1, verification_info='{"ground_truth": [1]}'), "verification_info", "string or a number"),
        (code_row(1, n_in=2, n_out=3), "verification_info", "2 inputs but 3 outputs"),
        (code_row(1, n_in=0, n_out=0), "verification_info", "no test cases"),
        (code_row(1, verification_info='{"test_cases": "{bad"}'), "verification_info", "not valid JSON"),
        (code_row(1, verification_info='{"tests": []}'), "verification_info", "test_cases"),
        ("just a string", "<record>", "must be a JSON object"),
    ],
)
def test_parse_row_reports_field_and_reason(record, field, fragment):
    task, errors = parse_row(record, 17)
    assert task is None
    assert [e.field for e in errors] == [field]
    assert errors[0].row == 17 and fragment in errors[0].message


def test_row_error_str_format():
    err = RowError(17, "verification_info", "not valid JSON (Expecting value: line 1 column 1)")
    expected = "row 17, field 'verification_info': not valid JSON (Expecting value: line 1 column 1)"
    assert str(err) == expected
    assert str(RowError(2, "prompt", "x", "data/a.jsonl")) == "data/a.jsonl row 2, field 'prompt': x"
    _, errors = parse_row(math_row(1, verification_info=""), 17)
    assert str(errors[0]) == str(err)


# --- formats ---------------------------------------------------------------


def test_jsonl(tmp_path):
    result = load_tasks(write_lines(tmp_path / "t.jsonl", good_rows()))
    assert ids(result) == ["math-1", "code-2", "math-3", "code-4"]
    assert result.errors == [] and result.counts["read"] == 4
    assert_balanced(result)


def test_json_list_and_json_lines_named_json(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(good_rows()))
    assert len(load_tasks(listed).rows) == 4
    assert len(load_tasks(write_lines(tmp_path / "lines.json", good_rows())).rows) == 4
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(ValueError, match="JSON list"):
        load_tasks(scalar)


def test_parquet_file(tmp_path):
    result = load_tasks(write_parquet(tmp_path / "t.parquet", good_rows()))
    assert ids(result) == ["math-1", "code-2", "math-3", "code-4"]
    assert result.rows[0].column(SOLVE) == pytest.approx(0.1)


def test_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_list(good_rows()).save_to_disk(str(tmp_path / "ds"))
    assert ids(load_tasks(tmp_path / "ds")) == ["math-1", "code-2", "math-3", "code-4"]
    with pytest.raises(ValueError, match="without splits"):
        load_tasks(tmp_path / "ds", split="train")


def test_saved_dataset_dict_defaults_to_train(tmp_path):
    import datasets

    rows = good_rows()
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:3]), test=datasets.Dataset.from_list(rows[3:]))
    dd.save_to_disk(str(tmp_path / "dd"))
    assert ids(load_tasks(tmp_path / "dd")) == ["math-1", "code-2", "math-3"]
    assert ids(load_tasks(tmp_path / "dd", split="test")) == ["code-4"]
    with pytest.raises(ValueError, match=r"\['test', 'train'\]"):
        load_tasks(tmp_path / "dd", split="validation")


def test_folder_of_parquet_snapshot(tmp_path):
    rows = good_rows()
    snap = tmp_path / "snap"
    write_parquet(snap / "data" / "train-00001-of-00002.parquet", rows[2:])
    write_parquet(snap / "data" / "train-00000-of-00002.parquet", rows[:2])
    write_parquet(snap / "data" / "test-00000-of-00001.parquet", [math_row(99)])
    write_parquet(snap / ".cache" / "junk.parquet", [math_row(98)])
    (snap / "README.md").write_text("# card")
    assert ids(load_tasks(snap)) == ["math-1", "code-2", "math-3", "code-4"]
    assert ids(load_tasks(snap, split="test")) == ["math-99"]


def test_folder_of_jsonl_names_file_in_errors(tmp_path):
    write_lines(tmp_path / "a.jsonl", [math_row(1)])
    write_lines(tmp_path / "b.jsonl", [math_row(2), math_row(3, prompt="")])
    result = load_tasks(tmp_path)
    assert ids(result) == ["math-1", "math-2"]
    assert str(result.errors[0]).startswith("b.jsonl row 2, field 'prompt': prompt is empty")


def test_missing_path_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"\.jsonl.*\.parquet"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown extension"):
        load_tasks(tmp_path / "t.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.parquet"):
        load_tasks(tmp_path / "empty")


# --- malformed rows --------------------------------------------------------


def malformed_jsonl(path: Path) -> Path:
    missing = {k: v for k, v in math_row(2).items() if k != "task_type"}
    lines = [
        json.dumps(math_row(1)),  # line 1 ok
        json.dumps(missing),  # line 2 missing task_type
        json.dumps(math_row(3, verification_info="not json")),  # line 3
        "",  # line 4 blank: not a row
        json.dumps(math_row(5, verification_info='{"answer": 1}')),  # line 5
        json.dumps(code_row(6, n_in=3, n_out=1)),  # line 6
        "{this is not json",  # line 7
        json.dumps(code_row(8)),  # line 8 ok
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_rows_are_skipped_and_located(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="swarmrl.data"):
        result = load_tasks(malformed_jsonl(tmp_path / "bad.jsonl"))
    assert ids(result) == ["math-1", "code-8"]
    located = [(e.row, e.field) for e in result.errors]
    assert located == [
        (2, "task_type"),
        (3, "verification_info"),
        (5, "verification_info"),
        (6, "verification_info"),
        (7, "<record>"),
    ]
    assert "not valid JSON" in result.errors[4].message
    assert result.counts["read"] == 7 and result.counts["malformed"] == 5
    assert_balanced(result)
    assert "row 6, field 'verification_info'" in caplog.text
    assert "kept 2 of 7" in caplog.text


def test_on_malformed_error_lists_rows(tmp_path):
    with pytest.raises(ValueError) as info:
        load_tasks(malformed_jsonl(tmp_path / "bad.jsonl"), on_malformed="error")
    text = str(info.value)
    assert "5 malformed row(s)" in text
    assert "row 7, field '<record>'" in text and "on_malformed='skip'" in text


def test_on_malformed_error_caps_the_listing(tmp_path):
    records = [math_row(i, prompt="") for i in range(25)]
    with pytest.raises(ValueError) as info:
        load_tasks(write_lines(tmp_path / "bad.jsonl", records), on_malformed="error")
    assert "25 malformed" in str(info.value) and "... and 15 more" in str(info.value)
    assert str(info.value).count("field 'prompt'") == 10


def test_malformed_logging_is_capped(tmp_path, caplog):
    records = [math_row(i, prompt="") for i in range(25)]
    with caplog.at_level(logging.WARNING, logger="swarmrl.data"):
        result = load_tasks(write_lines(tmp_path / "bad.jsonl", records))
    assert len(result.errors) == 25
    assert caplog.text.count("malformed task:") == 20
    assert "5 more malformed rows" in caplog.text


# --- solve-rate filter -----------------------------------------------------


def solve_rows() -> list[dict]:
    return [
        math_row(1, 0.0),
        math_row(2, 0.2),
        code_row(3, 0.5),
        math_row(4, 0.8),
        math_row(5, 1.0),
        math_row(6, None),
        {k: v for k, v in math_row(7).items() if k != SOLVE},
        math_row(8, float("nan")),
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_solve_rate_filter_keeps_in_range_and_counts_rest(tmp_path, fmt):
    rows = solve_rows()
    if fmt == "jsonl":
        path = write_lines(tmp_path / "t.jsonl", rows[:7])  # JSON has no NaN literal in spec
    else:
        path = write_parquet(tmp_path / "t.parquet", rows)
    result = load_tasks(path, solve_rate_column=SOLVE, solve_rate_range=(0.2, 0.8))
    assert ids(result) == ["math-2", "code-3", "math-4"]
    assert result.counts["filtered_solve_rate"] == 2
    assert result.counts["missing_solve_rate"] == (2 if fmt == "jsonl" else 3)
    assert_balanced(result)


def test_non_numeric_solve_rate_is_malformed(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [math_row(1, 0.5), math_row(2, "high")])
    result = load_tasks(path, solve_rate_column=SOLVE, solve_rate_range=(0, 1))
    assert ids(result) == ["math-1"]
    assert (result.errors[0].row, result.errors[0].field) == (2, SOLVE)


def test_absent_solve_rate_column_raises_with_columns(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", good_rows())
    with pytest.raises(ValueError) as info:
        load_tasks(path, solve_rate_column="solve_rate_typo", solve_rate_range=(0, 1))
    assert "solve_rate_typo" in str(info.value) and SOLVE in str(info.value)
    with pytest.raises(ValueError, match="solve_rate_typo"):
        load_tasks(path, solve_rate_column="solve_rate_typo")


def test_bad_arguments_fail_before_reading(tmp_path):
    path = tmp_path / "not-read.jsonl"
    with pytest.raises(ValueError, match="solve_rate_column"):
        load_tasks(path, solve_rate_range=(0, 1))
    with pytest.raises(ValueError, match="lo <= hi"):
        load_tasks(path, solve_rate_column=SOLVE, solve_rate_range=(0.9, 0.1))
    with pytest.raises(ValueError, match="on_malformed"):
        load_tasks(path, on_malformed="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        load_tasks(path, limit=0)


def test_limit_caps_kept_rows(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [math_row(i, i / 10) for i in range(10)])
    result = load_tasks(path, limit=3, solve_rate_column=SOLVE, solve_rate_range=(0.25, 1))
    assert ids(result) == ["math-3", "math-4", "math-5"]
    assert result.counts["read"] == 6 and result.counts["filtered_solve_rate"] == 3
    assert_balanced(result)


# --- writing ---------------------------------------------------------------


def test_write_jsonl_round_trip_and_refuses_invalid(tmp_path):
    rows = [TaskRow.model_validate(math_row(1, 0.3)), code_row(2, 0.7)]
    out = tmp_path / "gen" / "tasks.jsonl"
    assert write_jsonl(rows, out) == 2
    back = load_tasks(out, solve_rate_column=SOLVE, solve_rate_range=(0, 1))
    assert ids(back) == ["math-1", "code-2"] and back.rows[1].column(SOLVE) == 0.7
    with pytest.raises(ValueError, match="row 2, field 'prompt'"):
        write_jsonl([math_row(3), math_row(4, prompt="")], out)
    assert ids(load_tasks(out)) == ["math-1", "code-2"]  # old file untouched
    assert [p.name for p in out.parent.iterdir()] == ["tasks.jsonl"]
