"""A small built-in set of programming tasks, with reference and deliberately wrong solutions.

Rows follow the INTELLECT-2 RL dataset schema for code (`task_type` "prime_rl_code"), so the
same loaders and the sandboxed code verifier handle them and the public dataset alike. They
exist for tests and demos of that verifier: every task has a reference program that passes all
its tests and a plausible wrong one (an off-by-one, a forgotten case) that fails at least one,
so a verifier can be checked end to end without a model or a download.

Two kinds of task, as in the public dataset:

* "stdin": a complete program reads standard input and prints the answer; each test case is
  the full stdin text and the exact expected stdout.
* "function": a function named `fn_name` is called with each test's positional arguments and
  its return value compared with the expected JSON value (a tuple return is written as a list).

The expected outputs were worked out by hand and are checked by running every reference
solution for real in tests/integration/test_code_tasks.py; a wrong expected output would be a bug there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from swarmrl.data.schema import CODE

TASK_TYPE = CODE

STDIN = "stdin"
FUNCTION = "function"

COMPLETIONS = ("reference", "wrong")

_STDIN_INSTRUCTION = (
    "Write a Python program that reads from standard input and prints the answer. "
    "Put the program in one ```python code block at the end of your answer."
)


@dataclass(frozen=True)
class CodeTask:
    problem_id: str
    kind: str  # STDIN or FUNCTION
    statement: str  # the prompt text, instruction included
    solution: str  # a complete program for STDIN, a def for FUNCTION; ends with a newline
    fn_name: str | None
    inputs: list
    outputs: list
    difficulty: int


def _function_instruction(signature: str, returns: str) -> str:
    return (
        f"Write a Python function `{signature}` that returns {returns}. "
        "Put it in one ```python code block at the end of your answer."
    )


# Per task: the short reasoning put in the <think> block, and the wrong program. They live
# beside TASKS rather than in CodeTask so the public dataclass stays the schema's shape.
_THOUGHTS: dict[str, str] = {}
_WRONG: dict[str, str] = {}


def _task(
    problem_id: str,
    kind: str,
    statement: str,
    solution: str,
    *,
    thought: str,
    wrong: str,
    inputs: list,
    outputs: list,
    difficulty: int,
    fn_name: str | None = None,
) -> CodeTask:
    _THOUGHTS[problem_id] = thought
    _WRONG[problem_id] = wrong
    return CodeTask(problem_id, kind, statement, solution, fn_name, inputs, outputs, difficulty)


TASKS: tuple[CodeTask, ...] = (
    # --- stdin tasks ---
    _task(
        "code-sum-two",
        STDIN,
        "You are given two integers a and b on one line, separated by a space. "
        "Print a + b.\n\nExample: for the input `3 4` the output is `7`.\n\n" + _STDIN_INSTRUCTION,
        "a, b = map(int, input().split())\nprint(a + b)\n",
        thought="Read the two integers from the line and print their sum.",
        # Wrong operator: passes "0 0" but nothing else.
        wrong="a, b = map(int, input().split())\nprint(a - b)\n",
        inputs=["1 2\n", "0 0\n", "-5 3\n", "-7 -8\n", "1000000000 1000000000\n"],
        outputs=["3\n", "0\n", "-2\n", "-15\n", "2000000000\n"],
        difficulty=1,
    ),
    _task(
        "code-reverse-words",
        STDIN,
        "You are given one line of text made of words separated by single spaces "
        "(the line may be empty). Reverse the letters of each word but keep the words "
        "in their order, and print the result on one line.\n\n"
        "Example: for the input `hello world` the output is `olleh dlrow`.\n\n" + _STDIN_INSTRUCTION,
        'print(" ".join(word[::-1] for word in input().split()))\n',
        thought="Split the line into words, reverse each one, and join them back with spaces.",
        # Reverses the whole line, so the word order flips too.
        wrong="print(input()[::-1])\n",
        inputs=["hello world\n", "a\n", "abc def ghi\n", "racecar\n", "\n"],
        outputs=["olleh dlrow\n", "a\n", "cba fed ihg\n", "racecar\n", "\n"],
        difficulty=2,
    ),
    _task(
        "code-count-vowels",
        STDIN,
        "You are given one line of text (it may be empty). Print how many of its characters "
        "are vowels: a, e, i, o, u, in upper or lower case.\n\n"
        "Example: for the input `hello` the output is `2`.\n\n" + _STDIN_INSTRUCTION,
        'text = input().lower()\nprint(sum(ch in "aeiou" for ch in text))\n',
        thought="Lower-case the line so capitals count too, then count the vowel characters.",
        # Forgets upper case vowels.
        wrong='print(sum(ch in "aeiou" for ch in input()))\n',
        inputs=["hello\n", "AEIOU\n", "rhythm\n", "\n", "Programming Is Fun\n"],
        outputs=["2\n", "5\n", "0\n", "0\n", "5\n"],
        difficulty=1,
    ),
    _task(
        "code-max-of-n",
        STDIN,
        "The first line holds an integer n (n >= 1). The second line holds n integers "
        "separated by spaces. Print the largest of them.\n\n"
        "Example: for the input lines `3` and `1 5 2` the output is `5`.\n\n" + _STDIN_INSTRUCTION,
        "n = int(input())\nnumbers = list(map(int, input().split()))\nprint(max(numbers[:n]))\n",
        thought="Read n, then the n numbers, and print the maximum.",
        # Starts the running maximum at 0, so an all-negative list prints 0.
        wrong=(
            "n = int(input())\nnumbers = list(map(int, input().split()))\nbest = 0\n"
            "for x in numbers[:n]:\n    if x > best:\n        best = x\nprint(best)\n"
        ),
        inputs=["3\n1 5 2\n", "1\n-7\n", "4\n-3 -1 -2 -9\n", "5\n0 0 0 0 0\n", "2\n100 99\n"],
        outputs=["5\n", "-7\n", "-1\n", "0\n", "100\n"],
        difficulty=1,
    ),
    _task(
        "code-average",
        STDIN,
        "The first line holds an integer n (n >= 0). The second line holds n integers "
        "separated by spaces (it is empty when n is 0). Print their average with exactly two "
        'digits after the decimal point, as Python\'s `f"{x:.2f}"` writes it. The average of '
        "no numbers is 0.\n\n"
        "Example: for the input lines `4` and `1 2 3 4` the output is `2.50`.\n\n" + _STDIN_INSTRUCTION,
        # Reads all tokens at once so an empty second line (n = 0) needs no special case.
        "import sys\n\ndata = sys.stdin.read().split()\nn = int(data[0])\n"
        "numbers = [int(x) for x in data[1:1 + n]]\n"
        "average = sum(numbers) / n if n else 0.0\n"
        'print(f"{average:.2f}")\n',
        thought="Sum the n numbers and divide by n, with 0 for an empty list; print two decimals.",
        # Integer division drops the fraction.
        wrong=(
            "import sys\n\ndata = sys.stdin.read().split()\nn = int(data[0])\n"
            "numbers = [int(x) for x in data[1:1 + n]]\n"
            'print(f"{sum(numbers) // max(n, 1):.2f}")\n'
        ),
        # 5/3 = 1.666... rounds to 1.67; no case sits on a .xx5 tie, so rounding is unambiguous.
        inputs=["4\n1 2 3 4\n", "3\n1 2 2\n", "2\n-1 -2\n", "2\n-1 1\n", "0\n\n"],
        outputs=["2.50\n", "1.67\n", "-1.50\n", "0.00\n", "0.00\n"],
        difficulty=2,
    ),
    # --- function tasks ---
    _task(
        "code-gcd",
        FUNCTION,
        "Given two integers a and b (either may be zero or negative), compute their greatest "
        "common divisor. The result is never negative, and gcd(0, 0) is 0.\n\n"
        "Example: gcd(12, 18) == 6.\n\n" + _function_instruction("gcd(a, b)", "the greatest common divisor of a and b"),
        "def gcd(a, b):\n    a, b = abs(a), abs(b)\n    while b:\n        a, b = b, a % b\n    return a\n",
        thought="Euclid's algorithm on the absolute values, so negative inputs give a non-negative result.",
        # Skips abs(): Python's % takes the divisor's sign, so gcd(12, -8) comes out -4.
        wrong="def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        fn_name="gcd",
        inputs=[[12, 18], [7, 0], [0, 0], [-12, 8], [12, -8], [17, 5]],
        outputs=[6, 7, 0, 4, 4, 1],
        difficulty=2,
    ),
    _task(
        "code-is-palindrome",
        FUNCTION,
        "A string is a palindrome if it reads the same forwards and backwards once case is "
        "ignored and every character that is not a letter or a digit is dropped. The empty "
        "string is a palindrome.\n\n"
        'Example: is_palindrome("A man, a plan, a canal: Panama") is True.\n\n'
        + _function_instruction("is_palindrome(s)", "True if s is a palindrome, else False"),
        "def is_palindrome(s):\n    kept = [ch.lower() for ch in s if ch.isalnum()]\n    return kept == kept[::-1]\n",
        thought="Keep only letters and digits, lower-cased, and compare with the reverse.",
        # Compares the raw string, so punctuation and case break it.
        wrong="def is_palindrome(s):\n    return s == s[::-1]\n",
        fn_name="is_palindrome",
        inputs=[["racecar"], ["A man, a plan, a canal: Panama"], ["hello"], [""], ["ab"], ["No 'x' in Nixon"]],
        outputs=[True, True, False, True, False, True],
        difficulty=2,
    ),
    _task(
        "code-fib",
        FUNCTION,
        "The Fibonacci numbers are fib(0) = 0, fib(1) = 1 and fib(n) = fib(n - 1) + "
        "fib(n - 2). n is at most 90, so a loop is fast enough.\n\n"
        "Example: fib(10) == 55.\n\n" + _function_instruction("fib(n)", "the n-th Fibonacci number"),
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        thought="Iterate n times keeping the last two numbers; start from 0 and 1.",
        # Off by one: one step too few.
        wrong="def fib(n):\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return a\n",
        fn_name="fib",
        inputs=[[0], [1], [2], [10], [30], [50]],
        outputs=[0, 1, 1, 55, 832040, 12586269025],
        difficulty=1,
    ),
    _task(
        "code-two-sum",
        FUNCTION,
        "Given a list of integers nums and an integer target, find the two different "
        "positions i < j with nums[i] + nums[j] == target. Exactly one such pair exists.\n\n"
        "Example: two_sum([2, 7, 11, 15], 9) == [0, 1].\n\n"
        + _function_instruction("two_sum(nums, target)", "the list [i, j] of the two indices"),
        "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n"
        "        if target - x in seen:\n            return [seen[target - x], j]\n"
        "        seen[x] = j\n    return []\n",
        thought="One pass with a dict from value to index: for each number, look up its "
        "complement among the earlier ones.",
        # Lets an element pair with itself: [3, 2, 4], 6 gives [0, 0].
        wrong="def two_sum(nums, target):\n    for i, x in enumerate(nums):\n"
        "        for j, y in enumerate(nums):\n            if x + y == target:\n"
        "                return [i, j]\n    return []\n",
        fn_name="two_sum",
        inputs=[[[2, 7, 11, 15], 9], [[3, 2, 4], 6], [[3, 3], 6], [[-1, -2, -3, -4, -5], -8], [[0, 4, 3, 0], 0]],
        outputs=[[0, 1], [1, 2], [0, 1], [2, 4], [0, 3]],
        difficulty=3,
    ),
    _task(
        "code-mean",
        FUNCTION,
        "Compute the arithmetic mean of a list of numbers as a float. The mean of an empty "
        "list is 0.0.\n\n"
        "Example: mean([1, 2, 3, 4]) == 2.5.\n\n"
        + _function_instruction("mean(xs)", "the mean of the numbers in xs as a float"),
        "def mean(xs):\n    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)\n",
        thought="Sum divided by length, with 0.0 for an empty list to avoid dividing by zero.",
        # Integer division drops the fraction.
        wrong="def mean(xs):\n    return sum(xs) // max(len(xs), 1)\n",
        fn_name="mean",
        inputs=[[[1, 2, 3, 4]], [[5]], [[]], [[-1, 1]], [[1, 2, 2]], [[0.5, 0.25]]],
        outputs=[2.5, 5.0, 0.0, 0.0, 1.6666666666666667, 0.375],
        difficulty=1,
    ),
)


def row_for(task: CodeTask) -> dict:
    """The task as a dataset row; test_cases is a JSON string inside the JSON string, as in
    the public dataset."""
    cases: dict = {}
    if task.fn_name is not None:
        cases["fn_name"] = task.fn_name
    cases["inputs"] = task.inputs
    cases["outputs"] = task.outputs
    return {
        "problem_id": task.problem_id,
        "task_type": TASK_TYPE,
        "prompt": task.statement,
        "verification_info": json.dumps({"test_cases": json.dumps(cases)}),
        "difficulty": task.difficulty,
    }


def _completion(task: CodeTask, program: str) -> str:
    what = "program" if task.kind == STDIN else "function"
    return f"<think>\n{_THOUGHTS[task.problem_id]}\n</think>\nHere is the {what}:\n```python\n{program}```\n"


def reference_completion(task: CodeTask) -> str:
    """A model-style answer whose code block is the reference solution."""
    return _completion(task, task.solution)


def wrong_completion(task: CodeTask) -> str:
    """The same shape as `reference_completion`, but with a plausible wrong program that
    fails at least one of the task's tests."""
    return _completion(task, _WRONG[task.problem_id])


def generate(*, completions: str | None = None) -> list[dict]:
    """All TASKS as rows in order. completions=None: rows only; "reference": each row also
    gets a "completion" field with reference_completion; "wrong": with wrong_completion."""
    if completions is not None and completions not in COMPLETIONS:
        raise ValueError(f"completions must be None, 'reference' or 'wrong', got {completions!r}")
    rows = []
    for task in TASKS:
        row = row_for(task)
        if completions == "reference":
            row["completion"] = reference_completion(task)
        elif completions == "wrong":
            row["completion"] = wrong_completion(task)
        rows.append(row)
    return rows
