"""Resumable trainer checkpoints: model, optimizer, scheduler, step, RNG and run position.

Full (unsharded) state dicts are written by rank 0 and read by every rank, through
torch.distributed.checkpoint's state-dict helpers, which handle plain and FSDP2-sharded modules
alike. They hold the optimizer's own weights and state: float32 masters under mixed precision
(`trainer.precision`; published versions are cast, checkpoints never), and plain HF key names
under activation checkpointing (the wrapper's prefix is stripped). A checkpoint folder is
renamed into place only when complete, so `--resume` after a kill finds either the previous
checkpoint or this one, never half of one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"^step_(\d{6})$")


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.exists():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))


def _trainable_keys(model) -> set[str]:
    """State-dict names of the parameters that train (the activation-checkpoint wrapper's part of
    the name dropped, as DCP's helpers drop it)."""
    return {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(trainer, root: Path, step: int, extra: dict, *, keep: int = 2) -> Path | None:
    """`step` = rollout steps completed. Collective under FSDP2: every rank must call it."""
    # Under trainer.lora only the adapters train: the frozen base is policy version 0, not saved again.
    lora = getattr(trainer, "lora", False)
    model_sd, optim_sd = get_state_dict(
        trainer.model,
        trainer.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora),
    )
    if lora:  # DCP keeps a tied frozen weight (lm_head = embeddings) anyway: the adapters only
        model_sd = {k: v for k, v in model_sd.items() if k in _trainable_keys(trainer.model)}
    if trainer.dist.rank != 0:
        return None
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    torch.save(
        {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": trainer.scheduler.state_dict(),
            "step": step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "extra": extra,
        },
        tmp / "trainer.pt",
    )
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(trainer, root: Path) -> dict | None:
    """Restore the newest checkpoint into `trainer`; returns its record or None if none exists."""
    found = checkpoint_dirs(root)
    if not found:
        return None
    _, path = found[-1]
    state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    lora = getattr(trainer, "lora", False)
    if lora:
        # A LoRA checkpoint holds the adapters only (the base is policy version 0): exactly this
        # trainer's adapters, or nothing is loaded (not strict below, for the absent base weights).
        want = _trainable_keys(trainer.model)
        if set(state["model"]) != want:
            odd = sorted(set(state["model"]) ^ want)[:3]
            raise ValueError(
                f"{path} does not match this trainer's LoRA adapters (differing tensors: {odd}...): it "
                "was written with other trainer.lora settings, or without LoRA. Resume with the settings "
                "it was written with, or start a new run"
            )
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=True, strict=not lora),
    )
    trainer.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if dist.is_initialized():
        dist.barrier()
    return state
