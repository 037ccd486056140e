"""reasoning-gym as a task source and a task type: rows by hash split, grading by the dataset's
own scorer, answers read from a completion as documented (swarmrl/rewards/gym.py)."""

from __future__ import annotations

import json

import pytest

from swarmrl.config import load_config
from swarmrl.rewards import registry
from swarmrl.rewards.gym import extract
from swarmrl.tasks.source import check_source, task_rows

LEGS = '{dataset = "leg_counting", config = {min_animals = 1, max_animals = 2}}'


def rows(options: str, train: int = 30, held: int = 6):
    sizes = ["--tasks.train_size", str(train), "--tasks.eval_size", str(held)]
    cfg = load_config(None, ["--tasks.source", "reasoning_gym", "--tasks.options", options, *sizes])
    check_source(cfg.tasks)
    return task_rows(cfg, log=lambda *_: None)


def test_rows_are_the_datasets_split_by_question_and_graded_by_its_scorer():
    train, held = rows(LEGS)
    assert len(train) == 30 and len(held) == 6
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert len({r["prompt"] for r in train}) == 30  # no question twice
    grader = registry.get("reasoning_gym")
    for row in train[:5]:
        info = json.loads(row["verification_info"])
        assert row["task_type"] == "reasoning_gym" and "legs" in row["prompt"] and grader.check(info) is None
        right, wrong = info["answer"], str(int(info["answer"]) + 1)
        assert grader.grade(info, f"<think>count</think>\\boxed{{{right}}}") == (1.0, None)
        assert grader.grade(info, f"<answer>{right}</answer>")[0] == 1.0
        score, why = grader.grade(info, f"\\boxed{{{wrong}}}")
        assert score < 1.0 and "scorer gave" in why
    # The same config and seed give the same rows (every role rebuilds them).
    assert rows(LEGS) == (train, held)


def test_an_answer_is_read_from_the_box_then_the_tag_then_the_last_line():
    assert extract("<think>7?</think>so \\boxed{8} or <answer>9</answer>") == "8"
    assert extract("<think>x</think><answer> 9 </answer>\nfine") == "9"
    assert extract("<think>x</think>\nThe total is\n 12 \n\n") == "12"
    assert extract("<think>never closed \\boxed{3}") is None
    assert extract("") is None


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ("{config = {}}", "tasks.options for task source 'reasoning_gym': dataset: Field required"),
        ('{dataset = "leg_counting", difficulty = 3}', "difficulty: Extra inputs are not permitted"),
        ('{dataset = "no_such_set"}', "reasoning-gym dataset 'no_such_set'"),
        ('{dataset = "leg_counting", config = {min_animals = "many"}}', "reasoning-gym dataset 'leg_counting'"),
    ],
)
def test_bad_options_are_refused_naming_what_is_wrong(options, needle):
    with pytest.raises(ValueError) as info:
        rows(options)
    assert needle in str(info.value), str(info.value)


def test_a_dataset_too_small_for_the_sizes_asked_says_so():
    tiny = '{dataset = "basic_arithmetic", config = {min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, operators = ["+"]}}'  # noqa: E501
    with pytest.raises(ValueError, match="distinct train problems of the 5000 asked for"):
        rows(tiny, train=5000)


def test_a_row_that_names_no_dataset_is_refused_by_the_check():
    check = registry.get("reasoning_gym").check
    good = {"dataset": "leg_counting", "config": {}, "seed": 0, "size": 10, "index": 3}
    assert check(good) is None
    assert "no dataset 'nope'" in check({**good, "dataset": "nope"})
    assert "outside the dataset's size" in check({**good, "index": 10})
    assert "needs seed" in check({**good, "seed": "0"})
    assert "extract must be one of answer, last_number" in check({**good, "extract": "boxed"})


def test_extract_last_number_grades_the_last_number_a_chatty_answer_writes():
    options = '{dataset = "gcd", config = {min_value = 1, max_value = 20}, extract = "last_number"}'
    train, _ = rows(options, train=8, held=2)
    grader = registry.get("reasoning_gym")
    for row in train:
        info = json.loads(row["verification_info"])
        assert info["extract"] == "last_number" and grader.check(info) is None
        right, wrong = info["answer"], str(int(info["answer"]) + 1)
        assert grader.grade(info, f"The GCD of these is {right}.") == (1.0, None)
        assert grader.grade(info, f"It is {right}, no, {wrong}.")[0] < 1.0  # the last number counts
        assert grader.grade(info, f"\\boxed{{{right}}} not {wrong}") == (1.0, None)  # a box first
        # The same sentence under the default reading is the whole last line, which the scorer refuses.
        assert grader.grade({k: v for k, v in info.items() if k != "extract"}, f"The GCD is {right}.")[0] < 1.0
    assert "extract" not in json.loads(rows(LEGS, train=2, held=1)[0][0]["verification_info"])
