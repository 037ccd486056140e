"""A plug-in from outside the repository: tests/support/plugin_package, a package as a user would
write it, installed with pip (into a folder of its own on PYTHONPATH, so the project's venv is
left as it was). Its environment, task source and engine backend are used by `swarmrl rl`
through the run's config alone: every role imports the plug-in (the orchestrator and trainer
from config.toml, the workers from `--plugin` and GET /v1/status), the workers play its episodes
through its engine, the orchestrator replays them, the validator checks every group, the trainer
trains. Without the package, each role stops naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from swarmrl.envs.episode import runs as mask_runs

from harness import metrics, store_rows, train_steps
from orchestrator_harness import OrchestratorProcess, make_run_dir
from runs import EASY, swarmrl

PACKAGE = Path(__file__).resolve().parents[1] / "support" / "plugin_package"
PLUGIN = "swarmrl_toy_plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The plug-in package built and installed by pip into a folder (pip's --target): the folder
    to put on PYTHONPATH. Built from a copy, so pip's build files stay out of the repository."""
    root = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(PACKAGE, root / "src")
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target)]
        + [str(source)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (target / PLUGIN / "__init__.py").exists() and not (PACKAGE / "build").exists()
    return target


RUN_CONFIG = f"""plugins = ["{PLUGIN}"]

[tasks]
source = "chain"
options = {{high = 5}}

[async]
worker_engine = "counted"
worker_engine_options = {{tag = "from-the-config"}}
"""


def test_a_plugins_environment_source_and_engine_run_through_swarmrl_rl(installed, easy_base, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(RUN_CONFIG)
    run = tmp_path / "run"
    env = {"PYTHONPATH": str(installed)}
    args = ["rl", "--config", str(config), "--run-dir", str(run), "--model.path", str(easy_base)]
    args += ["--trainer.steps", "2", *EASY, "--tasks.eval_size", "6", "--sampling.max_new_tokens", "96"]
    args += ["--validator.rate", "1.0", "--logging.tensorboard", "true"]
    swarmrl(*args, env=env, timeout=600)

    assert [r["step"] for r in train_steps(run)] == [1, 2]
    groups = [(json.loads(p), v) for p, v in store_rows(run, "SELECT payload, verdict FROM groups")]
    assert groups and all(g["task_type"] == "env:chain" for g, _ in groups)
    # Replayed by the orchestrator (its rewards are the environment's: 0, 0.5 or 1) and proven.
    checked = [json.loads(v) for _, v in groups if v is not None]
    assert checked and all(v["ok"] for v in checked), [v for v in checked if not v["ok"]]
    rewards = {r for g, _ in groups for r in g["task_rewards"]}
    assert rewards and rewards <= {0.0, 0.5, 1.0}
    turns = [sum(1 for *_, model in mask_runs(s["model_mask"]) if model) for g, _ in groups for s in g["samples"]]
    assert max(turns) == 2  # episodes went on after the environment's observation
    assert store_rows(run, "SELECT COUNT(*) FROM rejections")[0][0] == 0
    # The workers generated with the plug-in's engine, with the option the config gave it.
    logs = [(run / "logs" / f"worker-{i}.log").read_text() for i in (0, 1)]
    assert all("counted engine from-the-config: load 1, policy v0" in log for log in logs), logs[0][-2000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # The same run's metrics as TensorBoard scalars (logging.tensorboard), read back with its own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    for name in ("reward/mean", "eval/accuracy", "loss/policy"):
        written = [(r["step"], r[name]) for r in metrics(run) if name in r]
        assert [(e.step, pytest.approx(e.value)) for e in events.Scalars(name)] == written, name


def test_without_the_package_every_role_stops_and_names_it(installed, tmp_path, monkeypatch):
    bare = {"PYTHONPATH": ""}
    # The run's config: refused before anything starts.
    proc = swarmrl("rl", "--plugins", f'["{PLUGIN}"]', "--dry-run", check=False, env=bare)
    assert proc.returncode == 2 and f"plug-in '{PLUGIN}'" in proc.stderr and "pip install" in proc.stderr
    assert "Traceback" not in proc.stderr
    # A role's --plugin: the same.
    proc = swarmrl("status", "--plugin", PLUGIN, "--orchestrator", "http://127.0.0.1:9", check=False, env=bare)
    assert proc.returncode == 2 and "is not installed here" in proc.stderr
    # A worker learns the run's plug-ins from the orchestrator and stops before taking a lease.
    run = make_run_dir(tmp_path / "run")
    config = run / "config.toml"
    assert "\nplugins = []\n" in config.read_text()
    config.write_text(config.read_text().replace("\nplugins = []\n", f'\nplugins = ["{PLUGIN}"]\n', 1))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(installed), os.environ.get("PYTHONPATH")])))
    orch = OrchestratorProcess(run).start()
    try:
        assert httpx.get(f"{orch.url}/v1/status").json()["plugins"] == [PLUGIN]
        home = ["--cache-dir", str(tmp_path / "w"), "--key-file", str(tmp_path / "w" / "key.pem")]
        proc = swarmrl("worker", "--orchestrator", orch.url, *home, check=False, env=bare, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert f"this run uses the plug-in '{PLUGIN}'" in proc.stderr and "not installed here" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert store_rows(run, "SELECT COUNT(*) FROM leases")[0][0] == 0  # it stopped before any lease
    finally:
        orch.stop()
