"""Every trusted role killed (issue 32): orchestrator, relay, validator and trainer each as its own
process, each SIGKILLed once at a different point of a run and restarted (the trainer with
--resume, from its newest checkpoint), beside two workers fetching through the relay. The run
ends; no group is lost or trained twice; no version number is published with other weights.
Payloads are pruned as soon as retention allows (orchestrator.keep_payload_steps = 0, a
checkpoint every step): the resumed trainer still gets every batch it asks for, whole.
benchmarks/rehearse_swarm.py --chaos does the same at random moments, in network namespaces."""

from __future__ import annotations

import json
import time
from pathlib import Path

from harness import RunHandle, free_port, store_rows, train_steps, wait_for
from orchestrator_harness import OrchestratorProcess
from runs import EASY


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in train_steps(run)]


def _role(run: Path, name: str, *args: str) -> RunHandle:
    return RunHandle(*args, log=run / f"{name}.log")


def test_each_trusted_role_killed_and_restarted_loses_nothing(easy_base, tmp_path):
    import shutil

    from swarmrl.config import load_config

    run = tmp_path / "run"
    run.mkdir()
    steps = 10
    cfg = load_config(
        None,
        [*EASY, "--trainer.steps", str(steps), "--trainer.checkpoint_every", "1", "--validator.mode", "external"]
        + ["--run_dir", str(run), "--orchestrator.keep_payload_steps", "0"],
    )
    (run / "config.toml").write_text(cfg.to_toml())
    shutil.copytree(easy_base, run / "policies" / "v000000")
    orch = OrchestratorProcess(run).start()
    trainer = _role(run, "trainer", "trainer", "--run-dir", str(run)).start()
    trainer.wait_for(
        lambda: (run / "origin.json").exists() and (run / "trainer.pub").exists(), 120, "origin.json and trainer.pub"
    )
    key = str(run / "trainer.pub")
    origin = json.loads((run / "origin.json").read_text())["url"]
    relay_port = free_port()
    relay = _role(run, "relay", "relay", "--upstream", origin, "--cache-dir", str(run / "relay"))
    relay.args += ("--port", str(relay_port), "--trainer-key", key)
    validator = _role(run, "validator", "validator", "--orchestrator", orch.url, "--trainer-key", key)
    validator.args += ("--token-file", str(run / "validator.token"), "--cache-dir", str(run / "validator"))
    workers = [
        _role(run, f"w{i}", "worker", "--orchestrator", orch.url, "--key-file", str(run / f"w{i}" / "key.pem"))
        for i in range(2)
    ]
    for i, w in enumerate(workers):
        w.args += ("--cache-dir", str(run / f"w{i}"), "--name", f"w{i}", "--trainer-key", key)
        w.args += ("--relays", f"http://127.0.0.1:{relay_port}")
    roles = [relay.start(), validator.start(), *(w.start() for w in workers)]
    # Each trusted role dies once, after a given step, and comes back a second later.
    plan = {2: "orchestrator", 4: "relay", 6: "validator", 7: "trainer"}
    try:
        deadline = time.monotonic() + 600
        for after, name in sorted(plan.items()):
            wait_for(
                lambda: len(_steps(run)) >= after,  # noqa: B023 (called before `after` moves on)
                deadline - time.monotonic(),
                f"step {after}, to kill the {name} after it",
                log=lambda: f"the run stalled at steps {_steps(run)}; " + trainer.out()[-2000:],
                every=0.2,
            )
            if name == "orchestrator":
                orch.kill9()
                time.sleep(1.0)
                orch.start()
            else:
                role = {"relay": relay, "validator": validator, "trainer": trainer}[name]
                role.kill9()
                time.sleep(1.0)
                if role is trainer:
                    role.args += ("--resume",)
                role.start()
        assert trainer.wait(timeout=600) == 0, trainer.out()
        for w in workers:
            assert w.wait(timeout=60) == 0, w.out()  # workers leave once the run is finished
    finally:
        for r in [trainer, *roles]:
            r.kill9()
        orch.stop()
    assert _steps(run) == list(range(1, steps + 1))
    trained = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(steps))
    batches = dict(store_rows(run, "SELECT step, group_ids FROM batches"))
    ids = [i for t in trained for i in t["group_ids"]]
    assert all(json.loads(batches[t["step"]]) == t["group_ids"] for t in trained)  # exactly the recorded batches
    assert len(ids) == len(set(ids))  # no group trained twice
    consumed = dict(store_rows(run, "SELECT id, step FROM groups WHERE state = 'consumed'"))
    assert sorted(consumed) == sorted(ids)
    # Trained groups of old batches kept only their audit summary; nothing untrained lost its tokens.
    pruned = dict(store_rows(run, "SELECT id, step FROM groups WHERE pruned = 1"))
    assert pruned and all(consumed.get(i, -1) <= steps - 2 for i in pruned), pruned
    waiting = store_rows(
        run, "SELECT COUNT(*) FROM groups WHERE pruned = 1 AND state NOT IN ('consumed', 'stale', 'uninformative')"
    )
    assert waiting == [(0,)]
    states = dict(store_rows(run, "SELECT state, COUNT(*) FROM groups GROUP BY state"))
    assert set(states) <= {"consumed", "queued", "stale", "uninformative", "pending", "validating"}, states
    # The resumed trainer redid the steps after its checkpoint and got the same weights: every
    # version number still names one set of weights.
    assert "resuming from" in trainer.out().lower() or "resum" in trainer.out().lower(), trainer.out()[-2000:]
    assert "republishing v" not in trainer.out(), trainer.out()
    assert orch.log().count("orchestrator listening") == 2
    summary = json.loads((run / "trainer_summary.json").read_text())
    assert summary["accuracy_after"] is not None
