"""`swarmrl validator`: a trusted validator checking workers' groups for a remote orchestrator."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from swarmrl.entrypoints.common import CaFileSettings, OrchestratorUrlSettings, fail, key_arg, service_urls, url_list

HELP = "A trusted validator: re-runs prefills to check workers' TOPLOC proofs, seeded sampling, logprobs."
DESCRIPTION = HELP + (
    " Claims groups from the orchestrator with the validator token, fetches the claimed policy versions "
    "from the trainer's weight URLs, and reports verdicts; thresholds come from the orchestrator's config. "
    "Start the orchestrator with --validator.mode external in its config to use only these."
)
RUN_CONFIG = None


class Settings(CaFileSettings, OrchestratorUrlSettings):
    token_file: str
    """validator bearer token (<run-dir>/validator.token)"""
    cache_dir: str = ".cache/swarmrl/validator"
    """downloaded policy versions"""
    threads: int | None = None
    """torch threads (default: torch's choice)"""
    device: str = "cpu"
    """cpu or cuda (the CUDA path is untested here: no GPU was available to this project's CI)"""
    dtype: Literal["float32", "bfloat16"] | None = None
    """default: prefill in the run's precision, which every claim names. Given, the validator stops with a message
    if the run samples in another"""
    relays: str = ""
    """comma-separated relay URLs for policy versions (origin last)"""
    trainer_key: str | None = None
    """the trainer's public key (64 hex) or a file holding it; default: the key the orchestrator's manifests
    name"""

    @field_validator("relays")
    @classmethod
    def _relay_urls(cls, value: str) -> str:
        return service_urls(value, "--relays")


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.validator.runner import run_external

    s = settings
    try:
        run_external(
            s.orchestrator,
            token_file=s.token_file,
            cache_dir=s.cache_dir,
            threads=s.threads,
            device=s.device,
            dtype=s.dtype,
            relays=url_list(s.relays),
            trainer_key=key_arg(s.trainer_key),
        )
    except FileNotFoundError as e:
        fail(str(e))
