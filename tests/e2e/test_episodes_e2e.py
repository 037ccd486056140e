"""End to end: `swarmrl rl` on multi-turn episodes of the `guess` environment with the tiny base
(real processes over HTTP on 127.0.0.1: orchestrator, trainer, workers, validator). Workers play
the episodes turn by turn, the orchestrator replays each one, the validator checks every turn
of every group, the trainer learns from the model's tokens only; the metrics show the episodes. A
turn cost makes the trusted side's reward depend on the turn a number was found on."""

from __future__ import annotations

import json

from swarmrl.envs.episode import runs as mask_runs

from harness import metrics, store_rows
from runs import EASY, swarmrl_rl


def model_turns(mask: list[bool]) -> int:
    return sum(1 for _, _, model in mask_runs(mask) if model)


def test_a_run_on_episodes_replays_validates_trains_and_reports_turns(easy_base, tmp_path):
    run = tmp_path / "run"
    swarmrl_rl(
        run,
        easy_base,
        2,
        *EASY,
        *"--tasks.source guess --tasks.guess_high 8 --tasks.guess_turn_cost 0.25 --tasks.max_turns 4".split(),
        *"--sampling.max_new_tokens 128 --validator.rate 1.0".split(),
    )
    records = metrics(run)
    steps = [r for r in records if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        # A batch whose every episode ended at its first turn (all found at once, or no guess made)
        # has no observation tokens: seen once in 10 runs. Multi-turn episodes are asserted over
        # the whole run below.
        assert 1.0 <= r["episode/turns_mean"] <= 4.0 and 0.0 <= r["episode/observation_token_share"] < 1.0
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # before and after
    assert all(1.0 <= r["eval/episode/turns_mean"] <= 4.0 for r in evals)
    for r in evals:
        by_turn = [r[f"eval/episode/solved_by_turn_{k}"] for k in (1, 2, 3, 4)]
        assert by_turn == sorted(by_turn) and by_turn[-1] == r["eval/episode/solved"]
        assert r["eval/accuracy"] <= r["eval/episode/solved"]  # a late find pays less than 1
    groups = [(json.loads(p), v) for p, v in store_rows(run, "SELECT payload, verdict FROM groups")]
    assert groups and all(g["task_type"] == "env:guess" for g, _ in groups)
    checked = [json.loads(v) for _, v in groups if v is not None]
    assert checked and all(v["ok"] for v in checked), [v for v in checked if not v["ok"]]
    # Some episodes went past their first turn (observations between turns), and every one is at
    # most 4 model turns.
    turns = [model_turns(s["model_mask"]) for g, _ in groups for s in g["samples"]]
    assert max(turns) > 1 and max(turns) <= 4
    # The orchestrator's reward: 1 - 0.25 per turn after the first for a found number, else 0.
    scored = [g for g, _ in groups if g["task_rewards"]]
    assert scored
    for g in scored:
        for s, reward in zip(g["samples"], g["task_rewards"], strict=True):
            t = model_turns(s["model_mask"])
            assert reward == 0.0 or reward == 1.0 - 0.25 * (t - 1), (reward, t)
    assert store_rows(run, "SELECT COUNT(*) FROM rejections")[0][0] == 0
