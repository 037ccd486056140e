"""Worker-written text against the environments (issue 50): tool calls parsed in linear time,
numbers of any length read without raising, an environment's failure a refusal of that group (not
a crash of the submission), and the replay outside the store's lock, in the grading lane.

In process: the orchestrator's components with an inline grading pool (as in
test_orchestrator_components.py); the same paths over HTTP are exercised by
tests/integration/test_episodes.py."""

from __future__ import annotations

import re
import threading
import time

import pytest
from test_orchestrator_components import TOKENIZER, TRUSTED, make_orchestrator

from swarmrl.envs import registry
from swarmrl.envs.base import Environment, Reply
from swarmrl.envs.builtin import GUESS, MAX_DIGITS, _guess_respond, _guess_reward, calls, last_integer
from swarmrl.envs.episode import EpisodeRejected, respond_here, run_episodes
from swarmrl.protocol.messages import GroupIn

OLD_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)  # what the calculator used before


def test_calls_finds_what_the_lazy_pattern_found():
    pieces = ["<calc>", "</calc>", "1+2", "x", "\n", "<calc", "calc>", "</calc"]
    rng = __import__("random").Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert calls(text) == OLD_CALL.findall(text), text


def test_calls_on_many_unclosed_tags_is_linear():
    # 400k characters of unclosed tags: the lazy pattern needs minutes here (13 s at 32k tokens,
    # quadratic); two forward scans take milliseconds. The bound is loose on purpose.
    text = "<calc>1+" * 50_000
    started = time.perf_counter()
    assert calls(text) == []
    assert time.perf_counter() - started < 5.0


def test_numbers_of_any_length_are_read_without_raising():
    assert last_integer("say 12 then -7") == -7 and last_integer("none") is None
    huge = "9" * 4301  # int() refuses this many digits (sys.get_int_max_str_digits)
    assert last_integer(huge) == 10**MAX_DIGITS and last_integer("-" + huge) == -(10**MAX_DIGITS)
    task = {"low": 1, "high": 32}
    assert _guess_respond(task, [huge], 0) == Reply("lower", done=False)
    assert _guess_reward(task, [huge], 0) == (0.0, "not found within the turns")


def _boom(task: dict, turns: list[str], seed: int) -> Reply:
    raise ValueError("cannot read " + turns[-1][:10])


def test_an_environment_that_raises_ends_only_that_episode_on_the_worker():
    env = Environment(
        "boom-or-not",
        lambda task, turns, seed: _boom(task, turns, seed) if task["boom"] else Reply("", True),
        GUESS.reward,
    )
    episodes = run_episodes(
        env,
        [({"boom": True}, 0, [1]), ({"boom": False}, 0, [1])],
        lambda rows: [[5, 0] for _ in rows],
        lambda text: [7],
        lambda ids: "text",
        max_turns=3,
        max_tokens=20,
    )
    assert episodes[0].env_error and "ValueError" in episodes[0].env_error and not episodes[0].done
    assert episodes[1].env_error is None and episodes[1].done


def test_respond_here_stands_in_for_answers_it_cannot_have_and_stops_at_the_end():
    env = Environment("boom", _boom, GUESS.reward)
    (failed,) = respond_here(env, {}, 0)([["a"]])
    assert isinstance(failed, EpisodeRejected) and failed.reason == "environment_error" and "ValueError" in str(failed)
    task = {"low": 1, "high": 8}
    spent = respond_here(GUESS, task, 0, out_of_time=lambda: "spent")([["1"], ["1", "2"]])
    assert [r.reason for r in spent] == ["not_graded", "not_graded"]
    calls = []
    counting = Environment("count", lambda t, turns, s: calls.append(1) or Reply("", done=True), GUESS.reward)
    replies = respond_here(counting, task, 0)([["1"], ["1", "2"], ["1", "2", "3"]])
    assert len(calls) == 1 and all(r.done for r in replies)  # nothing asked after the episode ended


# --- through the orchestrator ----------------------------------------------------------------

SLOW_S = 0.4


def _slow_respond(task: dict, turns: list[str], seed: int) -> Reply:
    time.sleep(SLOW_S)
    return GUESS.respond(task, turns, seed)


@pytest.fixture
def guess_orch(tmp_path):
    o = make_orchestrator(tmp_path, "--tasks.source", "guess", "--sampling.max_new_tokens", "4400")
    o.publish(0, "http://x/v0", {"version": 0})
    o.admit_registration(TRUSTED, "127.0.0.1")
    o.authenticate(TRUSTED, "nonce-t", time.time(), registering=True)
    o.register(TRUSTED, "o")
    yield o
    o.close()
    registry.register(GUESS)  # the tests below replace it


def _boom_on_turn_2(task: dict, turns: list[str], seed: int) -> Reply:
    if len(turns) > 1:
        raise ValueError("cannot read turn 2")
    return GUESS.respond(task, turns, seed)


def test_a_failure_on_a_later_turn_does_not_hide_an_edited_observation(guess_orch):
    # Turn 1 guesses 0 (below any hidden number: "higher"), the observation after it is forged,
    # and the environment fails on turn 2: the forgery is what the key is refused for (fraud).
    registry.register(Environment("guess", _boom_on_turn_2, GUESS.reward, check=GUESS.check, max_turns=GUESS.max_turns))
    lease = guess_orch.lease(TRUSTED, 0, protocol_version=3)["lease"]
    eos = TOKENIZER.eos_token_id
    ids = lambda text: TOKENIZER(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1, forged, turn2 = ids("0") + [eos], ids("lower"), ids("BOOM") + [eos]
    tokens = turn1 + forged + turn2
    mask = [True] * len(turn1) + [False] * len(forged) + [True] * len(turn2)
    logprobs = [-0.5 if m else 0.0 for m in mask]
    sample = {"token_ids": tokens, "logprobs": logprobs, "finish_reason": "stop", "model_mask": mask}
    groups = [
        GroupIn(slot=p["slot"], policy_version=0, engine="openai", samples=[sample, sample]) for p in lease["prompts"]
    ]
    reply = guess_orch.submit(TRUSTED, lease["lease_id"], groups)
    assert {r["reason"] for r in reply["rejected"]} == {"observation_mismatch"}, reply
    assert guess_orch.worker_record(TRUSTED)["fraud"] >= 1


def _one_turn_groups(lease: dict, text: str) -> list[GroupIn]:
    """Each slot's episodes: one model turn of `text` that uses the whole budget (no stop token)."""
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    sample = {
        "token_ids": ids,
        "logprobs": [-0.5] * len(ids),
        "finish_reason": "length",
        "model_mask": [True] * len(ids),
    }
    return [
        GroupIn(slot=p["slot"], policy_version=0, engine="openai", samples=[sample, sample]) for p in lease["prompts"]
    ]


def test_a_turn_of_4301_digits_is_judged_not_crashed(guess_orch):
    lease = guess_orch.lease(TRUSTED, 0, protocol_version=3)["lease"]
    reply = guess_orch.submit(TRUSTED, lease["lease_id"], _one_turn_groups(lease, "9" * 4400))
    assert not reply["rejected"] and len(reply["accepted"]) == len(lease["prompts"]), reply
    assert all(a["rewards"] == [0.0, 0.0] for a in reply["accepted"])


def test_an_environment_failure_refuses_the_group_counts_for_the_key_and_frees_the_problem(guess_orch):
    registry.register(Environment("guess", _boom, GUESS.reward, check=GUESS.check, max_turns=GUESS.max_turns))
    lease = guess_orch.lease(TRUSTED, 0, protocol_version=3)["lease"]
    reply = guess_orch.submit(TRUSTED, lease["lease_id"], _one_turn_groups(lease, "7" * 4400))
    assert not reply["accepted"] and {r["reason"] for r in reply["rejected"]} == {"environment_error"}, reply
    assert "ValueError" in reply["rejected"][0]["detail"]
    record = guess_orch.worker_record(TRUSTED)
    assert record["rejections"].get("environment_error") == len(lease["prompts"]) and record["fraud"] == 0
    again = guess_orch.submit(TRUSTED, lease["lease_id"], _one_turn_groups(lease, "7" * 4400))
    assert {r["reason"] for r in again["rejected"]} == {"slot_closed"}, again  # refused slots are closed


def test_the_replay_runs_outside_the_stores_lock(guess_orch):
    registry.register(Environment("guess", _slow_respond, GUESS.reward, check=GUESS.check, max_turns=GUESS.max_turns))
    lease = guess_orch.lease(TRUSTED, 0, protocol_version=3)["lease"]
    groups = _one_turn_groups(lease, "5" * 4400)
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(guess_orch.submit(TRUSTED, lease["lease_id"], groups)))
    thread.start()
    time.sleep(SLOW_S / 2)  # the submission is in its replay now (each episode's turn takes SLOW_S)
    guess_orch.store.query("SELECT 1")  # the lock every other request needs
    replaying = thread.is_alive()
    thread.join()
    assert replaying, "the store's lock was held until the replay had finished"
    assert len(done["accepted"]) == len(lease["prompts"]), done
