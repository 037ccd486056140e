"""Building, saving and loading policies as plain Hugging Face folders.

Every policy version the project writes is a complete HF folder (safetensors + config +
tokenizer + chat template), so a checkpoint serves from vLLM or SGLang unchanged. Writes are
atomic: a folder is assembled under a temporary name and renamed into place, so a reader never
sees half a version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from swarmrl.model.tokenizer import build_char_tokenizer


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 512,
) -> Qwen2Config:
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


# An adapter-only policy version (trainer.lora, swarmrl/model/lora.py): peft's two files.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_NAME = "v000000"  # an adapter's base: policy version 0, found beside it unless named


def is_adapter(path: str | Path) -> bool:
    """True for a LoRA adapter folder (a later version of a trainer.lora run), not a full model."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def _base_of(path: Path, base: str | Path | None) -> Path:
    base = Path(base) if base is not None else path.parent / BASE_NAME
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is a LoRA adapter (a version of a trainer.lora run) and needs its base model, policy "
            f"version 0, which is not at {base}: keep {BASE_NAME} beside the adapter folders, or pass the base "
            "folder explicitly"
        )
    return base


def base_folder(path: str | Path) -> Path:
    """The base model folder a LoRA adapter folder applies to (v000000 beside it)."""
    return _base_of(Path(path), None)


def load_policy(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    base: str | Path | None = None,
):
    """Load any local HF causal-LM folder and its tokenizer. Never reaches a hub.

    A LoRA adapter folder is merged into its base (`base`, default the v000000 folder beside
    it) and returned as a plain model: every consumer (the built-in engine, TOPLOC, the
    validator's prefill) runs the same modules as for a full version. The merge is peft's
    `merge_and_unload` in `dtype`, the same code on workers and validators, so both hold
    bit-identical weights."""
    path = Path(path)
    if is_adapter(path):
        from peft import PeftModel

        base = _base_of(path, base)
        model, tokenizer = load_policy(base, device=device, dtype=dtype)
        with warnings.catch_warnings():  # peft reads an attribute transformers 5 renamed: not ours to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(path), is_trainable=False).merge_and_unload()
        return model, tokenizer
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device)
    return model, tokenizer


def load_tokenizer(path: str | Path, *, base: str | Path | None = None):
    """The tokenizer of a local HF model folder, without its weights (a worker whose model runs
    in an inference server needs only this); an adapter folder's is its base's."""
    path = Path(path)
    if is_adapter(path):
        path = _base_of(path, base)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model folder (no config.json). Pass a folder written "
            "by `swarmrl sft`, a policy version under <run-dir>/policies/, or a local HF checkpoint."
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        # Every prompt goes through the chat template (tasks/source.py, eval, serve); failing
        # here names the folder instead of a transformers error deep inside the first rollout.
        raise ValueError(
            f"the tokenizer in {path} has no chat template, and swarmrl sends every prompt as a chat message. "
            "Add one: a chat_template.jinja file in the folder (or 'chat_template' in tokenizer_config.json), "
            "e.g. the template of the instruct model this checkpoint was tuned from"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _floating_dtype(state_dict: dict | None) -> str | None:
    """The one floating-point dtype of a state dict's tensors ("bfloat16"), or None."""
    dtypes = {v.dtype for v in (state_dict or {}).values() if v.is_floating_point()}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None


def _declare_dtype(folder: Path, name: str | None) -> None:
    """save_pretrained writes the model's own dtype into config.json. Weights passed in another
    one (a trainer's float32 masters published in bf16, trainer/loop.py) declare theirs instead:
    it is what vLLM's dtype="auto" and from_pretrained without a dtype load them in."""
    config = folder / "config.json"
    if name is None or not config.is_file():
        return
    data = json.loads(config.read_text())
    if data.get("dtype") != name:
        data["dtype"] = name
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on a clean exit it becomes `path`,
    replacing any folder there, and on an error it is removed. Replacing a folder is two renames:
    the old one is moved aside first, so readers see either the old or the new, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_policy(
    model: PreTrainedModel,
    tokenizer,
    path: str | Path,
    *,
    state_dict: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write an HF folder atomically: assemble in `<path>.tmp-<id>`, then rename.

    `state_dict` lets a distributed trainer pass gathered full weights; `extra_files` are small
    text files (e.g. version metadata) written into the folder before it becomes visible.
    """
    with atomic_folder(path) as tmp:
        # A shallow copy: save_pretrained empties the dict it is given, and callers reuse theirs
        # (the trainer evaluates with the weights it just published).
        sd = dict(state_dict) if state_dict is not None else None
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        _declare_dtype(tmp, _floating_dtype(state_dict))
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return path
