"""Several trainer ranks from `swarmrl rl` (torchrun + FSDP2 over gloo): what is checked before
any rank starts, and how a failure is reported. The runs themselves: tests/e2e/test_multirank_runs.py.

- Config: a world size that does not divide the mini-batch, several nodes without a rendezvous
  endpoint and the like fail at load time, naming the field, before any process starts.
"""

from __future__ import annotations

import re

import pytest
import torch

from runs import EASY, swarmrl

# ---------------------------------------------------------------------------- config (fast)


def test_a_world_size_that_does_not_split_the_mini_batch_fails_at_load():
    from swarmrl.config import ConfigError, load_config

    # EASY: 4 prompts x 4 completions / 2 optimizer steps = 8 sequences per optimizer step.
    load_config(None, [*EASY, "--trainer.nproc", "4"])
    load_config(None, [*EASY, "--trainer.nproc", "2", "--trainer.nnodes", "4", "--trainer.rdzv_endpoint", "h:29500"])
    with pytest.raises(ConfigError) as e:
        load_config(None, [*EASY, "--trainer.nproc", "3"])
    assert "trainer.nproc=3" in str(e.value) and "8 sequences" in str(e.value) and "1, 2, 4, 8" in str(e.value)
    with pytest.raises(ConfigError, match=r"trainer.nproc=2 x trainer.nnodes=3"):
        load_config(None, [*EASY, "--trainer.nproc", "2", "--trainer.nnodes", "3", "--trainer.rdzv_endpoint", "h:1"])


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["--trainer.nnodes", "2"], "trainer.rdzv_endpoint"),
        (["--trainer.rdzv_endpoint", "node0"], "trainer.rdzv_endpoint"),
        (["--trainer.rdzv_endpoint", "node0:99999"], "trainer.rdzv_endpoint"),
        (["--trainer.nproc", "2", "--model.device", "cuda:1"], "model.device"),
        (["--trainer.nproc", "0"], "trainer.nproc"),
    ],
)
def test_settings_that_cannot_work_fail_at_load_naming_the_field(overrides, field):
    from swarmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, [*EASY, *overrides])
    load_config(None, [*EASY, "--trainer.rdzv_endpoint", "[fd00::1]:29500"])  # IPv6 is fine


def test_swarmrl_rl_refuses_before_starting_anything(tmp_path):
    run = tmp_path / "run"
    proc = swarmrl("rl", "--run-dir", str(run), "--trainer.nproc", "3", *EASY, check=False, timeout=60)
    assert proc.returncode == 2 and "trainer.nproc=3" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()
    # More CUDA ranks than this machine has GPUs: refused before the base is built or anything starts.
    n = max(2, torch.cuda.device_count() + 1)
    proc = swarmrl(
        "rl", "--run-dir", str(run), "--trainer.nproc", str(n), "--model.device", "cuda", *EASY, check=False, timeout=60
    )
    assert proc.returncode == 2 and f"trainer.nproc={n}" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()


def test_torchrun_failure_summary_names_the_killed_rank(tmp_path):
    """The summary torchrun prints is parsed from torch's own formatter; a rank killed by a signal
    is the cause even when torchrun's "root cause" (same-second timestamps) is a bystander."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    from swarmrl.launch import torchrun

    logs = tmp_path / "logs"
    logs.mkdir()
    torchrun.rank_log(logs, 0).write_text("RuntimeError: Connection closed by peer\n")
    torchrun.rank_log(logs, 1).write_text("trainer rank 1 of 2\n")
    failures = {0: ProcessFailure(0, 101, 1, "/nonexistent"), 1: ProcessFailure(1, 102, -9, "/nonexistent")}
    (logs / "trainer.log").write_text(ChildFailedError("swarmrl.cli", failures).format_msg())
    assert sorted(torchrun.rank_failures((logs / "trainer.log").read_text())) == [(0, 1), (1, -9)]
    why = torchrun.describe_failure(logs / "trainer.log", logs)
    assert why.startswith(f"trainer rank 1 exited with signal 9 (SIGKILL); its log is {logs / 'trainer-rank1.log'}")
    assert "then: rank 0 (code 1" in why


def test_the_torchrun_command_for_a_second_node():
    from swarmrl.config import load_config
    from swarmrl.launch import torchrun

    cfg = load_config(
        None, [*EASY, "--trainer.nproc", "2", "--trainer.nnodes", "2", "--trainer.rdzv_endpoint", "10.0.0.1:29500"]
    )
    cmd = torchrun.torchrun_command(cfg, node_rank=1, trainer_args=["--run-dir", "r"], log_dir="r/logs")
    text = " ".join(cmd)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    for part in (
        "--nnodes 2",
        "--nproc-per-node 2",
        "--node-rank 1",
        "--master-addr 10.0.0.1",
        "--master-port 29500",
        "--max-restarts 0",
        "-m swarmrl.cli trainer --run-dir r --rank-logs r/logs",
    ):
        assert part in text, part
    assert torchrun.rank_env(cfg)["SWARMRL_BACKEND"] == "gloo"  # CPU trainer: gloo even where CUDA exists
