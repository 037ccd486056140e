"""A verifiers environment through a whole `swarmrl rl` run: the game of tests/support/vf_guess_v1,
written for verifiers' current API (verifiers.v1, all of 0.4), registered by a plug-in
(tests/support/vf_guess_plugin.py) and run by .venv-verifiers' interpreter in a process of its own
in each role (swarmrl/envs/process.py): the workers play its episodes and prove their turns, the
orchestrator replays every episode through its own copy and grades it with the task's rewards, the
validator checks every group, the trainer trains. The task rows are the environment's own, written
by `python -m swarmrl.envs.verifiers_v1` in that venv. Skipped without .venv-verifiers unless
SWARMRL_REQUIRE_VERIFIERS=1 (CI's `make test`). CI runs it on verifiers 0.3.1's `verifiers.v1`;
SWARMRL_VERIFIERS_PYTHON=/path/to/venv/bin/python runs it on another (0.4.0: docs/environments.md)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from swarmrl.envs.episode import runs as mask_runs

from harness import store_rows, train_steps
from runs import EASY, swarmrl

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
# $SWARMRL_VERIFIERS_PYTHON: another verifiers venv (the plug-in reads it too), e.g. one of 0.4.0.
PYTHON = Path(os.environ.get("SWARMRL_VERIFIERS_PYTHON") or ROOT / ".venv-verifiers" / "bin" / "python")


@pytest.fixture
def verifiers_python() -> Path:
    if not PYTHON.exists():
        if os.environ.get("SWARMRL_REQUIRE_VERIFIERS") == "1":
            pytest.fail(f"{PYTHON} is missing: run `make verifiers-env`")
        pytest.skip("no .venv-verifiers (make verifiers-env)")
    return PYTHON


def test_a_verifiers_environment_runs_through_swarmrl_rl(verifiers_python, easy_base, tmp_path):
    from vf_guess_plugin import CONFIG

    rows = tmp_path / "rows.jsonl"
    written = subprocess.run(
        [str(verifiers_python), "-m", "swarmrl.envs.verifiers_v1", "vf1-guess", json.dumps(CONFIG)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{SUPPORT}"},
        check=True,
    ).stdout
    rows.write_text(written)
    assert len(written.splitlines()) == 16 and all('"task_type": "env:vf1-guess"' in r for r in written.splitlines())

    run = tmp_path / "run"
    args = ["rl", "--plugins", '["vf_guess_plugin"]', "--tasks.source", str(rows), "--run-dir", str(run)]
    args += ["--model.path", str(easy_base), "--trainer.steps", "2", *EASY, "--tasks.eval_size", "2"]
    args += ["--validator.rate", "1.0", "--sampling.max_new_tokens", "96"]
    swarmrl(*args, env={"PYTHONPATH": str(SUPPORT)}, timeout=600)

    assert [r["step"] for r in train_steps(run)] == [1, 2]
    groups = [(json.loads(p), v) for p, v in store_rows(run, "SELECT payload, verdict FROM groups")]
    assert groups and all(g["task_type"] == "env:vf1-guess" for g, _ in groups)
    # Graded by the task's own rewards (found: 1, closest guess: up to 0.5), replayed, proven.
    rewards = [r for g, _ in groups for r in g["task_rewards"]]
    assert all(0.0 <= r <= 1.5 for r in rewards) and len(set(rewards)) > 1, rewards
    checked = [json.loads(v) for _, v in groups if v is not None]
    assert checked and all(v["ok"] for v in checked), [v for v in checked if not v["ok"]]
    assert store_rows(run, "SELECT COUNT(*) FROM rejections")[0][0] == 0
    turns = [sum(1 for *_, model in mask_runs(s["model_mask"]) if model) for g, _ in groups for s in g["samples"]]
    assert max(turns) >= 2  # the environment answered ("higher" / "lower") and the episode went on
    # Every role that played or replayed an episode ran the environment in verifiers' venv.
    built = f"[env vf1-guess] environment 'vf1-guess' built by swarmrl.envs.verifiers_v1:load in {verifiers_python}"
    assert built in (run / "logs" / "orchestrator.log").read_text()
    senders = {g["worker"] for g, _ in groups}
    logs = [log.read_text() for log in (run / "logs").glob("worker-*.log")]
    played = [log for log in logs if any(f"registered as {key}" in log for key in senders)]
    assert played and all(built in log for log in played)
