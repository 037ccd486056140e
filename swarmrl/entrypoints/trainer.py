"""`swarmrl trainer`: one process, a node's ranks under torchrun, or one rank started by torchrun."""

from __future__ import annotations

import sys
from pathlib import Path

from swarmrl.entrypoints.common import CaFileSettings, fail, run_dir_config
from swarmrl.entrypoints.flags import flag

HELP = "The trainer role: pulls batches from the orchestrator, publishes policy versions (torchrun-able)."
DESCRIPTION = HELP + (
    " With trainer.nproc or trainer.nnodes above 1 in the run's config, it starts this node's ranks under "
    "torchrun (python -m torch.distributed.run) and waits for them; node 0 is the one that reaches the "
    "orchestrator and holds the run's files, every other node runs it with --node-rank and a copy of the run's "
    "config.toml and policies/v000000. Started by torchrun itself (python -m torch.distributed.run ... -m "
    "swarmrl.cli trainer ...), it is one rank. docs/deploy.md has the commands."
)
RUN_CONFIG = "run-dir"


class Settings(CaFileSettings):
    run_dir: str
    """the run directory (config.toml, policies/, checkpoints/)"""
    resume: bool = False
    """continue from the newest checkpoint (with several nodes, every node needs it)"""
    orchestrator: str | None = None
    """orchestrator URL (default: from <run-dir>/orchestrator.json)"""
    token_file: str | None = None
    """trainer bearer token (default: <run-dir>/trainer.token)"""
    node_rank: int = 0
    """which of the trainer.nnodes nodes this is (0: the one holding global rank 0)"""
    rank_logs: str | None = flag(None, metavar="DIR")
    """as a torchrun rank: write this rank's output to DIR/trainer-rank<RANK>.log"""


def _start_ranks(settings: Settings) -> None:
    """Outside torchrun: with several ranks in the run's config, start this node's under torchrun
    and exit with their status; with one, refuse a --node-rank and return (this process trains)."""
    from swarmrl.launch import torchrun

    config = Path(settings.run_dir) / "config.toml"
    cfg = run_dir_config(
        settings.run_dir,
        (
            f"{config} does not exist: prepare the run first (swarmrl rl --prepare --run-dir {settings.run_dir}), "
            "or on another trainer node copy config.toml and policies/v000000 there"
        ),
    )
    if torchrun.world_size(cfg) > 1:
        passed = ["--run-dir", settings.run_dir] + (["--resume"] if settings.resume else [])
        for name in ("orchestrator", "token_file", "ca_file"):  # rank 0 reaches the orchestrator
            value = getattr(settings, name)
            passed += ["--" + name.replace("_", "-"), value] if value else []
        try:
            code = torchrun.run_node(cfg, settings.run_dir, settings.node_rank, passed)
        except ValueError as e:
            fail(str(e))
        raise SystemExit(1 if code else 0)
    if settings.node_rank:
        fail(f"--node-rank {settings.node_rank}: the run's config has one trainer node (trainer.nnodes = 1)")


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.launch import torchrun

    if torchrun.under_torchrun():
        if settings.rank_logs:
            torchrun.redirect_rank_output(settings.rank_logs)
    else:
        _start_ranks(settings)
    from swarmrl.launch import fatal
    from swarmrl.trainer.loop import RunStopped, run_trainer

    try:
        run_trainer(
            settings.run_dir, resume=settings.resume, orchestrator=settings.orchestrator, token_file=settings.token_file
        )
    except FileNotFoundError as e:
        fail(str(e))
    except RunStopped as e:
        # Not a crash: `swarmrl rl` shows this message as it is, not a log tail.
        fatal.record(settings.run_dir, "trainer", str(e))
        fail(str(e))
    except (SystemExit, KeyboardInterrupt) as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        from swarmrl.trainer.checkpoint import checkpoint_dirs

        done = checkpoint_dirs(Path(settings.run_dir) / "checkpoints")
        where = f"its newest checkpoint is step {done[-1][0]}" if done else "it has no checkpoint yet (it starts over)"
        print(
            f"trainer stopped; {where}. Continue with: swarmrl trainer --run-dir {settings.run_dir} --resume "
            "(steps after the checkpoint are redone on the same batches)",
            file=sys.stderr,
            flush=True,
        )
        raise
