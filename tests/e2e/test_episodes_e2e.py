"""End to end: `swarmrl rl` on multi-turn episodes of the `guess` environment with the tiny base
(real processes over HTTP on 127.0.0.1: orchestrator, trainer, workers, validator). Workers play
the episodes turn by turn, the orchestrator replays each one, the validator checks every turn
of every group, the trainer learns from the model's tokens only; the metrics show the episodes."""

from __future__ import annotations

import json
import sqlite3

from runs import EASY, swarmrl


def test_a_run_on_episodes_replays_validates_trains_and_reports_turns(easy_base, tmp_path):
    run = tmp_path / "run"
    swarmrl(
        "rl",
        "--run-dir",
        str(run),
        "--model.path",
        str(easy_base),
        "--trainer.steps",
        "2",
        *EASY,
        "--tasks.source",
        "guess",
        "--tasks.guess_high",
        "8",
        "--tasks.max_turns",
        "4",
        "--sampling.max_new_tokens",
        "128",
        "--validator.rate",
        "1.0",
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 1.0 <= r["episode/turns_mean"] <= 4.0 and 0.0 < r["episode/observation_token_share"] < 1.0
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # before and after
    assert all(1.0 <= r["eval/episode/turns_mean"] <= 4.0 for r in evals)
    db = sqlite3.connect(run / "orchestrator.sqlite")
    groups = [(json.loads(p), v) for p, v in db.execute("SELECT payload, verdict FROM groups")]
    assert groups and all(g["task_type"] == "env:guess" for g, _ in groups)
    checked = [json.loads(v) for _, v in groups if v is not None]
    assert checked and all(v["ok"] for v in checked), checked
    # Some episodes went past their first turn, and every one is at most 4 model turns.
    turns = [
        sum(1 for a, b in zip([False] + s["model_mask"], s["model_mask"]) if b and not a)
        for g, _ in groups
        for s in g["samples"]
    ]
    assert max(turns) > 1 and max(turns) <= 4
    assert db.execute("SELECT COUNT(*) FROM rejections").fetchone()[0] == 0
