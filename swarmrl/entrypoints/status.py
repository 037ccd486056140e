"""`swarmrl status`: a run at a glance from its orchestrator's public dashboard (the view itself is
`swarmrl.launch.status`)."""

from __future__ import annotations

from swarmrl.entrypoints.common import CaFileSettings, OrchestratorUrlSettings, fail
from swarmrl.entrypoints.flags import flag

HELP = "A run at a glance from its orchestrator: progress, every worker's record, validation, versions."
DESCRIPTION = HELP + " It reads GET /v1/dashboard, which is public: no token needed."
RUN_CONFIG = None


class Settings(CaFileSettings, OrchestratorUrlSettings):
    as_json: bool = flag(False, spelled="--json")
    """print the dashboard document as JSON instead of tables"""
    steps: int = 10
    """progress rows to show (the newest)"""
    workers: int = 20
    """leaderboard rows to show"""
    watch: float = 0.0
    """refresh every this many seconds (0: print once)"""


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
