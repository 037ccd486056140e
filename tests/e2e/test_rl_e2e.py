"""End to end: `swarmrl rl` as a real user runs it (real processes, real files, real model).

A session fixture trains a tiny base on 1-digit addition (seconds), so these runs have signal
without paying for the default warm start. Each run costs most of a minute on 2 cores, so where
assertions can share a run they do (a test's docstring says which it carries).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from harness import RunHandle, metrics, pids, processes_of, run_store, store_rows, train_steps, wait_for
from hub_cache import lay_out, offline_env
from runs import EASY, swarmrl, swarmrl_rl


def test_rl_runs_end_to_end_over_tls_and_respects_the_bound(easy_base, tmp_path):
    """One run carries three tests' assertions (issue 27): the plain end-to-end checks, issue 18's
    run with every service on https (a CA made for the run; children trust it), and issue 52's
    model.path as a Hub id, resolved offline from a Hugging Face cache laid out from the base."""
    run, hub = tmp_path / "run", tmp_path / "hub"
    commit = lay_out(hub, "Org/EasyBase", easy_base)
    proc = swarmrl_rl(
        run,
        "Org/EasyBase",
        4,
        "--async.bound",
        "1",
        "--async.workers",
        "2",
        "--logging.plots",
        "true",
        "--async.tls",
        "true",
        # Patches for the tiny float32 model too (75% of a version: not worth it, but every hop is
        # exercised): the relay rebuilds each version from the one before, the workers likewise.
        "--broadcast.patches",
        "on",
        "--broadcast.patch_max_share",
        "1.0",
        *EASY,
        env=offline_env(hub),
    )
    # The id was pinned to the commit it resolved to, and every version signs it.
    assert f'path = "Org/EasyBase"\nrevision = "{commit}"' in (run / "config.toml").read_text()
    for manifest in (run / "broadcast").glob("v*/manifest.json"):
        assert json.loads(manifest.read_text())["source"] == {"hub_id": "Org/EasyBase", "revision": commit}
    summary = json.loads((run / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "steps", "wall_seconds", "max_off_policy"):
        assert key in summary, key
    assert summary["steps"] == 4 and summary["accuracy_after"] is not None
    # Weights went trainer (origin) -> relay -> workers, signed by the trainer's key, all over https.
    assert json.loads((run / "orchestrator.json").read_text())["url"].startswith("https://127.0.0.1:")
    assert json.loads((run / "origin.json").read_text())["url"].startswith("https://")
    relay_url = json.loads((run / "relays" / "relay-0.json").read_text())["url"]
    assert relay_url.startswith("https://127.0.0.1:")
    # v0 and at least one later version (the worker check below names one); not all five: the
    # trainer may take its last steps on data from v2 and exit before the relay polls again (a CI
    # run on machine E mirrored 3).
    assert (run / "logs" / "relay-0.log").read_text().count("relay: mirrored v") >= 2
    # Each later version reaches the workers as a patch against the one before, from the relay.
    assert all((run / "broadcast" / f"v{v:06d}" / "patch.bin").is_file() for v in range(1, 5))
    logs = "".join(p.read_text() for p in (run / "logs").glob("worker-*.log"))
    patched = rf"policy v[1-4] loaded .*installed from v00000[0-3] and a patch of .* from {relay_url}"
    assert re.search(patched, logs), logs
    relay_root = run / "relays" / "relay-0"
    assert any(relay_root.rglob("patch.bin")), "the relay did not keep the patches to serve them on"
    assert (run / "tls" / "ca.pem").exists() and "tls_cert" in (run / "config.toml").read_text()
    pub = (run / "trainer.pub").read_text().strip()
    manifest = json.loads((run / "broadcast" / "v000004" / "manifest.json").read_text())
    assert manifest["public_key"] == pub and manifest["version"] == 4 and manifest["parent"] == 3
    steps = train_steps(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["off_policy/max"] <= 1 for r in steps)
    for name in ("reward/mean", "time/step", "time/wait_for_batch", "loss/policy", "grad_norm"):
        assert all(name in r for r in steps), name
    # Held-out evaluation (step 0 and final) goes through `swarmrl eval`'s runner: avg@k and pass@k.
    evals = [r for r in metrics(run) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4]
    assert all(r["eval/pass@1"] == r["eval/accuracy"] and r["eval/problems"] == 8 for r in evals)  # k = 1
    # Every policy version is a complete HF folder; the newest one is the final policy.
    assert (run / "policies" / "v000004" / "config.json").exists()
    assert sorted(p.name for p in (run / "plots").glob("*.png")) == [
        "heldout_accuracy.png",
        "length.png",
        "reward.png",
        "step_time.png",
    ]
    assert (run / "checkpoints" / "step_000004" / "trainer.pt").exists()
    assert '"accuracy_after"' in proc.stdout
    assert processes_of(run) == []  # no process of the run is left behind


def test_a_synchronous_run_refuses_a_restart_and_resumes(easy_base, tmp_path):
    """One run carries three tests' assertions (issue 27): the synchronous bound (k = 0), starting
    over an existing run refused, and resuming it with a raised step budget."""
    run = tmp_path / "run"
    swarmrl_rl(
        run,
        easy_base,
        2,
        "--trainer.checkpoint_every",
        "1",
        "--async.bound",
        "0",
        # One worker, fetching from the origin (the resumed run keeps both, from config.toml):
        # two processes fewer in each of the two runs; relays and patches are the TLS run's.
        "--async.workers",
        "1",
        "--broadcast.relays",
        "0",
        *EASY,
    )
    steps = train_steps(run)
    assert len(steps) == 2 and all(r["off_policy/max"] == 0 for r in steps)
    # Starting over an existing run is refused, without a traceback, and names the way out.
    proc = swarmrl_rl(run, easy_base, 1, *EASY, check=False)
    assert proc.returncode == 2 and "--resume" in proc.stderr and "Traceback" not in proc.stderr
    # Raise the step budget in the run's own config, as a user extending a run would.
    cfg = (run / "config.toml").read_text().replace("steps = 2\n", "steps = 4\n", 1)
    (run / "config.toml").write_text(cfg)
    again = swarmrl("rl", "--run-dir", str(run), "--resume", *EASY)  # the run's config wins; no override needed
    assert "resumed" in (run / "logs" / "trainer.log").read_text()
    steps = train_steps(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4], steps
    assert all(r["off_policy/max"] == 0 for r in steps)  # the resumed run keeps its own bound
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert again.returncode == 0


def _start_long_run(easy_base: Path, run: Path) -> RunHandle:
    """A run far longer than the test, returned once its trainer has written metrics and the
    launcher has started the workers (after the relays). Its stderr is kept apart: the tests read it."""
    handle = RunHandle.rl(run, easy_base, 500, *EASY, stderr_log=run.with_name("rl.err")).start()
    handle.wait_for(
        lambda: (run / "metrics.jsonl").exists() and pids(f"cache-dir {run}/workers/worker-1"),
        120,
        "the trainer's first metrics and worker-1's process",
    )
    return handle


def test_a_dead_worker_stops_the_run_with_its_log(easy_base, tmp_path):
    run = tmp_path / "run"
    with _start_long_run(easy_base, run) as launcher:
        worker = pids(f"cache-dir {run}/workers/worker-0")
        assert worker, "worker not found"
        os.kill(int(worker[0]), signal.SIGKILL)
        code = launcher.wait(timeout=60)
    err = launcher.err()
    assert code == 2
    assert "worker-0 exited with code -9" in err and str(run / "logs" / "worker-0.log") in err
    assert processes_of(run) == []


def test_ctrl_c_stops_every_child(easy_base, tmp_path):
    run = tmp_path / "run"
    with _start_long_run(easy_base, run) as launcher:
        launcher.signal(signal.SIGINT)
        code = launcher.wait(timeout=60)
    assert code == 130
    assert "--resume" in launcher.out()
    assert processes_of(run) == []


def test_orchestrator_kill9_mid_run_loses_nothing_and_feeds_no_group_twice(easy_base, tmp_path):
    """Orchestrator, trainer and 2 workers as separate processes (as on separate machines);
    the orchestrator is killed with SIGKILL mid-run and restarted on the same port."""
    import shutil

    from swarmrl.config import load_config

    from orchestrator_harness import OrchestratorProcess

    run = tmp_path / "run"
    run.mkdir()
    steps = 8
    cfg = load_config(None, [*EASY, "--trainer.steps", str(steps), "--run_dir", str(run)])
    (run / "config.toml").write_text(cfg.to_toml())
    shutil.copytree(easy_base, run / "policies" / "v000000")
    orch = OrchestratorProcess(run).start()
    with ExitStack() as stack:
        stack.callback(orch.stop)
        trainer = stack.enter_context(RunHandle("trainer", "--run-dir", str(run), log=run / "trainer.log"))
        roles = [trainer]
        for i in range(2):
            worker_args = ("--key-file", str(run / f"w{i}" / "key.pem"), "--cache-dir", str(run / f"w{i}"))
            worker = RunHandle(
                "worker", "--orchestrator", orch.url, *worker_args, "--name", f"w{i}", log=run / f"w{i}.log"
            )
            roles.append(stack.enter_context(worker))

        def three_steps() -> bool:
            assert all(r.alive for r in roles), trainer.out()
            return len(train_steps(run)) >= 3

        wait_for(three_steps, 180, "3 trainer steps", log=trainer.out)
        orch.kill9()
        time.sleep(1.0)
        orch.start()
        assert trainer.wait(timeout=240) == 0, trainer.out()
        for w in roles[1:]:
            assert w.wait(timeout=60) == 0  # workers leave once the run is finished
    assert [r["step"] for r in train_steps(run)] == list(range(1, steps + 1))
    trained = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(steps))
    batches = dict(store_rows(run, "SELECT step, group_ids FROM batches"))
    all_ids = []
    for t in trained:
        assert json.loads(batches[t["step"]]) == t["group_ids"]  # the trainer got exactly the recorded batch
        all_ids += t["group_ids"]
    assert len(all_ids) == len(set(all_ids))  # no group fed two steps
    consumed = dict(store_rows(run, "SELECT id, step FROM groups WHERE state = 'consumed'"))
    assert sorted(consumed) == sorted(all_ids)
    assert all(consumed[i] == t["step"] for t in trained for i in t["group_ids"])
    with run_store(run) as store, store.read() as db:
        states = store.group_state_counts(db)
    # Groups that arrived after the last batch was built may still wait for the validator when the
    # run ends (seen under a loaded machine): they are not lost, only never needed.
    assert set(states) <= {"consumed", "queued", "stale", "uninformative", "pending", "validating"}
    assert "orchestrator listening" in orch.log() and orch.log().count("orchestrator listening") == 2


def test_adversarial_workers_are_banned_and_none_of_their_work_is_trained(easy_base, tmp_path):

    run = tmp_path / "run"
    kinds = ["cherry_pick", "edit_tokens", "other_model"]
    proc = swarmrl_rl(
        run,
        easy_base,
        8,
        "--async.adversaries",
        ",".join(kinds),
        "--validator.ban_after",
        "2",
        *EASY,
        timeout=600,
    )
    workers = {
        key: (name, banned, fraud)
        for key, name, banned, fraud in store_rows(run, "SELECT key, name, banned, fraud FROM workers")
    }
    bad = {k for k, (name, _, _) in workers.items() if name.startswith("adversary-")}
    good = set(workers) - bad
    assert len(bad) == 3 and len(good) == 2
    assert all(workers[k][1] == 1 for k in bad), workers  # every adversary banned ...
    assert all(workers[k][1] == 0 and workers[k][2] == 0 for k in good), workers  # ... no honest fraud
    # An honest worker may only be refused for being late (a loaded machine), never for its work.
    marks = ",".join("?" * len(good))
    honest = {
        r for (r,) in store_rows(run, f"SELECT DISTINCT reason FROM rejections WHERE worker IN ({marks})", tuple(good))
    }
    assert honest <= {"stale", "duplicate", "in_progress", "slot_closed"}, honest
    reasons = {
        name: r
        for name, r in store_rows(
            run,
            "SELECT workers.name, GROUP_CONCAT(DISTINCT rejections.reason) FROM rejections "
            "JOIN workers ON workers.key = rejections.worker WHERE workers.name LIKE 'adversary-%' "
            "AND rejections.reason NOT IN ('stale', 'duplicate', 'in_progress', 'slot_closed') GROUP BY workers.name",
        )
    }
    assert reasons == {
        "adversary-0-cherry_pick": "sampling",
        "adversary-1-edit_tokens": "sampling",
        "adversary-2-other_model": "toploc",
    }, reasons
    # Every adversary's group the trainer consumed passed the full check (their keys never earn a
    # clean streak); an honest worker's passed it or was sampled out once its streak was earned
    # (validation by reputation). An adversary's group can only be among them if it is token for
    # token what the lease's seeds give (a best-of-4 whose picks all equal the seeded samples, on
    # a confident model): honest work, whoever sent it.
    consumed = [
        gid for line in (run / "consumed.jsonl").read_text().splitlines() for gid in json.loads(line)["group_ids"]
    ]
    marks = ",".join("?" * len(consumed))
    rows = store_rows(run, f"SELECT worker, verdict FROM groups WHERE id IN ({marks})", tuple(consumed))
    assert len(rows) == len(consumed) and all(json.loads(v)["ok"] for _, v in rows if v is not None)
    assert all(v is not None for w, v in rows if w in bad)
    assert {w for w, _ in rows} & good
    for w, v in rows:
        if w in bad:
            assert json.loads(v)["stats"]["sampling_margin_max"] == 0.0
    assert not store_rows(run, "SELECT COUNT(*) FROM groups WHERE state = 'rejected' AND step IS NOT NULL")[0][0]
    # The terminal said who was banned and why; the metrics count it.
    for kind in kinds:
        assert f"banned: worker adversary-{kinds.index(kind)}-{kind}" in proc.stdout, proc.stdout
    last = train_steps(run)[-1]
    assert last["workers/banned"] == 3 and last["rejected/sampling"] >= 2 and last["rejected/toploc"] >= 2
    assert json.loads((run / "summary.json").read_text())["steps"] == 8


def test_a_trusted_endpoint_worker_trains_alongside_workers_that_prove(easy_base, tmp_path):
    """`async.endpoint_workers 1`: a trusted worker generating through its own `swarmrl serve`
    (reloaded with every version) next to a built-in worker, whose groups are still
    checked in full (docs/engines.md)."""

    from swarmrl.config import read_key_file

    run = tmp_path / "run"
    swarmrl_rl(
        run,
        easy_base,
        8,
        # One built-in worker holding one lease at a time: the endpoint worker starts after it (its
        # own `swarmrl serve` first), and in a CI run on machine E with two built-in workers none of
        # its groups was trained (most likely they had taken every step's work by then).
        "--async.workers",
        "1",
        "--orchestrator.max_open_leases",
        "1",
        "--async.endpoint_workers",
        "1",
        "--validator.trusted_rate",
        "0.5",
        "--validator.sampled_rate",
        "1",  # every proving worker's group fully checked: what this test compares the trusted key's with
        *EASY,
        timeout=600,
    )
    names = dict(store_rows(run, "SELECT key, name FROM workers"))
    trusted = read_key_file(run / "trusted_keys.txt")
    assert [names[k] for k in trusted] == ["worker-openai-0"] and len(names) == 2
    consumed = [
        gid for line in (run / "consumed.jsonl").read_text().splitlines() for gid in json.loads(line)["group_ids"]
    ]
    marks = ",".join("?" * len(consumed))
    rows = store_rows(
        run, f"SELECT worker, proofs, verdict, payload FROM groups WHERE id IN ({marks})", tuple(consumed)
    )
    mine = [r for r in rows if r[0] in trusted]
    theirs = [r for r in rows if r[0] not in trusted]
    # The endpoint worker's groups were trained on: no proofs, declared as the server's.
    assert mine and all(not any(json.loads(p)) and json.loads(g)["engine"] == "openai" for _, p, _, g in mine)
    # The built-in workers' groups all passed the full check (proofs, seeded sampling, logprobs).
    assert theirs and all(
        v is not None and json.loads(v)["ok"] and json.loads(v)["stats"]["chunks"] > 0 for _, _, v, _ in theirs
    )
    # Some of the endpoint worker's groups got the logprob check; none failed it; nobody was refused for fraud.
    checked = [
        json.loads(v)
        for (v,) in store_rows(
            run,
            f"SELECT verdict FROM groups WHERE verdict IS NOT NULL AND worker IN ({','.join('?' * len(trusted))})",
            tuple(trusted),
        )
    ]
    assert checked and all(v["ok"] and v["stats"]["chunks"] == 0 for v in checked)
    assert store_rows(run, "SELECT SUM(fraud) FROM workers")[0][0] == 0
    # Every new version went into the server through its reload endpoint.
    log = (run / "logs" / "worker-openai-0.log").read_text()
    assert log.count("loaded into http://127.0.0.1:") >= 2 and "this key is trusted" in log
    steps = train_steps(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert processes_of(run) == []


LORA_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def test_swarmrl_rl_with_lora_publishes_adapters_that_workers_use_and_the_validator_passes(easy_base, tmp_path):
    from swarmrl.protocol.manifest import content_digest

    run = tmp_path / "run"
    swarmrl_rl(
        run,
        easy_base,
        3,
        "--trainer.lora.rank",
        "8",
        "--trainer.lr",
        "1e-3",
        "--async.bound",
        "1",
        *EASY,
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["accuracy_after"] is not None
    m0 = json.loads((run / "broadcast" / "v000000" / "manifest.json").read_text())
    m3 = json.loads((run / "broadcast" / "v000003" / "manifest.json").read_text())
    assert "base" not in m0 and m3["base"] == {"version": 0, "digest": content_digest(m0)}
    assert sorted(f["name"] for f in m3["files"]) == LORA_FILES
    assert m0["total_size"] / m3["total_size"] >= 10, (m0["total_size"], m3["total_size"])
    assert sorted(p.name for p in (run / "policies" / "v000003").iterdir()) == LORA_FILES
    # Workers loaded adapter versions (merged into the base they hold) and their work passed.
    logs = (run / "logs" / "worker-0.log").read_text() + (run / "logs" / "worker-1.log").read_text()
    assert re.search(r"policy v[123] loaded", logs), logs
    verdicts = [json.loads(v) for (v,) in store_rows(run, "SELECT verdict FROM groups WHERE verdict IS NOT NULL")]
    versions = {v for (v,) in store_rows(run, "SELECT DISTINCT policy_version FROM groups")}
    assert verdicts and all(v["reason"] is None for v in verdicts), [v for v in verdicts if v["reason"]][:3]
    assert versions & {1, 2, 3}, versions  # adapter versions were sampled and validated, not only the base
    # The checkpoint holds the adapters, not the base.
    state = torch.load(run / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert state["model"] and all("lora_" in k for k in state["model"])
