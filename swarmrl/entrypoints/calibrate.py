"""`swarmrl calibrate`: the validator's limits for one model, dtype and set of engines, measured here."""

from __future__ import annotations

from pydantic import field_validator

from swarmrl.entrypoints.common import fail
from swarmrl.entrypoints.flags import RoleSettings

HELP = "Measure a model's honest work and the cheat catalogue; write the limits file a run validates with."
DESCRIPTION = (
    HELP + " Honest groups are sampled through each engine the run will accept and judged by the validator's own "
    "prefill; int8 (per row, per 32 inputs), int4, another model, edited tokens and edited logprobs each claim the "
    "model, and the previous version (one optimizer step away) is measured for the record. The file holds per "
    "engine the hard limits, the evidence model that bans a key at the stated false-ban "
    "rate, how each cheat is caught, and the engines it refuses; set validator.limits_file to it. Stamped with the "
    "model's content digest, the dtype and the CPU kind (docs/validation.md, 'Calibrating a run')."
)
EPILOG = (
    "Time on 2 cores (AMD EPYC with AVX-512, docs/validation.md): the built-in model about 1 minute at the defaults; "
    "SmolLM2-135M in bfloat16 about 25 s per honest group of 8 x 48 tokens, so --groups 64 --cheat-groups 8 takes "
    "about 45 minutes. The vllm engine needs vLLM's environment (.venv-vllm/bin/swarmrl calibrate ...)."
)
RUN_CONFIG = None


class Settings(RoleSettings):
    model: str | None = None
    """model folder (Hugging Face format), or a run's version RUN_DIR/policies/vNNNNNN to measure the limits
    again near it (a LoRA adapter is merged into v000000 beside it; a running run takes the file written over
    its validator.limits_file); default: the built-in base model (built on first use, like `swarmrl rl`)"""
    dtype: str = "bfloat16"
    """the run's inference precision (sampling.dtype): float32 or bfloat16"""
    engines: str = "builtin"
    """comma-separated engines the run will accept from untrusted workers: builtin, vllm"""
    prompts: str | None = None
    """JSONL task file (rows with a 'prompt'); default: built-in arithmetic prompts"""
    groups: int = 64
    """honest groups per engine"""
    cheat_groups: int = 16
    """groups per cheat"""
    group_size: int = 8
    """completions per group (sampling.group_size)"""
    max_new_tokens: int = 48
    """tokens per completion at most"""
    temperature: float = 1.0
    """sampling temperature (sampling.temperature)"""
    max_batch: int = 16
    """rows the engine decodes at once"""
    batch_groups: int = 4
    """groups per validator prefill (validator.batch_groups); lower it for large vocabularies (memory)"""
    threads: int = 2
    """torch threads"""
    false_ban_rate: float = 1e-6
    """probability that an honest key is banned by evidence within --horizon groups"""
    horizon: int = 100_000
    """groups per key per run the false-ban rate is stated for"""
    max_groups_to_ban: float = 64.0
    """an engine is refused when some cheat would need more groups than this, on average, to be banned"""
    seed: int = 0
    """prompt order and sampling seeds"""
    previous_lr: float = 1e-4
    """the previous_version cheat's step: every weight moved by this much (the run's trainer.lr: Adam's first
    step is about lr per weight); measured and reported, never used to refuse an engine"""
    measured: str | None = None
    """an earlier limits file: choose its limits again from the statistics it measured (with this command's
    --false-ban-rate, --horizon, --max-groups-to-ban), sampling nothing"""
    out: str = "limits.json"
    """the limits file to write"""

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if value not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, not {value!r}")
        return value

    @field_validator("engines")
    @classmethod
    def _engines(cls, value: str) -> str:
        names = [e.strip() for e in value.split(",") if e.strip()]
        bad = [e for e in names if e not in ("builtin", "vllm")]
        if not names or bad:
            raise ValueError(f"--engines takes builtin and/or vllm, comma-separated (got {value!r})")
        return ",".join(names)


def main(settings: Settings, cfg: None) -> None:
    import json
    import tempfile
    from pathlib import Path

    import torch

    from swarmrl.validator.calibrate import calibrate, read_prompts, rechosen

    torch.set_num_threads(settings.threads)
    if settings.measured:
        try:
            data = json.loads(Path(settings.measured).read_text())
            data = rechosen(
                data,
                false_ban_rate=settings.false_ban_rate,
                horizon=settings.horizon,
                max_groups_to_ban=settings.max_groups_to_ban,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"--measured {settings.measured}: not a limits file with its measurements ({e})")
        _write(data, settings)
        return
    folder = settings.model
    if folder is None:
        from swarmrl.config import Config
        from swarmrl.sft.warmstart import ensure_base_model

        folder = str(ensure_base_model(Config()))
    if not Path(folder).is_dir():
        fail(f"--model {folder}: no such folder (a Hugging Face model folder)")
    try:
        if settings.prompts:
            prompts = read_prompts(Path(settings.prompts))
        else:
            from swarmrl.tasks import arithmetic

            prompts = [r["prompt"] for r in arithmetic.generate(max(256, settings.groups * 4), seed=settings.seed)]
    except (OSError, ValueError) as e:
        fail(str(e))
    with tempfile.TemporaryDirectory(prefix="swarmrl-calibrate-") as work:
        try:
            data = calibrate(
                folder,
                prompts,
                dtype=settings.dtype,
                engines=settings.engines.split(","),
                groups=settings.groups,
                cheat_groups=settings.cheat_groups,
                group_size=settings.group_size,
                max_new_tokens=settings.max_new_tokens,
                temperature=settings.temperature,
                max_batch=settings.max_batch,
                batch_groups=settings.batch_groups,
                false_ban_rate=settings.false_ban_rate,
                horizon=settings.horizon,
                max_groups_to_ban=settings.max_groups_to_ban,
                seed=settings.seed,
                previous_lr=settings.previous_lr,
                work_dir=Path(work),
                # each stage takes minutes on a real model: say so as it ends, even into a file
                log=lambda line: print(line, flush=True),
            )
        except (RuntimeError, ValueError) as e:
            fail(str(e))
    data["command"] = "swarmrl calibrate " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in settings.model_dump().items() if v is not None
    )
    _write(data, settings)


def _write(data: dict, settings: Settings) -> None:
    import json
    from pathlib import Path

    from swarmrl.transport.filesystem import atomic_write_text
    from swarmrl.validator.calibrate import report

    out = Path(settings.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: a running orchestrator may be watching this path (limits_reload.py).
    atomic_write_text(out, json.dumps(data, indent=1))
    print(report(data))
    print(f"wrote {out}: set validator.limits_file = {json.dumps(str(out.resolve()))}")
