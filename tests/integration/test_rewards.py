"""Tests for swarmrl.rewards: answer extraction, math grading, length shaping, the pool, scoring.

Pool tests call builtins (time.sleep, operator.truediv, os._exit) so spawned
workers can unpickle them without importing this test module.
"""

from __future__ import annotations

import json
import operator
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmrl.rewards.length import LENGTH_SUFFIX, length_reward, with_length_target
from swarmrl.rewards.math import extract_answer, math_task_reward, verify_math
from swarmrl.rewards.pool import Outcome, VerifierPool
from swarmrl.rewards.scoring import CODE_NEEDS_SANDBOX, Score, score_file, score_rows

# -- extract_answer ------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>hmm</think> so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("<think>maybe \\boxed{3}</think> no box here", None),
        ("<think>maybe \\boxed{3}</think> final \\boxed{4}", "4"),
        ("<think>still thinking \\boxed{5}", None),
        ("the answer is \\boxed{42}", "42"),
        ("no answer at all", None),
        ("\\boxed{\\sqrt{\\frac{a}{b^{2}}}}", "\\sqrt{\\frac{a}{b^{2}}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\boxed{7}}", "\\boxed{7}"),
        ("\\boxed{8} and an unclosed \\boxed{9", "8"),
        ("\\boxed{  }", None),
        ("\\boxed { 10 }", "10"),
        # A template that puts <think> in the prompt: the completion only closes it.
        ("reasoning...</think>\\boxed{11}", "11"),
        ("<think>a</think><think>b</think>\\boxed{12}", "12"),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


# -- verify_math / math_task_reward --------------------------------------------


@pytest.mark.parametrize(
    ("ground_truth", "answer", "expected"),
    [
        ("92", "92", 1.0),
        ("1/2", "\\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("92", "93", 0.0),
        ("x^2+1", "1+x^2", 1.0),
        ("92", "\\text{banana}", 0.0),
    ],
)
def test_verify_math(ground_truth, answer, expected):
    assert verify_math(ground_truth, answer) == expected


def test_math_task_reward_reasons():
    assert math_task_reward({"ground_truth": "92"}, "<think>x</think>\\boxed{92}") == (1.0, None)
    assert math_task_reward({"ground_truth": 92}, "\\boxed{92}") == (1.0, None)
    assert math_task_reward({"ground_truth": 0.5}, "\\boxed{\\frac{1}{2}}") == (1.0, None)
    assert math_task_reward({"ground_truth": 1e-07}, "\\boxed{0.0000001}") == (1.0, None)
    reward, reason = math_task_reward({"ground_truth": "92"}, "<think>\\boxed{92}")
    assert reward == 0.0 and "never closes" in reason
    reward, reason = math_task_reward({"ground_truth": "92"}, "<think>x</think> 92")
    assert reward == 0.0 and reason == "no \\boxed{} answer after </think>"
    reward, reason = math_task_reward({"ground_truth": "92"}, "\\boxed{91}")
    assert reward == 0.0 and "does not match" in reason


@pytest.mark.parametrize("info", [{}, {"ground_truth": None}, {"ground_truth": True}, {"ground_truth": "  "}])
def test_math_task_reward_rejects_bad_ground_truth(info):
    with pytest.raises(ValueError, match="ground_truth"):
        math_task_reward(info, "\\boxed{1}")


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9^{9}}}",
        "9^{9^9}",
        "\\frac{10^{10^{8}}}{3}",
        "99999999999^{99999999999}",
        "1000000!",
        "(10^{10})^{10^{7}}",
        "10^{-10^{9}}",
        "(x+1)^{1000000}",
        "1" * 1200,
    ],
)
def test_absurd_answers_score_0_without_being_evaluated(answer):
    started = time.monotonic()
    reward, reason = math_task_reward({"ground_truth": "92"}, "\\boxed{" + answer + "}")
    assert reward == 0.0 and "graded" in reason, reason
    assert time.monotonic() - started < 1.0  # each of these costs sympy seconds to hours


@pytest.mark.parametrize(
    ("ground_truth", "answer"),
    [
        ("2^{100}", "1267650600228229401496703205376"),
        ("e^{-x^2}", "e^{-x^{2}}"),
        ("120", "5!"),
        ("x^{100}", "x^{100}"),
        ("10^{100000}", "10^{100000}"),
        ("2^{1000000}", "2^{1000000}"),
    ],
)
def test_big_answers_are_graded_when_the_ground_truth_is_as_big(ground_truth, answer):
    assert math_task_reward({"ground_truth": ground_truth}, "\\boxed{" + answer + "}") == (1.0, None)


# -- length control ------------------------------------------------------------


def test_with_length_target():
    assert with_length_target("Solve x.", 1000) == "Solve x. Think for 1000 tokens before giving a response."
    assert LENGTH_SUFFIX.format(N=5) == " Think for 5 tokens before giving a response."
    with pytest.raises(ValueError, match="target"):
        with_length_target("Solve x.", 0)


@pytest.mark.parametrize(
    ("task_reward", "length", "target", "mode", "coef", "expected"),
    [
        # exact: 1 - 0.001 * |1200 - 1000| = 0.8, in either direction.
        (1.0, 1200, 1000, "exact", 0.001, 0.8),
        (1.0, 800, 1000, "exact", 0.001, 0.8),
        (0.0, 1500, 1000, "exact", 0.001, -0.5),
        # max: 1 * clip(0.001 * (1000 - 800) + 0.5, 0, 1) = 0.7
        (1.0, 800, 1000, "max", 0.001, 0.7),
        (1.0, 1000, 1000, "max", 0.001, 0.5),
        (1.0, 1300, 1000, "max", 0.001, 0.2),
        (1.0, 2000, 1000, "max", 0.001, 0.0),  # clip at 0
        (1.0, 100, 1000, "max", 0.001, 1.0),  # clip at 1
        (0.0, 800, 1000, "max", 0.001, 0.0),
        # clip: keep the task reward up to the target, inclusive.
        (1.0, 1000, 1000, "clip", 0.001, 1.0),
        (1.0, 1001, 1000, "clip", 0.001, 0.0),
    ],
)
def test_length_reward(task_reward, length, target, mode, coef, expected):
    assert length_reward(task_reward, length, target, mode, coef) == pytest.approx(expected)


def test_length_reward_unknown_mode_names_the_allowed_ones():
    with pytest.raises(ValueError, match="exact, max, clip"):
        length_reward(1.0, 10, 10, "linear", 0.001)


# -- VerifierPool --------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    try:
        import torch  # noqa: F401 - the pool must work with torch loaded in the parent
    except ImportError:
        pass
    with VerifierPool(num_workers=2, timeout_s=1.0) as verifier_pool:
        yield verifier_pool


def test_pool_timeout_kills_only_the_slow_call(pool):
    started = time.monotonic()
    slow, fast = pool.map(time.sleep, [(30,), (0.01,)])
    elapsed = time.monotonic() - started
    # Killed at its timeout; map returns once its replacement has started (spawn: a few seconds).
    assert slow.seconds < pool.timeout_s + 1.0 and elapsed < 20
    assert all(w.state == "idle" for w in pool._workers)
    assert slow.value is None and slow.error == "timed out after 1 s"
    assert fast == Outcome(value=None, error=None, seconds=fast.seconds) and fast.ok
    # The killed worker was replaced: the pool still serves calls.
    assert [o.value for o in pool.map(operator.truediv, [(1, 4), (3, 4), (1, 2)])] == [0.25, 0.75, 0.5]


def test_pool_exception_becomes_an_error(pool):
    bad, good = pool.map(operator.truediv, [(1, 0), (1, 2)])
    assert bad.value is None and bad.error == "ZeroDivisionError: division by zero"
    assert good.value == 0.5 and good.error is None


def test_pool_survives_a_dying_worker(pool):
    (died,) = pool.map(os._exit, [(3,)])
    assert "exit code 3" in died.error
    assert pool.map(operator.truediv, [(1, 2)])[0].value == 0.5


def test_pool_rejects_unpicklable_function_per_call(pool):
    (outcome,) = pool.map(lambda x: x, [(1,)])
    assert outcome.error.startswith("the call could not be sent to a worker")


def test_pool_runs_math_task_reward(pool):
    calls = [({"ground_truth": "1/2"}, "\\boxed{\\frac{1}{2}}"), ({}, "\\boxed{1}")]
    right, malformed = pool.map(math_task_reward, calls)
    assert right.value == (1.0, None)
    assert malformed.error.startswith("ValueError: verification_info has no 'ground_truth'")


def test_pool_argument_checks():
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        VerifierPool(memory_bytes=1 << 20)


# An answer sympy would spend minutes and gigabytes on: 9^(9^(9^9)).
TOWER = "<think>big</think> \\boxed{9^{9^{9^{9}}}}"


def test_a_worst_case_answer_scores_0_within_the_timeout_and_the_pool_goes_on(pool):
    rows = [
        _math_row("tower", TOWER),
        _math_row("right", "\\boxed{92}"),
        _math_row("fraction", "\\boxed{\\frac{99999999999^{99999999999}}{7}}"),
    ]
    started = time.monotonic()
    tower, right, fraction = score_rows(rows, pool=pool, count_tokens=_count_words)
    assert time.monotonic() - started < 2 * pool.timeout_s + 1.5  # two workers: at most two timeouts in a row
    # Refused before sympy sees them (MAX_ANSWER_DIGITS); without that check the timeout ends them.
    for score in (tower, fraction):
        assert score.reward == 0.0 and (score.error == "timed out after 1 s" or "not evaluated" in score.reason)
    assert right == Score(1.0, 0.0, 1.0, None)
    assert [o.value for o in pool.map(operator.truediv, [(1, 4), (3, 4)])] == [0.25, 0.75]


def test_a_call_over_the_memory_limit_is_an_error_and_its_worker_replaced(pool):
    assert pool.memory_bytes == 1 << 30  # the default
    pids = {w.process.pid for w in pool._workers}
    hog, small = pool.map(bytearray, [(2 << 30,), (3,)])
    assert hog.seconds < pool.timeout_s  # refused at the allocation, not at the timeout
    assert hog.value is None and "out of memory" in hog.error and "1024 MiB" in hog.error
    assert small.value == bytearray(3)
    assert pids != {w.process.pid for w in pool._workers}  # the worker that hit the limit was replaced
    assert pool.map(operator.truediv, [(1, 2)])[0].value == 0.5


def test_a_forkserver_pool_replaces_a_timed_out_worker_at_once_under_the_same_limits():
    """The orchestrator's grading lanes fork their processes from a server that imported the
    grader: an answer that ran out of its budget costs the budget, not a re-import of sympy."""
    with VerifierPool(1, timeout_s=0.5, start_method="forkserver") as fork_pool:
        started = time.monotonic()
        (slow,) = fork_pool.map(time.sleep, [(30,)])
        restart = time.monotonic() - started - slow.seconds  # map returns once the replacement is up
        assert slow.error == "timed out after 0.5 s" and restart < 1.0  # spawn: 1-3 s here
        assert fork_pool.map(math_task_reward, [({"ground_truth": "7"}, "\\boxed{7}")])[0].value == (1.0, None)
        (hog,) = fork_pool.map(bytearray, [(2 << 30,)])
        assert "out of memory" in hog.error


def test_a_worker_orphaned_mid_call_is_stopped_by_its_cpu_limit(tmp_path):
    """Nobody is left to kill a worker whose parent died while it graded; RLIMIT_CPU does."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, threading\n"
        "from swarmrl.rewards.pool import VerifierPool\n"
        "if __name__ == '__main__':\n"
        "    pool = VerifierPool(1, timeout_s=1.0, preload=())\n"
        "    print(pool._workers[0].process.pid, flush=True)\n"
        "    threading.Timer(0.3, os._exit, (0,)).start()  # die in the middle of the call\n"
        "    pool.map(pow, [(9, 9 ** 9)])\n"
    )
    out = tmp_path / "worker.pid"
    with out.open("w") as stdout:  # not a pipe: the orphan holds its end open
        subprocess.run([sys.executable, str(script)], stdout=stdout, timeout=60, check=False)
    worker = int(out.read_text().split()[0])
    started = time.monotonic()
    try:
        while _running(worker) and time.monotonic() - started < 15:
            time.sleep(0.1)
        assert not _running(worker), "the orphaned worker was still computing after 15 s"
    finally:
        if _running(worker):
            os.kill(worker, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# -- scoring -------------------------------------------------------------------


def _math_row(problem_id, completion, ground_truth="92", **extra):
    return {
        "problem_id": problem_id,
        "task_type": "verifiable_math",
        "prompt": "What is 90 + 2?",
        "verification_info": json.dumps({"ground_truth": ground_truth}),
        "completion": completion,
        **extra,
    }


def _count_words(text):
    return len(text.split())


def test_score_rows_mixes_good_and_malformed_rows(pool):
    rows = [
        _math_row("right", "<think>90+2</think> \\boxed{92}"),
        _math_row("wrong", "<think>90+2</think> \\boxed{93}"),
        {**_math_row("bad-json", "\\boxed{92}"), "verification_info": "{not json"},
        {k: v for k, v in _math_row("no-completion", "").items() if k != "completion"},
        {**_math_row("unknown-task", "\\boxed{92}"), "task_type": "poetry"},
        {**_math_row("code-no-tests", "print(1)"), "task_type": "prime_rl_code"},
        {
            **_math_row("code", "```python\nprint(1)\n```"),
            "task_type": "prime_rl_code",
            "verification_info": json.dumps({"test_cases": json.dumps({"inputs": [""], "outputs": ["1"]})}),
        },
        _math_row("no-ground-truth", "\\boxed{92}", ground_truth=None),
        _math_row("bad-target", "\\boxed{92}", target_length="many"),
        # 0.001 * (1000 - 800) + 0.5 = 0.7 of the reward kept.
        _math_row("budget", "\\boxed{92}", target_length=1000, completion_length=800),
        # Length counted by count_tokens: 2 words, target 2 -> half kept.
        _math_row("counted", "answer \\boxed{92}", target_length=2),
    ]
    scores = score_rows(rows, pool=pool, count_tokens=_count_words)
    by_id = dict(zip([row.get("problem_id") for row in rows], scores))

    assert by_id["right"] == Score(1.0, 0.0, 1.0, None)
    assert by_id["wrong"].reward == 0.0 and by_id["wrong"].error is None
    assert "does not match" in by_id["wrong"].reason
    assert "'verification_info' is not valid JSON" in by_id["bad-json"].error
    assert by_id["no-completion"].error == "missing field 'completion'"
    assert "'task_type' has unknown value 'poetry'" in by_id["unknown-task"].error
    assert "needs a 'test_cases' key" in by_id["code-no-tests"].error
    assert by_id["code"].error == CODE_NEEDS_SANDBOX  # no sandbox was given to score_rows
    assert "ground_truth" in by_id["no-ground-truth"].error
    assert "'target_length' must be a positive integer" in by_id["bad-target"].error
    assert by_id["budget"].reward == pytest.approx(0.7)
    assert by_id["budget"].length_penalty == pytest.approx(0.3)
    assert by_id["counted"].reward == pytest.approx(0.5)
    for score in scores:
        if score.error is not None:
            assert (score.task_reward, score.length_penalty, score.reward) == (0.0, 0.0, 0.0)


def test_score_rows_rejects_unknown_length_mode(pool):
    with pytest.raises(ValueError, match="length_mode"):
        score_rows([], pool=pool, count_tokens=_count_words, length_mode="linear")


def test_score_file_round_trip(pool, tmp_path):
    input_path = tmp_path / "rows.jsonl"
    output_path = tmp_path / "out" / "scored.jsonl"
    lines = [
        json.dumps(_math_row("right", "\\boxed{92}", extra_field="kept")),
        "{this is not json",
        "",
        json.dumps(_math_row("wrong", "\\boxed{1}")),
        "[1, 2]",
    ]
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    counts = score_file(input_path, output_path, pool=pool, count_tokens=_count_words)

    assert {k: counts[k] for k in ("rows", "scored", "errors", "mean_reward")} == {
        "rows": 4,
        "scored": 2,
        "errors": 2,
        "mean_reward": 0.5,
    }
    assert counts["mean_reward_all_rows"] == 0.25 and [e["line"] for e in counts["first_errors"]] == [2, 5]
    out = [json.loads(line) for line in output_path.read_text(encoding="utf-8").splitlines()]
    assert [row.get("problem_id") for row in out] == ["right", None, "wrong", None]
    assert out[0]["extra_field"] == "kept" and out[0]["reward"] == 1.0 and out[0]["error"] is None
    assert out[0]["prompt"] == "What is 90 + 2?"
    assert out[1]["line"] == 2 and "line 2 is not valid JSON" in out[1]["error"] and out[1]["reward"] == 0.0
    assert out[2]["reward"] == 0.0 and out[2]["error"] is None
    assert out[3]["line"] == 5 and "must hold a JSON object" in out[3]["error"]
    for row in out:
        assert {"task_reward", "length_penalty", "reward", "error"} <= row.keys()
