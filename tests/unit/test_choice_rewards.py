"""Tests for swarmrl.rewards.choice: reading the answer letter and grading it."""

from __future__ import annotations

import pickle

import pytest

from swarmrl.rewards.choice import (
    MULTIPLE_CHOICE,
    check_choice,
    choice_task_reward,
    extract_choice,
)

INFO = {"answer": "C", "num_choices": 4}


def test_task_type_constant() -> None:
    assert MULTIPLE_CHOICE == "multiple_choice"


# -- grading ---------------------------------------------------------------------


def test_right_answer() -> None:
    assert choice_task_reward(INFO, "<think>C looks right</think> \\boxed{C}") == (1.0, None)


def test_wrong_answer() -> None:
    assert choice_task_reward(INFO, "\\boxed{B}") == (0.0, "answered B, expected C")


def test_missing_answer_after_think() -> None:
    reward, reason = choice_task_reward(INFO, "<think>hmm</think> I am not sure.")
    assert reward == 0.0
    assert reason == "no answer letter (\\boxed{X} or 'answer is X') after </think>"


def test_missing_answer_without_think() -> None:
    assert choice_task_reward(INFO, "no idea") == (0.0, "no answer letter (\\boxed{X} or 'answer is X')")


def test_unclosed_think() -> None:
    assert choice_task_reward(INFO, "<think>the answer is C \\boxed{C}") == (
        0.0,
        "completion opens <think> but never closes it",
    )


def test_answer_only_inside_think_does_not_count() -> None:
    completion = "<think>\\boxed{C} and the answer is C</think> Done."
    assert extract_choice(completion, 4) is None
    assert choice_task_reward(INFO, completion)[0] == 0.0


def test_answer_after_last_think_close_counts() -> None:
    completion = "<think>\\boxed{A}</think> wait <think>no</think> \\boxed{C}"
    assert choice_task_reward(INFO, completion) == (1.0, None)


def test_out_of_range_answer_is_graded_zero_with_reason() -> None:
    reward, reason = choice_task_reward(INFO, "\\boxed{E}")
    assert reward == 0.0
    assert reason == "answered E, which is not a choice (A-D); expected C"


def test_reward_function_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(choice_task_reward)) is choice_task_reward


# -- extraction --------------------------------------------------------------------


def test_last_of_several_boxes_counts() -> None:
    assert extract_choice("\\boxed{A} no, \\boxed{B}, finally \\boxed{D}", 4) == "D"


def test_last_letter_box_wins_over_a_later_non_letter_box() -> None:
    assert extract_choice("\\boxed{B}, which gives \\boxed{42}", 4) == "B"


def test_out_of_range_final_box_gives_none_not_an_earlier_box() -> None:
    assert extract_choice("\\boxed{A} or rather \\boxed{E}", 4) is None
    assert extract_choice("\\boxed{E}", 5) == "E"
    assert extract_choice("\\boxed{Z}", 26) == "Z"


def test_box_beats_phrase() -> None:
    assert extract_choice("\\boxed{B}. So the answer is C", 4) == "B"


@pytest.mark.parametrize(
    "box",
    [
        "C",
        " C ",
        "(C)",
        "( C )",
        "C)",
        "C.",
        "\\text{C}",
        "\\text{(C)}",
        "\\text{ C. }",
        "\\textbf{C}",
        "\\mathrm{C}",
        "\\mathbf{C)}",
        "\\text {C}",
    ],
)
def test_accepted_box_forms(box: str) -> None:
    assert extract_choice(f"So \\boxed{{{box}}}", 4) == "C"


@pytest.mark.parametrize(
    "box",
    [
        "c",  # lowercase is not a choice letter
        "CD",
        "C) 3.5 eV",
        "C:",
        "(C",
        "C.)",
        "\\text{C} \\text{D}",
        "\\emph{C}",
        "42",
        "",
    ],
)
def test_rejected_box_forms(box: str) -> None:
    assert extract_choice(f"So \\boxed{{{box}}}", 4) is None


@pytest.mark.parametrize(
    "text",
    [
        "The answer is C",
        "the answer is C.",
        "THE ANSWER IS C",
        "The correct answer is (C).",
        "Answer: C",
        "answer: (C)",
        "Final answer:C",
        "The answer is: C",
        "**Answer: C**",
        "Answer: **C**",
        "The answer is **(C)**",
    ],
)
def test_fallback_phrases(text: str) -> None:
    assert extract_choice(text, 4) == "C"


@pytest.mark.parametrize(
    "text",
    [
        "The answer is c",  # the letter must be a capital
        "Answer: CO2 is released",  # C runs on into a word
        "The answer is clear",
        "answers: C",
        "I answer C",
    ],
)
def test_phrases_that_are_not_answers(text: str) -> None:
    assert extract_choice(text, 4) is None


def test_last_phrase_counts() -> None:
    assert extract_choice("The answer is A. Hmm, no: the answer is D.", 4) == "D"


def test_out_of_range_phrase_letter_gives_none() -> None:
    assert extract_choice("Answer: B ... actually the answer is F", 4) is None


def test_unclosed_think_gives_none() -> None:
    assert extract_choice("<think>\\boxed{C}", 4) is None


def test_extract_rejects_bad_num_choices() -> None:
    for bad in (1, 27, True, "4"):
        with pytest.raises(ValueError, match="num_choices"):
            extract_choice("\\boxed{A}", bad)


# -- verification_info ---------------------------------------------------------------


def test_check_choice_accepts_valid_info() -> None:
    assert check_choice(INFO) is None
    assert check_choice({"answer": "B", "num_choices": 2}) is None
    assert check_choice({"answer": "Z", "num_choices": 26}) is None


@pytest.mark.parametrize(
    ("info", "field"),
    [
        ({"answer": "C"}, "num_choices"),
        ({"answer": "C", "num_choices": 1}, "num_choices"),
        ({"answer": "C", "num_choices": 27}, "num_choices"),
        ({"answer": "C", "num_choices": "4"}, "num_choices"),
        ({"answer": "C", "num_choices": True}, "num_choices"),
        ({"num_choices": 4}, "answer"),
        ({"answer": "c", "num_choices": 4}, "answer"),
        ({"answer": "CC", "num_choices": 4}, "answer"),
        ({"answer": 2, "num_choices": 4}, "answer"),
        ({"answer": "E", "num_choices": 4}, "answer"),
        (["C", 4], "verification_info"),
    ],
)
def test_invalid_info_is_named_and_raised(info, field: str) -> None:
    problem = check_choice(info)
    assert problem is not None and field in problem
    with pytest.raises(ValueError) as raised:
        choice_task_reward(info, "\\boxed{C}")
    assert str(raised.value) == problem
