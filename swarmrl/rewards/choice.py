"""Multiple-choice rewards (``task_type = "multiple_choice"``): grade the answer letter.

``verification_info`` is ``{"answer": "C", "num_choices": 4}``: the correct
letter, a capital within the first ``num_choices`` letters of the alphabet
(2 to 26 choices). Grading is an exact letter comparison, so there is no
timeout to worry about; the function is still module-level so a spawned
verifier worker can unpickle it by reference like the other graders.

Only the answer region counts (after the last ``</think>``; nothing when a
``<think>`` is never closed), so a letter weighed mid-thought is not graded.
Where the letter is read from, in order of preference:

1. The last top-level ``\\boxed{...}`` whose content is a letter form. Content
   is stripped of surrounding whitespace and may be wrapped once in
   ``\\text{}``, ``\\textbf{}``, ``\\mathrm{}`` or ``\\mathbf{}``; inside that, the
   accepted forms are exactly ``C``, ``(C)``, ``C)`` and ``C.`` with a capital
   letter (whitespace allowed inside the parentheses). Boxes holding anything
   else (``\\boxed{42}``, ``\\boxed{C) 3.5 eV}``, ``\\boxed{c}``) are not letter
   boxes and are passed over.
2. Failing that, the last phrase ``answer is X``, ``answer is: X`` or
   ``answer: X``, with the words matched case-insensitively, optional
   ``**`` bold markers before the letter, and ``X`` either a bare capital
   or ``(X)``. A bare letter must not run on into another letter or digit,
   so ``answer: CO2`` is not an answer C.

Whichever is found last in its kind decides: a final answer outside the
choices (``\\boxed{E}`` with four choices) yields no answer at all rather
than an earlier, abandoned one.
"""

from __future__ import annotations

import re
import string

# Shared with the math grader so both read \boxed{} the same way (escaped
# braces, nesting, unclosed boxes skipped).
from swarmrl.rewards.answer import answer_region, boxed_contents, missing_answer_reason

MULTIPLE_CHOICE = "multiple_choice"

MIN_CHOICES = 2
MAX_CHOICES = 26
_LETTERS = string.ascii_uppercase

# One optional LaTeX text/font wrapper around the whole box content.
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{(?P<inner>.*)\}", re.DOTALL)
# The letter forms accepted inside a box: C, (C), C), C.
_LETTER_FORM = re.compile(r"\(\s*(?P<paren>[A-Z])\s*\)|(?P<bare>[A-Z])[).]?")
# "answer is X", "answer is: X", "answer: X"; words case-insensitive, letter capital.
_ANSWER_PHRASE = re.compile(
    r"\b(?i:answer)\s*(?:(?i:is)\s*:?|:)\s*(?:\*\*)?\s*"
    r"(?:\(\s*(?P<paren>[A-Z])\s*\)|(?P<bare>[A-Z])(?![A-Za-z0-9]))"
)


def check_choice(verification_info: dict) -> str | None:
    """None if ``verification_info`` can grade a multiple-choice row, else what is wrong."""
    example = 'e.g. {"answer": "C", "num_choices": 4}'
    if not isinstance(verification_info, dict):
        return f"verification_info must be an object {example}, got {type(verification_info).__name__}"
    num_choices = verification_info.get("num_choices")
    if isinstance(num_choices, bool) or not isinstance(num_choices, int):
        return (
            f"verification_info 'num_choices' must be an integer from {MIN_CHOICES} to "
            f"{MAX_CHOICES}, got {num_choices!r}; {example}"
        )
    if not MIN_CHOICES <= num_choices <= MAX_CHOICES:
        return f"verification_info 'num_choices' must be from {MIN_CHOICES} to {MAX_CHOICES}, got {num_choices}"
    answer = verification_info.get("answer")
    allowed = f"A-{_LETTERS[num_choices - 1]}"
    if not isinstance(answer, str) or len(answer) != 1 or answer not in _LETTERS:
        return (
            f"verification_info 'answer' must be one capital letter ({allowed} for "
            f"{num_choices} choices), got {answer!r}; {example}"
        )
    if _LETTERS.index(answer) >= num_choices:
        return (
            f"verification_info 'answer' is {answer!r} but with {num_choices} choices "
            f"only {allowed} exist; fix 'answer' or 'num_choices'"
        )
    return None


def _box_letter(content: str) -> str | None:
    """The capital letter a box's content names, if it is one of the accepted forms."""
    content = content.strip()
    wrapped = _WRAPPER.fullmatch(content)
    if wrapped is not None:
        content = wrapped.group("inner").strip()
    form = _LETTER_FORM.fullmatch(content)
    if form is None:
        return None
    return form.group("paren") or form.group("bare")


def _final_letter(region: str) -> str | None:
    """The letter the region commits to, any capital A-Z; range is checked by callers."""
    for content in reversed(boxed_contents(region)):
        letter = _box_letter(content)
        if letter is not None:
            return letter
    phrases = list(_ANSWER_PHRASE.finditer(region))
    if phrases:
        last = phrases[-1]
        return last.group("paren") or last.group("bare")
    return None


def _check_num_choices(num_choices: int) -> None:
    if (
        isinstance(num_choices, bool)
        or not isinstance(num_choices, int)
        or not (MIN_CHOICES <= num_choices <= MAX_CHOICES)
    ):
        raise ValueError(f"num_choices must be an integer from {MIN_CHOICES} to {MAX_CHOICES}, got {num_choices!r}")


def extract_choice(completion: str, num_choices: int) -> str | None:
    """The answer letter of ``completion`` (see the module docstring), or None.

    None when ``<think>`` is never closed, when no letter is found after the
    last ``</think>``, or when the final letter is not among the first
    ``num_choices`` letters.
    """
    _check_num_choices(num_choices)
    region = answer_region(completion)
    if region is None:
        return None
    letter = _final_letter(region)
    if letter is None or _LETTERS.index(letter) >= num_choices:
        return None
    return letter


def choice_task_reward(verification_info: dict, completion: str) -> tuple[float, str | None]:
    """Reward for a ``multiple_choice`` row: 1.0 if the answer letter is the right one.

    Returns ``(reward, reason)``; ``reason`` is None for a right answer and
    otherwise says why the reward is 0. An invalid ``verification_info``
    raises ValueError (a data bug, not a wrong answer), with the message of
    :func:`check_choice`.
    """
    problem = check_choice(verification_info)
    if problem is not None:
        raise ValueError(problem)
    expected = verification_info["answer"]
    num_choices = verification_info["num_choices"]
    region = answer_region(completion)
    letter = None if region is None else _final_letter(region)
    if letter is None:
        return 0.0, missing_answer_reason(completion, "answer letter (\\boxed{X} or 'answer is X')")
    if _LETTERS.index(letter) >= num_choices:
        return 0.0, (f"answered {letter}, which is not a choice (A-{_LETTERS[num_choices - 1]}); expected {expected}")
    if letter != expected:
        return 0.0, f"answered {letter}, expected {expected}"
    return 1.0, None
