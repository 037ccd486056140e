"""Multi-turn environments (issue 31, first stage): the shipped environments' answers, episodes as
one token sequence with a mask of the model's tokens, the trusted side's replay refusing edited,
forged, truncated and self-sampled observations, and the loss over model tokens only."""

import pytest
import torch

from swarmrl.algorithm.loss import LossInputs, grpo_loss
from swarmrl.envs import registry
from swarmrl.envs.base import Environment, Reply
from swarmrl.envs.builtin import CALCULATOR, GUESS, evaluate, secret
from swarmrl.envs.episode import Episode, EpisodeRejected, episode_metrics, replay, run_episode, runs

STOP = 0  # the toy tokenizer: one id per character, 0 ends a model turn


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != STOP)


def scripted(*turns: str):
    """A sampler that says `turns` in order, each ended by the stop id, cut at the budget."""
    queue = list(turns)

    def sample(context: list[int], budget: int) -> list[int]:
        return (encode(queue.pop(0)) + [STOP])[:budget]

    return sample


def play(env, task, seed, *turns, max_turns=4, max_tokens=200) -> Episode:
    return run_episode(
        env, task, seed, encode("Q:"), scripted(*turns), encode, decode, max_turns=max_turns, max_tokens=max_tokens
    )


def check(env, task, seed, ep, max_turns=4, max_tokens=200):
    return replay(env, task, seed, ep, encode, decode, stop_ids={STOP}, max_turns=max_turns, max_tokens=max_tokens)


CALC_TASK = {"expression": "37 * 48 - 19", "answer": "1757"}


# ---- the shipped environments ---------------------------------------------------------------------
def test_calculator_evaluates_integer_arithmetic_and_refuses_everything_else():
    assert evaluate("37 * 48 - 19") == 1757
    assert evaluate("-(2 + 3) * 4") == -20
    for bad, why in [
        ("2 ** 10", "only integers"),
        ("__import__('os')", "only integers"),
        ("7 / 2", "only integers"),
        ("1.5 + 1", "only integers"),
        ("99999999 * 99999999", "beyond"),
        ("1 +", "not an arithmetic"),
        ("1+" * 40 + "1", "longer than"),
    ]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)


def test_calculator_answers_a_call_reports_a_tool_error_and_grades_the_final_answer():
    r = CALCULATOR.respond(CALC_TASK, ["I need <calc>37*48</calc>"], 0)
    assert r == Reply("<result>1776</result>", done=False)
    err = CALCULATOR.respond(CALC_TASK, ["<calc>37 ^ 48</calc>"], 0)
    assert err.tool_error and not err.done and err.observation.startswith("<result>error:")
    assert CALCULATOR.respond(CALC_TASK, ["so 1776 - 19 = 1757"], 0).done
    assert CALCULATOR.reward(CALC_TASK, ["<calc>37*48</calc>", "1776 - 19 = 1757"], 0) == (1.0, None)
    assert CALCULATOR.reward(CALC_TASK, ["1776 - 19 = 1758"], 0) == (0.0, "wrong answer")
    assert CALCULATOR.reward(CALC_TASK, ["<calc>1</calc>"], 0)[0] == 0.0  # cut off on a call
    assert CALCULATOR.check(CALC_TASK) is None
    assert "not the value" in CALCULATOR.check({"expression": "2 + 2", "answer": "5"})


def test_guess_hides_a_number_per_seed_and_answers_higher_or_lower():
    task = {"low": 1, "high": 32}
    hidden = [secret(task, s) for s in range(50)]
    assert all(1 <= h <= 32 for h in hidden) and len(set(hidden)) > 10  # spread over the range
    assert secret(task, 7) == secret(task, 7)  # a function of (task, seed) only
    h = secret(task, 7)
    assert GUESS.respond(task, [f"{h - 1}"], 7).observation == "higher"  # h - 1 may be 0: still below
    assert GUESS.respond(task, [f"I say {h + 1}"], 7).observation == "lower"
    assert GUESS.respond(task, [f"{h}"], 7).done
    assert GUESS.respond(task, ["no idea"], 7).observation == "Say a number from 1 to 32."
    assert GUESS.reward(task, ["3", f"{h}"], 7) == (1.0, None)
    assert GUESS.check({"low": 5, "high": 5}) is not None


def test_a_guess_turn_cost_pays_less_for_each_later_turn_and_nothing_for_a_miss():
    task = {"low": 1, "high": 16, "turn_cost": 0.1}
    h = secret(task, 3)
    miss = "17"  # outside the range: never the number
    assert GUESS.reward(task, [f"{h}"], 3) == (1.0, None)  # turn 1: 1 - 0.1 * 0
    assert GUESS.reward(task, [miss, f"{h}"], 3) == (pytest.approx(0.9), None)
    assert GUESS.reward(task, [miss, miss, miss, f"{h}"], 3) == (pytest.approx(0.7), None)
    assert GUESS.reward(task, [miss, miss], 3) == (0.0, "not found within the turns")
    assert GUESS.reward({**task, "turn_cost": 0.6}, [miss, miss, f"{h}"], 3) == (0.0, None)  # floored at 0
    assert GUESS.check(task) is None
    for bad in (-0.1, 1.0, "0.1", True):
        assert "turn_cost" in GUESS.check({**task, "turn_cost": bad})


def test_solved_within_k_turns_is_cumulative_over_all_episodes():
    from swarmrl.eval.episodes import solved_metrics

    # 5 episodes, 3 solved on turns 1, 3 and 3; up to 4 turns.
    m = solved_metrics([1, 3, 3], 5, 4)
    assert m["eval/episode/solved"] == pytest.approx(0.6)
    assert [m[f"eval/episode/solved_by_turn_{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0.2, 0.2, 0.6, 0.6])
    assert m["eval/episode/turns_when_solved"] == pytest.approx(7 / 3)
    assert "eval/episode/turns_when_solved" not in solved_metrics([], 5, 2)


def test_registry_finds_the_shipped_environments_and_takes_a_new_one():
    assert {"calculator", "guess"} <= set(registry.names())
    echo = Environment(
        "echo-test", lambda t, turns, s: Reply("ok", done=len(turns) >= 2), lambda t, turns, s: (1.0, None)
    )
    try:
        registered = registry.register(echo)
        assert registry.get("echo-test") is registered is echo
    finally:
        registry._ENVS.pop("echo-test", None)  # the registry is process-wide: leave it as found
    with pytest.raises(ValueError, match="known: .*calculator"):
        registry.get("nope")


# ---- episodes -------------------------------------------------------------------------------------
def test_runs_split_a_mask_into_turns_and_observations():
    assert runs([True, True, False, True]) == [(0, 2, True), (2, 3, False), (3, 4, True)]
    assert runs([]) == []


def test_an_episode_keeps_the_ids_as_produced_and_masks_the_observations():
    ep = play(CALCULATOR, CALC_TASK, 0, "<calc>37*48</calc>", "1776-19=1757")
    first = encode("<calc>37*48</calc>") + [STOP]
    obs = encode("<result>1776</result>")
    assert ep.tokens == first + obs + encode("1776-19=1757") + [STOP]
    assert ep.model_mask == [True] * len(first) + [False] * len(obs) + [True] * 13
    assert (ep.turns, ep.done, ep.tool_errors, ep.observation_tokens) == (2, True, 0, len(obs))
    assert check(CALCULATOR, CALC_TASK, 0, ep).done  # the honest episode replays


def test_the_budget_ends_an_episode_and_an_observation_is_never_cut():
    # 4 turns allowed, the model keeps calling: the 4th turn is the last, unanswered.
    ep = play(CALCULATOR, CALC_TASK, 0, *["<calc>1</calc>"] * 4)
    assert (ep.turns, ep.done) == (4, False) and ep.model_mask[-1]
    assert check(CALCULATOR, CALC_TASK, 0, ep).turns == ["<calc>1</calc>"] * 4
    # 30 tokens: turn 1 (19) and its observation (21) would leave no room: it is not appended.
    ep = play(CALCULATOR, CALC_TASK, 0, "<calc>37*48</calc>", max_tokens=30)
    assert ep.tokens == encode("<calc>37*48</calc>") + [STOP] and not ep.done
    assert check(CALCULATOR, CALC_TASK, 0, ep, max_tokens=30).turns == ["<calc>37*48</calc>"]
    # 10 tokens: the turn itself is cut; the environment reads what was said (no whole call: an answer).
    ep = play(CALCULATOR, CALC_TASK, 0, "<calc>37*48</calc>", max_tokens=10)
    assert ep.tokens == encode("<calc>37*48</calc>")[:10] and ep.done
    assert check(CALCULATOR, CALC_TASK, 0, ep, max_tokens=10).done
    with pytest.raises(EpisodeRejected, match="over_budget"):
        check(CALCULATOR, CALC_TASK, 0, ep, max_tokens=9)


def test_replay_refuses_each_multi_turn_cheat_with_its_reason():
    honest = play(CALCULATOR, CALC_TASK, 0, "<calc>37*48</calc>", "1776-19=1757")
    n1 = len(encode("<calc>37*48</calc>")) + 1
    obs = encode("<result>1776</result>")

    def edited(tokens, mask=None):
        return Episode(tokens, mask or honest.model_mask[: len(tokens)], honest.turns, honest.done)

    cheats = [
        # an edited observation (one digit of the tool's answer)
        ("observation_mismatch", edited(honest.tokens[: n1 + 10] + [ord("9")] + honest.tokens[n1 + 11 :])),
        # truncated: the model's answer to the observation dropped
        ("stopped_early", edited(honest.tokens[: n1 + len(obs)])),
        # the observation sampled by the model instead of the environment: one model turn that
        # holds the call, a result and the answer, so the call is never answered by the tool
        ("turn_not_stopped", edited(honest.tokens, [True] * len(honest.tokens))),
        # ... and the same with the first turn's stop token left out, so it reads as one turn
        (
            "stopped_early",
            edited(honest.tokens[: n1 - 1] + honest.tokens[n1:], [True] * (len(honest.tokens) - 1)),
        ),
        # a stop token in the middle of a model turn: two turns run together, one reply skipped
        (
            "turn_not_stopped",
            edited(honest.tokens[:3] + [STOP] + honest.tokens[3:], [True] + honest.model_mask),
        ),
        # the first turn cut before its stop token (to change what the environment reads)
        ("turn_not_stopped", edited(honest.tokens[: n1 - 1] + honest.tokens[n1:], honest.model_mask[1:])),
        # turns after the final answer
        (
            "continued_after_end",
            Episode(
                honest.tokens + encode("<result>0</result>") + encode("1") + [STOP],
                honest.model_mask + [False] * 18 + [True] * 2,
                3,
                True,
            ),
        ),
        ("malformed_episode", edited(honest.tokens, honest.model_mask[:-1])),
    ]
    for reason, ep in cheats:
        with pytest.raises(EpisodeRejected) as e:
            check(CALCULATOR, CALC_TASK, 0, ep)
        assert e.value.reason == reason, (reason, str(e.value))


def test_a_forged_tool_answer_that_makes_the_final_answer_right_is_refused():
    # The model called the tool on the wrong product; the worker writes the right value in the
    # observation, so the final answer built on it is right. The replay recomputes the tool.
    tokens = encode("<calc>37*47</calc>") + [STOP]
    forged = encode("<result>1776</result>")
    final = encode("1776-19=1757") + [STOP]
    ep = Episode(tokens + forged + final, [True] * len(tokens) + [False] * len(forged) + [True] * len(final), 2, True)
    assert CALCULATOR.reward(CALC_TASK, [decode(tokens), decode(final)], 0) == (1.0, None)  # it would pay
    with pytest.raises(EpisodeRejected, match="observation_mismatch"):
        check(CALCULATOR, CALC_TASK, 0, ep)


def test_guess_episodes_replay_and_a_forged_correct_is_refused():
    task, seed = {"low": 1, "high": 8}, 3
    h = secret(task, seed)
    wrong = 1 if h != 1 else 2
    ep = run_episode(GUESS, task, seed, [], scripted(str(wrong), str(h)), encode, decode, max_turns=6, max_tokens=100)
    assert ep.done and ep.turns == 2 and check(GUESS, task, seed, ep, max_turns=6).done
    # The worker claims the first guess ended the game (drops the feedback and the second turn).
    short = Episode(ep.tokens[:2], ep.model_mask[:2], 1, True)
    with pytest.raises(EpisodeRejected, match="stopped_early"):
        check(GUESS, task, seed, short, max_turns=6)


def test_episode_metrics_count_turns_tool_calls_errors_and_observation_tokens():
    answered = play(CALCULATOR, CALC_TASK, 0, "<calc>37*48</calc>", "<calc>1776 ^ 19</calc>", "1757")
    # turn 1 (19) + <result>1776</result> (21) + turn 2 (23) + an error result + turn 3 (5)
    err = len(encode(CALCULATOR.respond(CALC_TASK, ["<calc>1776 ^ 19</calc>"], 0).observation))
    assert (answered.turns, answered.observations, answered.tool_errors, answered.done) == (3, 2, 1, True)
    direct = play(CALCULATOR, CALC_TASK, 0, "1757")  # no call: 5 model tokens, nothing observed
    m = episode_metrics([answered, direct])
    assert m["episode/turns_mean"] == 2.0
    assert m["episode/tool_calls_mean"] == 1.0
    assert m["episode/tool_errors"] == 1.0
    assert m["episode/observation_token_share"] == pytest.approx((21 + err) / (19 + 21 + 23 + err + 5 + 5))
    assert m["episode/ended_by_env_frac"] == 1.0
    assert episode_metrics([]) == {}


# ---- the loss over model tokens only ---------------------------------------------------------------
def test_the_loss_counts_model_tokens_only_and_observations_get_no_gradient():
    # One episode of 5 positions: model, model, observation, observation, model. The observation
    # positions hold garbage logprobs (NaN, inf): they must not reach the loss or its gradient.
    mask = torch.tensor([[True, True, False, False, True]])
    logprobs = torch.tensor([[-1.0, -2.0, float("nan"), float("inf"), -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, 0.0, 0.0, -0.5]])
    inputs = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=torch.tensor([2.0]), loss_mask=mask)
    loss, metrics = grpo_loss(inputs, normalizer=3.0)  # 3 model tokens: the "token" normaliser
    # ratio 1 at every model token: loss = -(1 * 2) * 3 tokens / 3 = -2
    assert loss.item() == pytest.approx(-2.0)
    assert metrics["tokens"] == 3.0
    loss.backward()
    # d/dlogp of -r * A / 3 at r = 1 is -2/3 for the model tokens, exactly 0 at the observations
    assert logprobs.grad[0].tolist() == pytest.approx([-2 / 3, -2 / 3, 0.0, 0.0, -2 / 3])
