"""Building, saving and loading policies as plain Hugging Face folders.

Every policy version the project writes is a complete HF folder (safetensors + config +
tokenizer + chat template), so a checkpoint serves from vLLM or SGLang unchanged. Writes are
atomic: a folder is assembled under a temporary name and renamed into place, so a reader never
sees half a version.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from swarmrl.model.tokenizer import build_char_tokenizer


def tiny_qwen2_config(vocab_size: int, *, hidden_size: int = 128, num_layers: int = 4,
                      num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 512,
                      max_positions: int = 512) -> Qwen2Config:
    """A ~1M-parameter Qwen2: same architecture as Qwen2/QwQ, just small."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_tiny_policy(seed: int = 0, **shape) -> tuple[PreTrainedModel, object]:
    """A freshly initialised tiny Qwen2 and the project's char tokenizer."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(len(tokenizer), **shape))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_policy(path: str | Path, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32):
    """Load any local HF causal-LM folder and its tokenizer. Never reaches a hub."""
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(Path(path), local_files_only=True, dtype=dtype)
    model.to(device)
    return model, tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a local HF model folder, without its weights (a worker whose model runs
    in an inference server needs only this)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model folder (no config.json). Pass a folder written "
            "by `swarmrl sft`, a policy version under <run-dir>/policies/, or a local HF checkpoint."
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_policy(model: PreTrainedModel, tokenizer, path: str | Path, *,
                state_dict: dict | None = None, extra_files: dict[str, str] | None = None) -> Path:
    """Write an HF folder atomically: assemble in `<path>.tmp-<id>`, then rename.

    `state_dict` lets a distributed trainer pass gathered full weights; `extra_files` are small
    text files (e.g. version metadata) written into the folder before it becomes visible.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if path.exists():
            # Replacing a folder is two renames; the old one is moved aside first so readers
            # see either the old or the new version, never a mix.
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
