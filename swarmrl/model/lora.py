"""LoRA through peft, on the trainer's side: wrap the policy, check the target modules, write
adapter-only policy versions.

With `trainer.lora.rank` > 0 the base (policy version 0) stays frozen and the trainer trains
peft LoRA adapters on `trainer.lora.target_modules`. Every later version is the adapter alone, in
peft's own format (`adapter_config.json` + `adapter_model.safetensors`, loadable by
`PeftModel.from_pretrained` or vLLM's LoRA support), so what crosses the network per step is the
adapter, not the model. Receivers merge it into the base they hold (`checkpoint.load_policy`), so
the built-in engine, TOPLOC proofs and seeded sampling see plain weights. The broadcast manifest
of an adapter version names its base by content digest (swarmrl/protocol/manifest.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from swarmrl.config import Config, LoRAConfig
from swarmrl.model.checkpoint import ADAPTER_WEIGHTS, atomic_folder, tiny_qwen2_config
from swarmrl.model.hub import resolve
from swarmrl.model.tokenizer import build_char_tokenizer

FIELD = "trainer.lora.target_modules"


def linear_names(model: torch.nn.Module) -> list[str]:
    """The names LoRA may target here: the last part of every linear layer's module name
    (torch Linear, or transformers' Conv1D, GPT-2's linear layers)."""
    from transformers.pytorch_utils import Conv1D

    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    )


def check_targets(model: torch.nn.Module, targets: list[str], what: str = "the model") -> None:
    """ValueError naming the config field when a target module is not a linear layer of `model`."""
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing:
        raise ValueError(
            f"{FIELD}: {what} has no linear layer named {', '.join(map(repr, missing))}; its linear "
            f"layers are {', '.join(have)}. Set {FIELD} to some of those (or trainer.lora.rank = 0)"
        )


def model_skeleton(cfg: Config) -> torch.nn.Module:
    """The configured model's modules without its weights (meta device: no memory, no file read
    beyond config.json): the built-in tiny Qwen2, or `model.path`'s architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model.path:
        path = resolve(cfg.model.path, cfg.model.revision).folder
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path: {path} is not a Hugging Face model folder (no config.json)")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        config = tiny_qwen2_config(len(build_char_tokenizer()))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_lora_config(cfg: Config) -> None:
    """Before any process starts: the LoRA targets exist in the configured model."""
    if cfg.trainer.lora.rank:
        what = f"model.path ({cfg.model.path})" if cfg.model.path else "the built-in tiny Qwen2"
        check_targets(model_skeleton(cfg), cfg.trainer.lora.target_modules, what)


def adapter_parameters(model: torch.nn.Module, lora: LoRAConfig) -> int:
    """Parameters of rank-`lora.rank` adapters on `model`: r x (in + out) per targeted linear layer
    (works on a meta-device skeleton: the size of a version of any model, from its config)."""
    return sum(
        lora.rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora.target_modules
    )


def apply_lora(model: torch.nn.Module, lora: LoRAConfig):
    """`model` wrapped by peft with trainable rank-`lora.rank` adapters; the base is frozen. B
    starts at zero (peft's init), so the wrapped model computes exactly what the base does."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, lora.target_modules)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 renamed: not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def adapter_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (what adapter_model.safetensors holds)."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: targets are linear layers only (check_targets), and "auto" would
    # re-read the base's config (or ask the Hub about it) on every save.
    sd = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    return {k: v.detach().cpu().contiguous() for k, v in sd.items()}


def save_adapter(peft_model, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write an adapter-only policy version atomically (assembled under a temp name, renamed into
    place): peft's adapter_config.json and adapter_model.safetensors, nothing else. The base is
    not named here (a local path would mean nothing to a worker): the broadcast manifest names it
    by content digest, and loaders find it beside the folder as v000000. `dtype`: the tensors are
    written in it (the run's inference precision, as full versions are; workers and validators
    merge the same bytes, so they agree whatever it is)."""
    path = Path(path)
    with atomic_folder(path) as tmp:
        config = peft_model.peft_config["default"]
        base_name, config.base_model_name_or_path = config.base_model_name_or_path, None
        try:
            config.save_pretrained(tmp)
        finally:
            config.base_model_name_or_path = base_name
        sd = adapter_state_dict(peft_model)
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        save_file(sd, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return path


class AdaptersOff:
    """The base model as a callable, for KL to the reference: the same peft model with its
    adapters switched off (no second copy of the base in memory)."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**kwargs)
