"""`swarmrl orchestrator`: the orchestrator service of a prepared run directory."""

from __future__ import annotations

from swarmrl.entrypoints.common import TlsServeSettings, fail

HELP = "The orchestrator service (HTTP): leases, rollouts, rewards, batches, durable state."
RUN_CONFIG = "run-dir"


class Settings(TlsServeSettings):
    run_dir: str
    """run directory with config.toml and policies/v000000"""
    host: str | None = None
    """bind address (default: orchestrator.host from the config)"""
    port: int | None = None
    """port (default: orchestrator.port; 0 picks a free one)"""
    resume: bool = False
    """reopen a finished run (its trainer is resuming)"""


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.orchestrator.server import serve
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
    except (FileNotFoundError, OSError) as e:
        fail(str(e))
