"""The processes `swarmrl rl` starts, as data (swarmrl/launch/plan.py): their order, what each waits
for, the URLs filled in at start (launcher.start_children), and what `--dry-run` prints of them."""

from __future__ import annotations

import json

from swarmrl.cli import main
from swarmrl.config import load_config
from swarmrl.launch.launcher import start_children
from swarmrl.launch.plan import ORCHESTRATOR, ORIGIN, children


def _plan(tmp_path, *flags: str):
    cfg = load_config(None, list(flags))
    return children(cfg, tmp_path, resume=False, serve_tls=[], newest=tmp_path / "policies" / "v000000")


def test_the_plan_starts_the_orchestrator_first_and_each_child_after_what_it_needs(tmp_path):
    plan = _plan(tmp_path, "--broadcast.relays", "2", "--async.endpoint_workers", "1", "--async.adversaries", "replay")
    names = [c.name for c in plan]
    assert names == [
        "orchestrator",
        "trainer",
        "worker-0",
        "worker-1",
        "serve-0",
        "worker-openai-0",
        "adversary-0",
        "relay-0",
        "relay-1",
    ]
    by = {c.name: c for c in plan}
    assert by["orchestrator"].ready == tmp_path / "orchestrator.json" and not by["orchestrator"].needs
    workers = [c for c in plan if c.args[:1] == ("worker",)]
    assert all(ORCHESTRATOR in c.args and c.needs[0].file == tmp_path / "orchestrator.json" for c in workers)
    # An endpoint worker waits for its own server's URL, which that server writes once it serves.
    endpoint = by["worker-openai-0"]
    assert endpoint.needs[1].file == by["serve-0"].ready and endpoint.needs[1].placeholder in endpoint.args
    # Relays follow the trainer's origin; workers learn them from the files the relays write.
    relays = [by["relay-0"], by["relay-1"]]
    assert all(ORIGIN in r.args and r.needs[0].file == tmp_path / "origin.json" for r in relays)
    files = by["worker-0"].args[by["worker-0"].args.index("--relay-files") + 1].split(",")
    assert files == [str(r.ready) for r in relays]


def test_a_resumed_run_resumes_the_orchestrator_and_the_trainer_only(tmp_path):
    plan = children(load_config(None, []), tmp_path, resume=True, serve_tls=[], newest=tmp_path)
    assert [c.name for c in plan if "--resume" in c.args] == ["orchestrator", "trainer"]


class _Recorder:
    """Children as start_children drives them: each start recorded; a waited-for file is written
    as the child that serves it would."""

    def __init__(self):
        self.started: list[tuple[str, list[str]]] = []

    def start(self, name, args, threads, nice=0, **_):
        self.started.append((name, list(args)))

    def place_later(self, name, cpus):
        pass

    def wait_for_file(self, path, timeout_s=120.0):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"url": f"http://{path.stem}"}))


def test_start_fills_in_each_url_and_drops_files_of_an_earlier_start(tmp_path):
    plan = _plan(tmp_path, "--broadcast.relays", "1")
    stale = tmp_path / "orchestrator.json"
    stale.write_text(json.dumps({"url": "http://stale"}))  # an earlier start listened elsewhere
    rec, said = _Recorder(), []
    start_children(rec, plan, said.append)
    assert [n for n, _ in rec.started] == [c.name for c in plan]
    args = dict(rec.started)
    assert args["worker-0"][args["worker-0"].index("--orchestrator") + 1] == "http://orchestrator"
    assert args["relay-0"][args["relay-0"].index("--upstream") + 1] == "http://origin"
    assert "orchestrator: http://orchestrator" in said and "relay-0: http://relay-0" in said


def test_dry_run_prints_the_processes_after_the_config(capsys, tmp_path):
    main(["rl", "--dry-run", "--run-dir", str(tmp_path / "run"), "--broadcast.relays", "1"])
    out = capsys.readouterr().out
    head, _, tail = out.partition("# The processes it would start, in this order:\n")
    assert "[sampling]" in head and tail, out
    lines = [line.strip("# ").split(":")[0] for line in tail.strip().splitlines()]
    assert lines == ["orchestrator", "trainer", "worker-0", "worker-1", "relay-0"]
    assert f"swarmrl orchestrator --run-dir {tmp_path / 'run'}" in tail


def test_the_workers_get_the_runs_plugins_engine_and_its_options_as_flags(tmp_path):
    plan = _plan(tmp_path, "--async.worker_engine", "vllm", "--async.worker_engine_options", "{kv_cache_gib = 2}")
    worker = next(c for c in plan if c.name == "worker-0")
    at = worker.args.index("--engine")
    assert worker.args[at : at + 4] == ("--engine", "vllm", "--vllm-kv-cache-gib", "2.0")
    # The default engine without options adds nothing; the run's plug-ins go first, before any flag.
    (worker,) = [c for c in _plan(tmp_path, "--plugins", '["tomli_w"]') if c.name == "worker-0"]
    assert "--engine" not in worker.args and worker.args[:3] == ("worker", "--plugin", "tomli_w")


def test_an_engine_without_proofs_or_with_bad_options_is_refused_before_anything_starts(tmp_path):
    import pytest

    from swarmrl.config import ConfigError
    from swarmrl.launch.launcher import _preflight

    for flags, needle in [
        (("--async.worker_engine", "openai"), "builds no proofs"),
        (("--async.worker_engine", "nope"), "no engine backend named 'nope'"),
        (("--async.worker_engine", "vllm", "--async.worker_engine_options", "{kv_cache_gib = 0}"), "kv_cache_gib"),
        (("--async.worker_engine_options", "{x = 1}"), "async.worker_engine_options for engine 'builtin'"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            _preflight(load_config(None, list(flags)))


def test_tensorboard_without_its_package_is_refused_before_anything_starts(monkeypatch):
    import sys

    import pytest

    from swarmrl.launch.progress import check_tensorboard

    cfg = load_config(None, ["--logging.tensorboard", "true"])
    check_tensorboard(cfg)  # installed here (the dev extra)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not
    with pytest.raises(ValueError, match="needs the tensorboard package: pip install tensorboard"):
        check_tensorboard(cfg)
