"""The shipped environments.

calculator  a tool the model may call inside its answer: a turn holding `<calc>EXPR</calc>` (integer
            + - * and parentheses) is answered with `<result>VALUE</result>`, or with
            `<result>error: ...</result>` for an expression the tool cannot evaluate (a tool error,
            not a wrong answer); a turn with no call is the final answer, graded on its last
            number. Task: {"expression": "37 * 48 - 19", "answer": "1757"}.
guess       find a hidden integer in [low, high]: each turn's last number is answered "higher",
            "lower", or ends the episode when it is right. The number is a function of the task
            and the episode's seed, so the episodes of one group (one seed) play the same game
            and the trusted side can replay them. Reward 1 when found on the first turn, less
            `turn_cost` for each turn after it (never below 0), 0 when not found. Task:
            {"low": 1, "high": 32} or {"low": 1, "high": 32, "turn_cost": 0.1}.
"""

from __future__ import annotations

import ast
import hashlib
import re

from swarmrl.envs.base import Environment, Reply

_INTEGER = re.compile(r"-?\d+")  # one pass, no backtracking: a digit run is matched once
MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**12  # larger operands or results are a tool error: no 10**10**10 by multiplication
MAX_DIGITS = 40
"""A number written with more digits than this is read as +-10**MAX_DIGITS: no task's answer is that
long, and `int()` of worker-written text must not be asked for 4,301 digits (Python refuses, and the
conversion is quadratic below that limit)."""


def calls(text: str) -> list[str]:
    """The expressions of the complete `<calc>EXPR</calc>` calls in `text`, in order (an opening tag
    runs to the first closing tag after it). Two `str.find` scans that only move forward: linear in
    the text, however many unclosed tags a worker writes (a lazy regular expression restarts its
    search at each one: quadratic, 13 s for a 32k-token turn)."""
    out, at = [], 0
    while True:
        start = text.find("<calc>", at)
        if start < 0:
            return out
        end = text.find("</calc>", start + 6)
        if end < 0:
            return out  # no closing tag after this one: none after any later opening tag either
        out.append(text[start + 6 : end])
        at = end + 7


def last_integer(text: str) -> int | None:
    """The last integer written in `text`, None when there is none; one longer than MAX_DIGITS is
    read as +-10**MAX_DIGITS (larger than any answer, so a guess gets "lower", a final answer is wrong)."""
    found = _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].lstrip("-")
    value = int(digits) if len(digits) <= MAX_DIGITS else 10**MAX_DIGITS
    return -value if found[-1].startswith("-") else value


def evaluate(expression: str) -> int:
    """The integer value of `expression` (+ - * and parentheses over integers); ValueError naming
    what the calculator does not accept. Walks the syntax tree itself: never `eval`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            out = -value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in ops:
            out = ops[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError("only integers, + - * and parentheses")
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError(f"a value beyond {MAX_MAGNITUDE:.0e}")
        return out

    return value(tree)


def _check_calculator(task: dict) -> str | None:
    try:
        want = evaluate(str(task["expression"]))
        if int(str(task["answer"])) != want:
            return f"answer {task['answer']!r} is not the value of {task['expression']!r} ({want})"
    except KeyError as e:
        return f"a calculator task needs 'expression' and 'answer' (missing {e})"
    except ValueError as e:
        return f"calculator task: {e}"
    return None


def _calculator_respond(task: dict, turns: list[str], seed: int) -> Reply:
    found = calls(turns[-1])
    if not found:
        return Reply("", done=True)
    try:
        return Reply(f"<result>{evaluate(found[-1])}</result>", done=False)
    except ValueError as e:
        return Reply(f"<result>error: {e}</result>", done=False, tool_error=True)


def _calculator_reward(task: dict, turns: list[str], seed: int) -> tuple[float, str | None]:
    final = turns[-1]
    if calls(final):
        return 0.0, "the episode ended on a tool call, before a final answer"
    number = last_integer(final)
    if number is None:
        return 0.0, "no number in the final answer"
    return (1.0, None) if number == int(str(task["answer"])) else (0.0, "wrong answer")


CALCULATOR = Environment(
    "calculator",
    _calculator_respond,
    _calculator_reward,
    check=_check_calculator,
    max_turns=4,
    visible=lambda task: {"expression": task["expression"]},  # not the answer
)


def secret(task: dict, seed: int) -> int:
    """The hidden number of a guess task under `seed`: a hash, never global random state."""
    low, high = int(task["low"]), int(task["high"])
    digest = hashlib.sha256(f"guess:{low}:{high}:{seed}".encode()).digest()
    return low + int.from_bytes(digest[:8], "big") % (high - low + 1)


def _check_guess(task: dict) -> str | None:
    try:
        low, high = int(task["low"]), int(task["high"])
    except (KeyError, TypeError, ValueError):
        return "a guess task needs integer 'low' and 'high'"
    if low >= high:
        return f"a guess task needs low < high (got {low}, {high})"
    cost = task.get("turn_cost", 0.0)
    if not isinstance(cost, int | float) or isinstance(cost, bool) or not 0.0 <= cost < 1.0:
        return f"a guess task's turn_cost must be a number in [0, 1) (got {cost!r})"
    return None


def _guess_respond(task: dict, turns: list[str], seed: int) -> Reply:
    n = last_integer(turns[-1])
    if n is None:
        return Reply(f"Say a number from {task['low']} to {task['high']}.", done=False)
    hidden = secret(task, seed)
    if n == hidden:
        return Reply("", done=True)
    return Reply("higher" if n < hidden else "lower", done=False)


def _guess_reward(task: dict, turns: list[str], seed: int) -> tuple[float, str | None]:
    found = last_integer(turns[-1]) == secret(task, seed)
    if not found:
        return 0.0, "not found within the turns"
    # Found on turn t: 1 - cost * (t - 1). Without a cost a number found on the last turn pays as
    # much as one found on the first, and nothing asks the policy for fewer turns.
    return max(0.0, 1.0 - float(task.get("turn_cost", 0.0)) * (len(turns) - 1)), None


GUESS = Environment("guess", _guess_respond, _guess_reward, check=_check_guess, max_turns=6)

BUILTIN = (CALCULATOR, GUESS)
