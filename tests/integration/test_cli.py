"""Tests for the `swarmrl` command, run as `python -m swarmrl.cli` subprocesses.

Only the fast paths: help, dry runs, config errors, `tasks` and `score` on tiny files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from swarmrl.cli import COMMANDS
from swarmrl.config import load_config
from swarmrl.validator.calibrate import CHEATS

ROOT = Path(__file__).resolve().parents[2]
SEED_TOML = ROOT / "configs" / "intellect2-qwq32b.toml"


def swarmrl(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def assert_clean_failure(proc: subprocess.CompletedProcess, *needles: str, code: int | None = 2) -> None:
    assert proc.returncode != 0, proc
    if code is not None:
        assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def test_a_swarmrl_error_a_role_does_not_catch_is_one_line_without_a_traceback(tmp_path):
    # An AssetError (a SwarmrlError) that `swarmrl assets` leaves to swarmrl.cli.main (issue 51).
    proc = swarmrl("assets", "--gguf", "nope.gguf", "--output", "out", cwd=tmp_path)
    assert_clean_failure(proc, "nope.gguf does not exist: pass the path of a .gguf file")
    assert proc.stderr == "swarmrl: error: nope.gguf does not exist: pass the path of a .gguf file\n", proc.stderr
    assert not (tmp_path / "out").exists()


def test_help_lists_every_command(tmp_path):
    proc = swarmrl("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert set(COMMANDS) == {
        "rl",
        "sft",
        "score",
        "tasks",
        "filter",
        "orchestrator",
        "trainer",
        "worker",
        "validator",
        "relay",
        "serve",
        "eval",
        "status",
        "assets",
        "calibrate",
    }
    for name, text in COMMANDS.items():
        assert re.search(rf"^\s+{name}\s", proc.stdout, re.M), f"{name} missing from --help:\n{proc.stdout}"
        assert " ".join(text.split()[:3]) in " ".join(proc.stdout.split())


def _model_folder(path: Path) -> Path:
    from swarmrl.model.checkpoint import build_tiny_policy, save_policy

    model, tok = build_tiny_policy(seed=0)
    save_policy(model, tok, path)
    return path


def test_a_bf16_run_on_its_own_model_without_a_calibration_refuses_to_start(tmp_path):
    model = _model_folder(tmp_path / "model")
    proc = swarmrl("rl", "--model.path", str(model), "--sampling.dtype", "bfloat16", "--run-dir", "run", cwd=tmp_path)
    assert_clean_failure(
        proc, "validator.limits_file is not set", f"swarmrl calibrate --model {model} --dtype bfloat16"
    )
    assert not (tmp_path / "run" / "config.toml").exists()  # refused before anything was written


def test_a_limits_file_for_another_model_or_dtype_is_refused_at_start(tmp_path):
    model = _model_folder(tmp_path / "model")
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"format": "swarmrl-limits/1", "dtype": "bfloat16", "model": {"digest": "0" * 64}}))
    common = ("rl", "--model.path", str(model), "--validator.limits_file", str(limits))
    proc = swarmrl(*common, "--sampling.dtype", "bfloat16", "--run-dir", "a", cwd=tmp_path)
    assert_clean_failure(proc, "calibrated on another model", "run swarmrl calibrate on this model")
    proc = swarmrl(*common, "--run-dir", "b", cwd=tmp_path)
    assert_clean_failure(proc, "calibrated for bfloat16 but this run samples in float32")


def test_no_command_is_an_error(tmp_path):
    proc = swarmrl(cwd=tmp_path)
    assert_clean_failure(proc, "COMMAND")


def test_rl_dry_run_prints_toml_with_overrides(tmp_path):
    overrides = ["--trainer.lr", "3e-6", "--async.bound=0", "--tasks.source", "data/x.jsonl"]
    proc = swarmrl("rl", "--dry-run", *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    assert printed["trainer"]["lr"] == pytest.approx(3e-6)
    assert printed["async"]["bound"] == 0
    assert printed["tasks"]["source"] == "data/x.jsonl"
    assert printed["sampling"]["group_size"] == 8  # untouched default
    # Exactly the resolved config, nothing missing.
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(proc.stdout)
    assert load_config(dumped) == load_config(None, overrides)
    assert not (tmp_path / "runs").exists()  # a dry run starts nothing
    # Fields whose default is None are listed too (issue 18: the README sets trainer.weights_url,
    # which the dry run never showed).
    assert "# trainer.weights_url =" in proc.stdout and "# model.path =" in proc.stdout


def test_rl_dry_run_with_config_file_and_run_dir(tmp_path):
    proc = swarmrl(
        "rl", "--config", str(SEED_TOML), "--run-dir", "myrun", "--dry-run", "--trainer.lr", "1e-6", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    assert printed["run_dir"] == "myrun"
    assert printed["sampling"]["group_size"] == 16
    assert printed["trainer"]["lr"] == pytest.approx(1e-6)
    assert not (tmp_path / "myrun").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--trainer.lr", "fast"], ["trainer.lr", "valid number"]),
        (["--length.mode", "sometimes"], ["length.mode", "'exact', 'max' or 'clip'"]),
        (["--trainer.lrr", "1"], ["trainer.lrr", "allowed", "warmup_steps"]),
        (["--algorithm.tis_cap", "0"], ["algorithm.tis_cap", "greater than 0"]),
        (["--algorithm.tis_level", "group"], ["algorithm.tis_level", "'token' or 'sequence'"]),
        (["--algorithm.tis_cap", "2", "--algorithm.old_logprobs", "inference"], ["tis_cap", "recompute"]),
        (
            ["--algorithm.tis_cap", "off", "--algorithm.tis_mask_band", "2"],
            ["tis_mask_band", "needs algorithm.tis_cap"],
        ),
    ],
)
def test_bad_override_exits_2_without_traceback(tmp_path, args, needles):
    proc = swarmrl("rl", "--dry-run", *args, cwd=tmp_path)
    assert_clean_failure(proc, *needles)
    assert proc.stdout == ""


def test_unknown_argument_for_other_commands(tmp_path):
    proc = swarmrl("tasks", "--output", "x.jsonl", "--trainer.lr", "1", cwd=tmp_path)
    assert_clean_failure(proc, "unrecognized arguments")
    assert not (tmp_path / "x.jsonl").exists()


def test_tasks_writes_valid_rows(tmp_path):
    out = tmp_path / "sub" / "f.jsonl"
    proc = swarmrl("tasks", "--output", str(out), "--n", "50", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "50" in proc.stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 50
    rows = [json.loads(line) for line in lines]
    assert len({r["problem_id"] for r in rows}) == 50
    for row in rows:
        assert row["task_type"] == "verifiable_math"
        a, op, b = re.fullmatch(r"Compute (\d+) ([+-]) (\d+)\.", row["prompt"]).groups()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99  # --digits defaults to 2
        truth = json.loads(row["verification_info"])["ground_truth"]
        assert int(truth) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_tasks_rejects_impossible_requests(tmp_path):
    proc = swarmrl("tasks", "--output", "x.jsonl", "--n", "500", "--digits", "1", cwd=tmp_path, timeout=60)
    assert_clean_failure(proc, "distinct")
    proc = swarmrl("tasks", "--output", "x.jsonl", "--ops", "*", cwd=tmp_path, timeout=60)
    assert_clean_failure(proc, "ops")
    assert not (tmp_path / "x.jsonl").exists()


def _row(pid: str, completion: str, verification_info: str = json.dumps({"ground_truth": "46"})) -> str:
    return json.dumps(
        {
            "problem_id": pid,
            "task_type": "verifiable_math",
            "prompt": "Compute 12 + 34.",
            "verification_info": verification_info,
            "completion": completion,
        }
    )


def test_score_file(tmp_path):
    lines = [
        _row("right", "<think>2+4=6\n1+3=4</think>\n\\boxed{46}"),
        _row("wrong", "<think>2+4=6\n1+3=5</think>\n\\boxed{56}"),
        _row("unclosed", "<think>2+4=6\n1+3=4 \\boxed{46}"),
        _row("malformed", "\\boxed{46}", verification_info="{ground_truth: 46"),
        "this line is not JSON",
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = swarmrl("score", "--input", str(inp), "--output", str(out), "--workers", "1", cwd=tmp_path)
    # Two rows could not be scored: exit 1, saying which and why (issue 18: it exited 0).
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "2 of 5 rows could not be scored" in proc.stderr and "line 4" in proc.stderr
    assert "--allow-errors" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(lines)
    assert [r.get("problem_id") for r in rows] == ["right", "wrong", "unclosed", "malformed", None]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [r["error"] is None for r in rows] == [True, True, True, False, False]
    assert "verification_info" in rows[3]["error"]
    assert rows[4]["line"] == 5 and "JSON" in rows[4]["error"]
    assert "think" in (rows[2]["reason"] or "")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 5 and summary["scored"] == 3 and summary["errors"] == 2
    assert summary["mean_reward"] == pytest.approx(1 / 3) and summary["mean_reward_all_rows"] == pytest.approx(1 / 5)
    assert [e["line"] for e in summary["first_errors"]] == [4, 5]
    again = swarmrl(
        "score", "--input", str(inp), "--output", str(out), "--workers", "1", "--allow-errors", cwd=tmp_path
    )
    assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1]) == summary


def test_score_missing_input(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = swarmrl(
        "score", "--input", str(tmp_path / "nope.jsonl"), "--output", str(out), "--workers", "1", cwd=tmp_path
    )
    assert_clean_failure(proc, "nope.jsonl", "does not exist", code=None)
    assert not out.exists()


def test_service_urls_that_cannot_work_fail_at_start(tmp_path):
    # Issue 18: a URL without a scheme was retried forever; one ending in /v1 exited with a bare 404.
    proc = swarmrl("worker", "--orchestrator", "127.0.0.1:8000", cwd=tmp_path)
    assert_clean_failure(proc, "--orchestrator '127.0.0.1:8000' has no scheme", "http://127.0.0.1:8000")
    proc = swarmrl("validator", "--orchestrator", "ftp://host:1", "--token-file", "t", cwd=tmp_path)
    assert_clean_failure(proc, "must be http or https")
    proc = swarmrl("relay", "--upstream", "http://ok:1,bad:2", "--cache-dir", str(tmp_path / "c"), cwd=tmp_path)
    assert_clean_failure(proc, "--upstream 'bad:2' has no scheme")
    proc = swarmrl("worker", "--orchestrator", "http://127.0.0.1:9", "--streams", "0", cwd=tmp_path)
    assert_clean_failure(proc, "--streams 0: give at least 1 decoding stream")
    proc = swarmrl("worker", "--orchestrator", "http://127.0.0.1:9", "--streams", "2", "--device", "cuda", cwd=tmp_path)
    assert_clean_failure(proc, "--streams 2 is for CPU workers", "drop --streams")


def test_service_url_rules_and_retry_messages(monkeypatch):
    from swarmrl.protocol import client

    assert client.service_url("http://h:8000/v1/") == "http://h:8000"  # the OpenAI form, accepted
    assert client.service_url(" https://h/ ") == "https://h"
    with pytest.raises(ValueError, match="no scheme"):
        client.service_url("h:8000")
    # A long outage is reported every 30 s, not only at its start, and its end is said.
    clock = [0.0]
    monkeypatch.setattr(client.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(client.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    failures = iter(range(40))

    def call():
        if next(failures) < 39:
            raise client.Unavailable("connection refused")
        return "ok"

    lines = []
    assert client.retrying(call, what="lease", give_up_s=600, log=lines.append) == "ok"
    assert clock[0] > 150  # 39 tries, backing off up to 5 s
    retried = [line for line in lines if "retrying" in line]
    assert 5 <= len(retried) <= 7 and all("giving up after 600 s" in line for line in retried), lines  # ~176 s / 30
    assert "reached again" in lines[-1]


def test_two_workers_cannot_share_a_cache_folder(tmp_path):
    # Issue 18: two workers started from the README shared one cache folder and outbox. Now the
    # default folder is per key file, and a folder in use is refused.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time; os.makedirs(sys.argv[1], exist_ok=True); f = open(sys.argv[1] + '/.lock', 'a+');"  # noqa: E501
                "fcntl.flock(f, fcntl.LOCK_EX); f.write('worker pid 4242'); f.flush(); print('held', flush=True); time.sleep(60)"  # noqa: E501
            ),
            str(tmp_path / "shared"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = swarmrl(
            "worker", "--orchestrator", "http://127.0.0.1:9", "--cache-dir", str(tmp_path / "shared"), cwd=tmp_path
        )
        assert_clean_failure(proc, "is in use by worker pid 4242", "give each worker its own --cache-dir")
    finally:
        holder.kill()
        holder.wait()
    help_text = swarmrl("worker", "--help", cwd=tmp_path).stdout
    assert "<key file name>" in help_text


def test_a_stopped_trainer_says_how_to_resume_and_resume_drops_redone_rows(tmp_path):
    # Issue 18: SIGTERM to the trainer printed nothing, and after --resume metrics.jsonl and
    # consumed.jsonl listed the redone steps twice.
    import signal
    import time

    from orchestrator_harness import make_run_dir

    run = make_run_dir(tmp_path / "run")
    (tmp_path / "tok").write_text("x")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmrl.cli",
            "trainer",
            "--run-dir",
            str(run),
            "--orchestrator",
            "http://127.0.0.1:9",
            "--token-file",
            str(tmp_path / "tok"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    line = ""
    while "retrying" not in line:  # it is up and waiting for the (absent) orchestrator
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        line = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert "it has no checkpoint yet" in err and f"swarmrl trainer --run-dir {run} --resume" in err

    from swarmrl.trainer.loop import _forget_after
    from swarmrl.transport.filesystem import RunDir

    rows = [
        {"step": 0, "eval/accuracy": 0.1},
        *({"step": s, "reward/mean": 0.5} for s in (1, 2, 3, 4)),
        {"step": 4, "final": True},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "consumed.jsonl").write_text("".join(json.dumps({"step": s, "group_ids": [s]}) + "\n" for s in range(4)))
    _forget_after(RunDir(run), 2)  # resumed from the checkpoint at step 2: steps 3 and 4 are redone
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert [json.loads(x)["step"] for x in (run / "consumed.jsonl").read_text().splitlines()] == [0, 1]


def test_prepare_says_what_to_start_next():
    # Issue 18: `swarmrl rl --prepare` said only "start the roles on it".
    from swarmrl.launch.launcher import prepared_next_steps

    text = prepared_next_steps(
        load_config(None, ["--validator.mode", "external", "--trainer.steps", "7"]), Path("runs/x")
    )
    order = [text.index(f"swarmrl {role}") for role in ("orchestrator", "trainer", "relay", "worker", "validator")]
    assert order == sorted(order) and "7 steps" in text and "runs/x/validator.token" in text
    inline = prepared_next_steps(load_config(None, []), Path("runs/x"))
    assert "swarmrl validator --orchestrator" not in inline and "--validator.mode external" in inline
    assert "swarmrl status" in inline


def test_calibrate_writes_a_limits_file_a_run_accepts(tmp_path):
    model = _model_folder(tmp_path / "model")
    tasks = swarmrl("tasks", "--output", "tasks.jsonl", "--n", "50", cwd=tmp_path)
    assert tasks.returncode == 0, tasks.stderr
    args = ("--model", str(model), "--prompts", "tasks.jsonl", "--groups", "8", "--cheat-groups", "2")
    proc = swarmrl("calibrate", *args, "--group-size", "2", "--max-new-tokens", "8", "--out", "l.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "engine builtin: 8 honest groups" in proc.stdout and "set validator.limits_file" in proc.stdout
    data = json.loads((tmp_path / "l.json").read_text())
    assert data["dtype"] == "bfloat16" and set(data["engines"]) == {"builtin"}
    assert set(data["measured"]["cheats"]) == set(CHEATS) and "previous_version" in CHEATS  # the whole catalogue
    assert data["engines"]["builtin"]["cheats"]["previous_version"].get("informational") or (
        data["engines"]["builtin"]["cheats"]["previous_version"]["refused_by_limits"] == 2
    )
    # A run on this model takes it (the preparation checks it); from 8 honest groups the engine may
    # well be refused (too few to bound honest work's tail), and then the run says so and stops.
    common = ("rl", "--prepare", "--model.path", str(model), "--sampling.dtype", "bfloat16",
              "--validator.limits_file", "l.json", "--sampling.group_size", "2")  # fmt: skip
    other = swarmrl(*common, "--run-dir", "other", cwd=tmp_path)  # 64 tokens: not what was measured
    assert_clean_failure(other, "max_new_tokens 8 (this run: 64)", "--max-new-tokens 64")
    prep = swarmrl(*common, "--sampling.max_new_tokens", "8", "--run-dir", "run", cwd=tmp_path)
    if data["engines"]["builtin"].get("refused"):
        assert_clean_failure(prep, "accepts no engine", "its honest groups overlap the cheats'")
    else:
        assert prep.returncode == 0, prep.stderr
    bad = swarmrl("calibrate", "--model", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert_clean_failure(bad, "--model", "no such folder")
