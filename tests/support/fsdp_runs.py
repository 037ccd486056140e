"""The FSDP2 equivalence runs of tests/integration/test_fsdp.py, as a script:

    python tests/support/fsdp_runs.py trainer OUT
    python tests/support/fsdp_runs.py packing OUT BUDGET      (BUDGET 0: padded)
    python tests/support/fsdp_runs.py precision OUT [overrides]

    python tests/support/fsdp_runs.py all PREFIX BUDGET [precision overrides]

plain or under torchrun; each trains 2 steps of the tiny model and writes rank 0's results to OUT.
`all` runs the three in one process (one torchrun, one process group): PREFIX + trainer.pt,
packing.pt and precision.pt. Each run builds its model and batch from fixed seeds, so it does
what it would do in a process of its own; the test pays 4 process starts instead of 12.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from swarmrl.trainer.grpo import GRPOTrainer, init_distributed

from packed_batches import FSDP_BUDGET, FSDP_COMPLETIONS, random_groups  # noqa: F401
from packed_batches import make_batch as packing_batch
from packed_batches import make_cfg as packing_cfg
from tiny_trainer import SHAPE, make_model, prepare


def trainer_run(out: str) -> None:
    """Same model, same batch, 2 train_steps; rank 0 writes its full state dict and metrics.

    Between the steps it also writes a checkpoint, and a second trainer restored from it redoes
    step 2: the checkpoint round trip under FSDP2 (collective save, every rank loading).
    """
    torch.set_num_threads(1)
    dist_info = init_distributed()
    cfg, model, _, _, batch = prepare()
    trainer = GRPOTrainer(model, cfg, dist_info)
    ckpt = Path(out + ".ckpt")
    metrics = [trainer.train_step(batch)]
    save_checkpoint(trainer, ckpt, 1, {"world": dist_info.world_size})
    if dist_info.world_size > 1:
        torch.distributed.barrier()  # rank 0 writes alone; the others must not look too early
    metrics.append(trainer.train_step(batch))
    sd = trainer.full_state_dict()
    state, resumed_metrics, resumed = _redo_from(ckpt, cfg, dist_info, batch)
    assert state is not None and state["step"] == 1
    _write(dist_info, out, state=sd, metrics=metrics, resumed=resumed, resumed_metrics=resumed_metrics)


def packing_run(out: str, budget: int) -> None:
    torch.set_num_threads(1)
    dist_info = init_distributed()
    extra = ["--trainer.max_tokens_per_micro_batch", str(budget)] if budget else []
    cfg = packing_cfg("--trainer.optimizer_steps", "2", "--trainer.micro_batch_size", "2", *extra)
    model, _ = build_tiny_policy(0, **SHAPE)
    groups = random_groups(
        model, prompts=4, group_size=4, prompt_lens=(6, 6), completion_lens=FSDP_COMPLETIONS, seed=11
    )
    batch = packing_batch(groups, cfg)
    trainer = GRPOTrainer(model, cfg, dist_info)
    metrics = [trainer.train_step(batch), trainer.train_step(batch)]
    _write(dist_info, out, state=trainer.full_state_dict(), metrics=metrics)


def precision_run(out: str, overrides: list[str]) -> None:
    """2 train_steps; rank 0 writes the full float32 masters, the bf16 published weights, metrics
    and its optimizer state dtypes; then a checkpoint round trip redoes step 2."""
    torch.set_num_threads(1)
    dist_info = init_distributed("cpu")
    cfg, model, _, _, batch = prepare(*overrides)
    trainer = GRPOTrainer(model, cfg, dist_info)
    metrics = [trainer.train_step(batch)]
    masters_step1 = {k: v.clone() for k, v in (trainer.full_state_dict() or {}).items()}  # None off rank 0
    ckpt = Path(out + ".ckpt")
    save_checkpoint(trainer, ckpt, 1, {})
    if dist_info.world_size > 1:
        torch.distributed.barrier()
    metrics.append(trainer.train_step(batch))
    masters, published = trainer.full_state_dict(), trainer.full_state_dict(torch.bfloat16)
    opt_dtypes = sorted({str(v.dtype) for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"})
    param_dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    _, resumed_metrics, resumed = _redo_from(ckpt, cfg, dist_info, batch)
    _write(
        dist_info,
        out,
        masters=masters,
        masters_step1=masters_step1,
        published=published,
        metrics=metrics,
        opt_dtypes=opt_dtypes,
        param_dtypes=param_dtypes,
        resumed=resumed,
        resumed_metrics=resumed_metrics,
    )


def _redo_from(ckpt: Path, cfg, dist_info, batch) -> tuple[dict | None, dict, dict | None]:
    """A second trainer restored from `ckpt` redoes the next step: the checkpoint's state, that
    step's metrics and the full state dict after it (None off rank 0)."""
    fresh = GRPOTrainer(make_model()[0], cfg, dist_info)
    state = load_checkpoint(fresh, ckpt)
    return state, fresh.train_step(batch), fresh.full_state_dict()


def _write(dist_info, out: str, **results) -> None:
    """Rank 0 writes the results (and the world size); every rank then ends the run."""
    if dist_info.is_main:
        torch.save({**results, "world_size": dist_info.world_size}, out)
    _end_run(dist_info)


def _end_run(dist_info) -> None:
    """Every rank is done with the run (rank 0 has written its results) before the next run or
    the teardown: no rank tears gloo down, or starts another run's collectives, while another
    still talks to it."""
    if dist_info.world_size > 1:
        torch.distributed.barrier()


if __name__ == "__main__":
    kind, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if kind == "trainer":
        trainer_run(out)
    elif kind == "packing":
        packing_run(out, int(rest[0]))
    elif kind == "precision":
        precision_run(out, rest)
    elif kind == "all":
        trainer_run(out + "trainer.pt")
        packing_run(out + "packing.pt", int(rest[0]))
        precision_run(out + "precision.pt", rest[1:])
    else:
        sys.exit(f"usage: {sys.argv[0]} trainer|packing|precision|all OUT [...]")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Everything is written: skip the interpreter's teardown, where gloo's threads once aborted a
    # finished rank in CI ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
