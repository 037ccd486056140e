"""`swarmrl orchestrator`: the orchestrator service of a prepared run directory."""

from __future__ import annotations

from pydantic import model_validator

from swarmrl.entrypoints.common import check_tls_pair, fail
from swarmrl.entrypoints.flags import RoleSettings

HELP = "The orchestrator service (HTTP): leases, rollouts, rewards, batches, durable state."
RUN_CONFIG = "run-dir"


class Settings(RoleSettings):
    run_dir: str
    """run directory with config.toml and policies/v000000"""
    host: str | None = None
    """bind address (default: orchestrator.host from the config)"""
    port: int | None = None
    """port (default: orchestrator.port; 0 picks a free one)"""
    resume: bool = False
    """reopen a finished run (its trainer is resuming)"""
    tls_cert: str | None = None
    """PEM certificate (chain): serve https (with --tls-key)"""
    tls_key: str | None = None
    """PEM private key of --tls-cert"""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        check_tls_pair(self.tls_cert, self.tls_key)
        return self


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.orchestrator.server import serve
    from swarmrl.proofs.limits import LimitsError
    from swarmrl.sandbox.runner import SandboxUnavailable
    from swarmrl.validator.runner import start_in_process

    try:
        serve(
            settings.run_dir,
            host=settings.host,
            port=settings.port,
            resume=settings.resume,
            start_validator=start_in_process,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
        )
    except (FileNotFoundError, OSError, SandboxUnavailable, LimitsError) as e:
        fail(str(e))
