"""`swarmrl status`: a run at a glance from its orchestrator's public dashboard (the view itself is
`swarmrl.launch.status`)."""

from __future__ import annotations

from pydantic import field_validator

from swarmrl.entrypoints.common import fail, service_url
from swarmrl.entrypoints.flags import RoleSettings, flag

HELP = "A run at a glance from its orchestrator: progress, every worker's record, validation, versions."
DESCRIPTION = HELP + " It reads GET /v1/dashboard, which is public: no token needed."
RUN_CONFIG = None


class Settings(RoleSettings):
    orchestrator: str
    """orchestrator URL, e.g. http://127.0.0.1:8000"""
    as_json: bool = flag(False, spelled="--json")
    """print the dashboard document as JSON instead of tables"""
    steps: int = 10
    """progress rows to show (the newest)"""
    workers: int = 20
    """leaderboard rows to show"""
    watch: float = 0.0
    """refresh every this many seconds (0: print once)"""
    ca_file: str | None = None
    """PEM CA certificate(s) to trust besides the public CAs, for services with certificates from your own CA
    (https is always verified)"""

    @field_validator("orchestrator")
    @classmethod
    def _orchestrator_url(cls, value: str) -> str:
        return service_url(value, "--orchestrator")


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.launch.status import watch

    try:
        watch(
            settings.orchestrator,
            as_json=settings.as_json,
            steps=settings.steps,
            workers=settings.workers,
            every_s=settings.watch,
        )
    except ValueError as e:
        fail(str(e))
