"""Every trusted role killed (issue 32): orchestrator, relay, validator and trainer each as its own
process, each SIGKILLed once at a different point of a run and restarted (the trainer with
--resume, from its newest checkpoint), beside two workers fetching through the relay. The run
ends; no group is lost or trained twice; no version number is published with other weights.
benchmarks/rehearse_swarm.py --chaos does the same at random moments, in network namespaces."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from harness import free_port
from orchestrator_harness import OrchestratorProcess
from runs import EASY


class Role:
    def __init__(self, run: Path, name: str, *args: str):
        self.run, self.name, self.args, self.p = run, name, list(args), None

    def start(self) -> Role:
        env = {k: v for k, v in os.environ.items() if k != "SWARMRL_LAUNCHER_PID"}
        env["OMP_NUM_THREADS"] = "1"
        with open(self.run / f"{self.name}.log", "ab") as out:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "swarmrl.cli", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def kill9(self) -> None:
        if self.p is not None and self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()

    def log(self) -> str:
        return (self.run / f"{self.name}.log").read_text(errors="replace")


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if "time/step" in r]


def test_each_trusted_role_killed_and_restarted_loses_nothing(easy_base, tmp_path):
    import shutil

    from swarmrl.config import load_config

    run = tmp_path / "run"
    run.mkdir()
    steps = 10
    cfg = load_config(
        None,
        [*EASY, "--trainer.steps", str(steps), "--trainer.checkpoint_every", "1", "--validator.mode", "external"]
        + ["--run_dir", str(run)],
    )
    (run / "config.toml").write_text(cfg.to_toml())
    shutil.copytree(easy_base, run / "policies" / "v000000")
    orch = OrchestratorProcess(run).start()
    trainer = Role(run, "trainer", "trainer", "--run-dir", str(run)).start()
    deadline = time.time() + 120
    while not ((run / "origin.json").exists() and (run / "trainer.pub").exists()):
        assert trainer.p.poll() is None and time.time() < deadline, trainer.log()
        time.sleep(0.1)
    key = str(run / "trainer.pub")
    origin = json.loads((run / "origin.json").read_text())["url"]
    relay_port = free_port()
    relay = Role(run, "relay", "relay", "--upstream", origin, "--cache-dir", str(run / "relay"))
    relay.args += ["--port", str(relay_port), "--trainer-key", key]
    validator = Role(run, "validator", "validator", "--orchestrator", orch.url, "--trainer-key", key)
    validator.args += ["--token-file", str(run / "validator.token"), "--cache-dir", str(run / "validator")]
    workers = [
        Role(run, f"w{i}", "worker", "--orchestrator", orch.url, "--key-file", str(run / f"w{i}" / "key.pem"))
        for i in range(2)
    ]
    for i, w in enumerate(workers):
        w.args += ["--cache-dir", str(run / f"w{i}"), "--name", f"w{i}", "--trainer-key", key]
        w.args += ["--relays", f"http://127.0.0.1:{relay_port}"]
    roles = [relay.start(), validator.start(), *(w.start() for w in workers)]
    # Each trusted role dies once, after a given step, and comes back a second later.
    plan = {2: "orchestrator", 4: "relay", 6: "validator", 7: "trainer"}
    try:
        deadline = time.time() + 600
        while plan:
            assert time.time() < deadline, f"the run stalled at steps {_steps(run)}; " + trainer.log()[-2000:]
            done = len(_steps(run))
            for after in [s for s in plan if done >= s]:
                name = plan.pop(after)
                if name == "orchestrator":
                    orch.kill9()
                    time.sleep(1.0)
                    orch.start()
                else:
                    role = {"relay": relay, "validator": validator, "trainer": trainer}[name]
                    role.kill9()
                    time.sleep(1.0)
                    if role is trainer:
                        role.args.append("--resume")
                    role.start()
            time.sleep(0.2)
        assert trainer.p.wait(timeout=600) == 0, trainer.log()
        for w in workers:
            assert w.p.wait(timeout=60) == 0, w.log()  # workers leave once the run is finished
    finally:
        for r in [trainer, *roles]:
            r.kill9()
        orch.stop()
    assert _steps(run) == list(range(1, steps + 1))
    trained = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(steps))
    db = sqlite3.connect(run / "orchestrator.sqlite")
    batches = dict(db.execute("SELECT step, group_ids FROM batches").fetchall())
    ids = [i for t in trained for i in t["group_ids"]]
    assert all(json.loads(batches[t["step"]]) == t["group_ids"] for t in trained)  # exactly the recorded batches
    assert len(ids) == len(set(ids))  # no group trained twice
    consumed = dict(db.execute("SELECT id, step FROM groups WHERE state = 'consumed'").fetchall())
    assert sorted(consumed) == sorted(ids)
    states = dict(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
    assert set(states) <= {"consumed", "queued", "stale", "uninformative", "pending", "validating"}, states
    # The resumed trainer redid the steps after its checkpoint and got the same weights: every
    # version number still names one set of weights.
    assert "resuming from" in trainer.log().lower() or "resum" in trainer.log().lower(), trainer.log()[-2000:]
    assert "republishing v" not in trainer.log(), trainer.log()
    assert orch.log().count("orchestrator listening") == 2
    summary = json.loads((run / "trainer_summary.json").read_text())
    assert summary["accuracy_after"] is not None
