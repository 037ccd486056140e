"""Episodes between the pure layer and the roles (issue 31): per-turn seeds, batched play,
observation framing under the project's chat template, the trainer's batch over episodes, the
validator's split of an episode into turns, the orchestrator's per-turn proof count and grading,
the task rows, and episodes played through the built-in engine with a real model."""

import json
import re

import pytest
import torch

from swarmrl.config import Config
from swarmrl.envs import registry
from swarmrl.envs.builtin import CALCULATOR, GUESS, secret
from swarmrl.envs.episode import Episode, chat_framing, replay, run_episode, run_episodes, runs, turn_seed
from swarmrl.inference.engine import build_engine
from swarmrl.inference.episodes import EpisodeJob, play_episodes
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.model.tokenizer import build_char_tokenizer, decode_completion
from swarmrl.orchestrator.batches import batch_metrics
from swarmrl.orchestrator.scoring import score_episodes
from swarmrl.orchestrator.submissions import check_turn_proofs
from swarmrl.proofs.toploc import build_proofs_many
from swarmrl.proofs.toploc import encode as encode_proofs
from swarmrl.protocol.messages import ClaimedSample, SampleIn
from swarmrl.protocol.rollouts import Group, Sample
from swarmrl.sft.warmstart import encode_episode_example
from swarmrl.tasks.episodes import calculator_rows, calculator_traces, guess_rows, guess_traces
from swarmrl.tasks.registry import source_rows
from swarmrl.tasks.source import episode_spec, model_input, row_checks
from swarmrl.trainer.batch import build_train_batch
from swarmrl.validator.core import SampleReport, merge_reports, split_turns

STOP = 0


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != STOP)


def test_turn_seeds_keep_the_first_and_differ_after_it():
    assert turn_seed(12345, 0) == 12345
    later = [turn_seed(12345, k) for k in range(1, 6)]
    assert len(set(later)) == 5 and 12345 not in later
    assert all(0 <= s < 2**63 for s in later)
    assert later == [turn_seed(12345, k) for k in range(1, 6)]  # a function, not a generator's state
    assert turn_seed(12346, 1) != turn_seed(12345, 1)


def test_episodes_played_side_by_side_are_those_played_one_by_one():
    h = secret({"low": 1, "high": 8}, 5)
    scripts = [[str(h % 8 + 1), str(h)], ["<calc>2*3</calc>", "6"], ["9"]]
    jobs = [({"low": 1, "high": 8}, 5, encode("Q")), ({"expression": "2*3"}, 0, encode("R")), ({}, 1, [])]
    envs = [GUESS, CALCULATOR, CALCULATOR]

    def say(offset):  # job r.index of the call is script offset + r.index
        return lambda rows: [encode(scripts[offset + r.index][r.turn]) + [STOP] for r in rows]

    alone = []
    for i, job in enumerate(jobs):
        queue = list(scripts[i])
        one = run_episode(
            envs[i],
            *job,
            lambda ctx, budget, queue=queue: encode(queue.pop(0)) + [STOP],
            encode,
            decode,
            max_turns=4,
            max_tokens=200,
        )
        assert one == run_episodes(envs[i], [job], say(i), encode, decode, max_turns=4, max_tokens=200)[0]
        alone.append(one)
    assert alone[0].turns == 2 and alone[0].done and alone[1].observations == 1 and alone[2].turns == 1
    # The two calculator episodes at once, one sampler call per round: the same episodes.
    assert run_episodes(CALCULATOR, jobs[1:], say(1), encode, decode, max_turns=4, max_tokens=200) == alone[1:]
    with pytest.raises(ValueError, match="returned 0 turns for 1 rows"):
        run_episodes(CALCULATOR, jobs[2:], lambda rows: [], encode, decode, max_turns=4, max_tokens=200)


def test_an_observation_is_framed_as_the_chat_template_frames_a_user_turn():
    tok = build_char_tokenizer()
    framed = chat_framing(tok)("higher")
    assert (
        tok.decode(framed, skip_special_tokens=False) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    )
    # Appended after a turn that ended with <|im_end|>, the episode reads as the template renders
    # the whole conversation.
    prompt = tok.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False, add_generation_prompt=True)
    turn = tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    episode = tok(prompt, add_special_tokens=False)["input_ids"] + turn + framed
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "12"},
            {"role": "user", "content": "higher"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(episode, skip_special_tokens=False) == whole
    assert tok.decode(chat_framing(tok, "tool")("7"), skip_special_tokens=False).startswith("\n<|im_start|>tool\n")
    tok.chat_template = None
    assert chat_framing(tok)("ab") == tok("ab", add_special_tokens=False)["input_ids"]


def test_task_types_name_their_environment():
    assert registry.for_task_type("env:guess") is GUESS and registry.for_task_type("env:calculator") is CALCULATOR
    assert registry.for_task_type("verifiable_math") is None and registry.for_task_type(None) is None
    with pytest.raises(ValueError, match="no environment named 'nope'"):
        registry.for_task_type("env:nope")


def _sample(token_ids, logprobs, seed, model_mask, **replayed) -> Sample:
    return Sample(
        token_ids=token_ids, logprobs=logprobs, finish_reason="stop", seed=seed, model_mask=model_mask, **replayed
    )


def _group(samples, *, env_seed=3, task_type="env:guess", info=None, target=None):
    return Group(
        problem_id="p",
        task_type=task_type,
        prompt="prompt",
        verification_info=json.dumps(info or {"low": 1, "high": 8}),
        prompt_ids=[1, 2, 3],
        samples=samples,
        policy_version=0,
        worker="w",
        temperature=1.0,
        target_length=target,
        env_seed=env_seed,
    )


def test_the_train_batch_masks_observations_and_gives_each_episode_one_advantage():
    # Prompt [1, 2, 3]; episode: model 10 11, observation 20 21, model 12. Predicted positions
    # (column t predicts token t+1): the episode's tokens sit at 3..7, predicted from 2..6.
    a = _sample([10, 11, 20, 21, 12], [-0.1, -0.2, 0.0, 0.0, -0.3], 0, [True, True, False, False, True])
    b = _sample([13], [-0.4], 1, [True])
    g = _group([a, b])
    g.rewards = [1.0, 0.0]
    batch = build_train_batch([g], pad_token_id=0, normalize_std=True, adv_eps=0.0)
    assert batch.loss_mask[0].tolist() == [False, False, True, True, False, False, True]
    assert batch.loss_mask[1].tolist() == [False, False, True, False, False, False, False]
    assert batch.inference_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3])
    # Rewards 1 and 0: mean 0.5, population std 0.5, so +1 and -1 for every token of each episode.
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0])


def test_the_validator_checks_an_episode_turn_by_turn():
    sample = ClaimedSample(
        token_ids=[10, 11, 20, 21, 12],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        seed=77,
        proofs=["p0", "p1", "p2"],
        model_mask=[True, True, False, False, True],
    )
    hidden, logits = torch.arange(10.0).reshape(5, 2), torch.arange(15.0).reshape(5, 3)
    pieces = split_turns(sample, (hidden, logits), chunk_size=1)
    assert [p.token_ids for p, _ in pieces] == [[10, 11], [12]]
    assert [p.seed for p, _ in pieces] == [77, turn_seed(77, 1)]
    assert [p.proofs for p, _ in pieces] == [["p0", "p1"], ["p2"]]
    assert [p.logprobs for p, _ in pieces] == [[-0.1, -0.2], [-0.3]]
    assert all(p.model_mask is None for p, _ in pieces)  # each turn is checked as a completion
    assert pieces[1][1][0].tolist() == [[8.0, 9.0]] and pieces[0][1][1].shape == (2, 3)
    single = sample.model_copy(update={"model_mask": None})
    assert split_turns(single, (hidden, logits), chunk_size=1) == [(single, (hidden, logits))]
    merged = merge_reports([SampleReport(["c0"], 0.0, 1e-6), SampleReport(["c1"], 0.02, 3e-6, "bad proof")])
    assert merged.chunks == ["c0", "c1"] and merged.margin_max == 0.02 and merged.logprob_err_max == 3e-6
    assert merged.proof_error == "turn 1: bad proof"


def test_an_episodes_proofs_are_counted_turn_by_turn():
    # Turns of 3 and 2 tokens (hidden size 8) with chunks of 2: 2 + 1 proofs, each turn's own.
    proofs = build_proofs_many([torch.randn(3, 8), torch.randn(2, 8)], chunk_size=2, topk=4)
    turn0, turn1 = (encode_proofs(p) for p in proofs)
    mask = [True, True, True, False, True, True]

    def check(given):
        smp = SampleIn(token_ids=[5] * 6, logprobs=[0.0] * 6, finish_reason="stop", proofs=given, model_mask=mask)
        return check_turn_proofs(smp, hidden_size=8, chunk_size=2, topk=4)

    assert check(turn0 + turn1) is None
    assert check(turn0).startswith("turn 1: 0 proofs for 2 tokens")
    assert check(turn0 + turn1 + turn1) == "4 proofs; the episode's turns need 3"


def test_episode_rewards_come_from_the_environment_and_length_shapes_model_tokens_only():
    tok = build_char_tokenizer()
    h = secret({"low": 1, "high": 8}, 3)
    framed = chat_framing(tok)("lower")
    wrong = tok(str(8 if h != 8 else 7), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    right = tok(str(h), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    found = _sample(
        wrong + framed + right,
        [-0.1] * len(wrong + framed + right),
        1,
        [True] * len(wrong) + [False] * len(framed) + [True] * len(right),
    )
    missed = _sample(wrong, [-0.1] * len(wrong), 2, [True] * len(wrong))
    cfg = Config()
    scores = score_episodes(_group([found, missed]), tokenizer=tok, cfg=cfg)
    assert [s.task_reward for s in scores] == [1.0, 0.0] and scores[1].reason == "not found within the turns"
    # With a target, the length is the model's tokens (observations are not the model's).
    shaped = score_episodes(_group([found, missed], target=len(wrong) + len(right)), tokenizer=tok, cfg=cfg)
    assert shaped[0].reward == pytest.approx(0.5)  # "max" mode: at the target half the reward is kept


def test_calculator_and_guess_rows_are_valid_tasks_and_the_lease_hides_the_answer():
    cfg = Config()
    train, test = calculator_rows(50, split="train"), calculator_rows(10, split="test")
    assert len({r["problem_id"] for r in train}) == 50
    assert not {r["problem_id"] for r in train} & {r["problem_id"] for r in test}
    checks = row_checks()
    for row in train + guess_rows(3):
        assert checks[row["task_type"]](json.loads(row["verification_info"])) is None
    spec = episode_spec(cfg, train[0], [11, 12])
    assert spec["name"] == "calculator" and "answer" not in spec["task"] and spec["seed"] == 11
    assert spec["max_tokens"] == cfg.sampling.max_new_tokens and spec["max_turns"] == CALCULATOR.max_turns
    capped = cfg.model_copy(update={"tasks": cfg.tasks.model_copy(update={"max_turns": 2})})
    assert episode_spec(capped, train[0], [11])["max_turns"] == 2
    assert episode_spec(cfg, {"task_type": "verifiable_math", "verification_info": "{}"}, [1]) is None
    # The turn cost travels in the task row, which the trusted side holds and replays from.
    costly = Config.model_validate({"tasks": {"source": "guess", "guess_turn_cost": 0.1}})
    (row,) = source_rows(costly.tasks, "guess", 1, "train")
    assert json.loads(row["verification_info"]) == {"low": 1, "high": 16, "turn_cost": 0.1}
    assert "turn_cost" not in guess_rows(1)[0]["verification_info"]


def test_batch_metrics_show_turns_tool_calls_and_the_observation_share():
    a = _sample([1, 2, 9, 3], [-0.1, -0.1, 0.0, -0.1], 0, [True, True, False, True], ended_by_env=True, tool_errors=1)
    b = _sample([4], [-0.1], 1, [True], ended_by_env=False)
    g = _group([a, b])
    g.rewards = g.task_rewards = [1.0, 0.0]
    m = batch_metrics(1, [g], [g], 0, Config())
    assert m["episode/turns_mean"] == 1.5 and m["episode/tool_calls_mean"] == 0.5
    assert m["episode/tool_errors"] == 1.0 and m["episode/observation_token_share"] == pytest.approx(1 / 5)
    assert m["episode/ended_by_env_frac"] == 0.5


def test_episodes_through_the_built_in_engine_sample_each_turn_as_a_completion_of_its_own():
    model, tok = build_tiny_policy(seed=0)
    engine = build_engine(model.eval(), tok)
    text = tok.apply_chat_template([{"role": "user", "content": "Guess."}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    jobs = [EpisodeJob({"low": 1, "high": 8}, 5, prompt, s) for s in (101, 202, 303, 404)]
    played = play_episodes(engine, tok, GUESS, jobs, max_turns=3, max_tokens=120, temperature=1.0, return_hidden=True)
    for job, p in zip(jobs, played):
        ep = p.episode
        assert len(p.logprobs) == len(ep.tokens) and p.finish_reason in ("stop", "length")
        assert len(p.hidden) == ep.turns
        # Re-sample each turn alone, after the episode so far, with its turn seed: the same ids
        # (and the same logprobs up to batching), at most the budget that was left.
        spans = [(a, b) for a, b, m in runs(ep.model_mask) if m]
        for k, (a, b) in enumerate(spans):
            alone = engine.generate(
                [prompt + ep.tokens[:a]], [turn_seed(job.seed, k)], max_new_tokens=120 - a, temperature=1.0
            )[0]
            assert alone.token_ids[: b - a] == ep.tokens[a:b]
            assert alone.logprobs[: b - a] == pytest.approx(p.logprobs[a:b], abs=1e-4)
            assert p.hidden[k].shape[0] == b - a
        assert all(lp == 0.0 for lp, m in zip(p.logprobs, ep.model_mask) if not m)


def test_the_calculator_warm_start_shows_episodes_as_the_sampler_would_produce_them():
    tok = build_char_tokenizer()
    rows = calculator_rows(40, split="train")
    traces = calculator_traces(rows, tool_rate=0.5, seed=1)
    called = [t for t in traces if len(t["turns"]) == 2]
    assert 10 <= len(called) <= 30  # about half call the tool
    for t in traces:
        task = json.loads(t["verification_info"])
        assert t["turns"][-1] == task["answer"]  # the final turn is the right number
    t = called[0]
    task = json.loads(t["verification_info"])
    assert t["turns"][0] == f"<calc>{task['expression']}</calc>"
    assert t["observations"] == [f"<result>{task['answer']}</result>"]  # the environment's own reply
    ids, mask = encode_episode_example(tok, t["prompt"], t["turns"], t["observations"])
    # The episode's ids are what a worker's episode holds: prompt, turn + eos, framed result, turn + eos.
    _, prompt = model_input(tok, t["prompt"], None)
    turn = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in t["turns"]]
    assert ids == prompt + turn[0] + chat_framing(tok)(t["observations"][0]) + turn[1]
    assert [i for i, m in zip(ids, mask) if m] == turn[0] + turn[1]  # only the model's turns are learned


def test_the_guess_warm_start_plays_games_the_environment_replays():
    tok = build_char_tokenizer()
    games = guess_traces(30, high=16, max_turns=4, seed=2)
    assert all(1 <= len(g["turns"]) <= 4 for g in games)
    assert any(len(g["turns"]) > 1 for g in games)
    for g in games:
        ids, mask = encode_episode_example(tok, g["prompt"], g["turns"], g["observations"])
        _, prompt = model_input(tok, g["prompt"], None)
        episode = Episode(ids[len(prompt) :], [bool(m) for m in mask[len(prompt) :]], len(g["turns"]), False)
        task = json.loads(g["verification_info"])
        replayed = replay(
            GUESS,
            task,
            g["env_seed"],
            episode,
            chat_framing(tok),
            lambda t: decode_completion(tok, t, [tok.eos_token_id]),
            stop_ids=[tok.eos_token_id],
            max_turns=4,
            max_tokens=400,
        )
        # Each turn's range holds the hidden number, and its guess is inside the range.
        hidden = secret(task, g["env_seed"])
        for turn in replayed.turns:
            low, top, guess = (int(x) for x in re.findall(r"\d+", turn))
            assert low <= hidden <= top and low <= guess <= top


def test_the_shipped_episode_configs_load_and_their_budgets_fit_an_episode():
    from pathlib import Path

    from swarmrl.config import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    calc, guess = load_config(root / "calculator.toml", []), load_config(root / "guess.toml", [])
    assert calc.tasks.source == "calculator" and guess.tasks.source == "guess" and guess.tasks.max_turns == 4
    tok = build_char_tokenizer()
    # A worked calculator episode (call, framed result, answer) fits its token budget ...
    t = calculator_traces(calculator_rows(5, digits=calc.tasks.digits), tool_rate=1.0)[0]
    ids, mask = encode_episode_example(tok, t["prompt"], t["turns"], t["observations"])
    _, prompt = model_input(tok, t["prompt"], None)
    assert len(ids) - len(prompt) <= calc.sampling.max_new_tokens
    # ... and so does the longest worked game.
    games = guess_traces(50, high=guess.tasks.guess_high, max_turns=4)
    _, prompt = model_input(tok, games[0]["prompt"], None)
    longest = max(len(encode_episode_example(tok, g["prompt"], g["turns"], g["observations"])[0]) for g in games)
    assert longest - len(prompt) <= guess.sampling.max_new_tokens
