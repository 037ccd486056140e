"""`swarmrl rl`: the whole asynchronous GRPO loop on this machine, every role on loopback."""

from __future__ import annotations

import json
import signal

from swarmrl.config import Config
from swarmrl.entrypoints.common import OVERRIDES_EPILOG, fail, run_dir_config
from swarmrl.entrypoints.flags import RoleSettings

HELP = "Run the whole asynchronous GRPO loop on this machine (orchestrator + trainer + workers on loopback)."
EPILOG = OVERRIDES_EPILOG
RUN_CONFIG = "flags"
CONFIG_HELP = "TOML config file (default: the embedded default)"


class Settings(RoleSettings):
    run_dir: str | None = None
    """run directory (default: a new folder under runs/)"""
    resume: bool = False
    """continue the run in --run-dir from its last checkpoint"""
    prepare: bool = False
    """only write the run directory (config.toml, policies/v000000) for roles started by hand"""


def dry_run_notes(settings: Settings, cfg: Config) -> str:
    """The processes `swarmrl rl` would start with this config, in order, as comments after it
    (`--dry-run`): `launch.plan.children`, the list the launcher starts."""
    from pathlib import Path

    from swarmrl.launch.plan import children

    root = Path(settings.run_dir or "<run-dir>")
    tls = ["--tls-cert", "<made at start>", "--tls-key", "<made at start>"] if cfg.async_.tls else []
    plan = children(cfg, root, resume=settings.resume, serve_tls=tls, newest=root / "policies" / "v000000")
    return "\n# The processes it would start, in this order:\n" + "".join(f"#   {c.line()}\n" for c in plan)


def main(settings: Settings, cfg: Config) -> None:
    if settings.resume and not settings.run_dir:
        fail("--resume needs --run-dir: the run to continue")
    from swarmrl.launch.launcher import ChildDied, run_rl

    # Ctrl-C must reach the launcher even when it was started from a shell that ignores
    # SIGINT for background jobs (Python keeps an inherited SIG_IGN otherwise).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if settings.resume:
        cfg = run_dir_config(
            settings.run_dir, f"{settings.run_dir} has no config.toml: it is not a swarmrl run directory"
        )
    try:
        summary = run_rl(cfg, resume=settings.resume, prepare_only=settings.prepare)
    except (ChildDied, FileExistsError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    print(json.dumps(summary, indent=1))
