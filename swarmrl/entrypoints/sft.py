"""`swarmrl sft`: the supervised warm start of the built-in tiny model (the base `rl` starts from)."""

from __future__ import annotations

from pathlib import Path

from swarmrl.config import Config
from swarmrl.entrypoints.common import OVERRIDES_EPILOG
from swarmrl.entrypoints.flags import RoleSettings

HELP = "Supervised warm start of the built-in tiny model on worked arithmetic traces."
EPILOG = OVERRIDES_EPILOG
RUN_CONFIG = "flags"
CONFIG_HELP = "TOML config file (its [sft] and [tasks] sections are used)"


class Settings(RoleSettings):
    output: str | None = None
    """folder for the HF model (default: the base-model cache that `rl` uses)"""


def main(settings: Settings, cfg: Config) -> None:
    from swarmrl.sft.warmstart import base_cache_key, train_sft

    out = Path(settings.output) if settings.output else Path(cfg.model.base_cache_dir) / base_cache_key(cfg)
    print(f"wrote {train_sft(cfg, out)}")
