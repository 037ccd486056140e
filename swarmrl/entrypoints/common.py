"""What several commands share: the error exit, the run config, service URLs, key arguments, and
the settings several roles take (`CaFileSettings`, `TlsServeSettings`, `OrchestratorUrlSettings`:
each field, its help text and its check written once)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn, Self

from pydantic import field_validator, model_validator

from swarmrl.config import Config
from swarmrl.entrypoints.flags import RoleSettings

OVERRIDES_EPILOG = (
    "Any config field can be overridden with its dotted name, e.g. --trainer.lr 3e-7 "
    "--async.bound 0 --tasks.digits 3. See configs/default.toml for every field."
)


def fail(msg: str) -> NoReturn:
    """Exit 2 with one line that says what is wrong (no traceback)."""
    print(f"swarmrl: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run_config(path: str | None, overrides: list[str], run_dir: str | None = None) -> Config:
    """The run config of `swarmrl rl` and the tools: defaults, then the TOML file, then the dotted
    overrides; the run's task types are loaded, so an unknown one fails now."""
    from swarmrl.config import ConfigError, load_config
    from swarmrl.rewards import registry
    from swarmrl.tasks.source import check_source

    try:
        cfg = load_config(path, overrides)
        if run_dir:
            cfg = cfg.model_copy(update={"run_dir": run_dir})
        registry.load(cfg.tasks.types)
        check_source(cfg.tasks, files=False)  # a file is read (and its absence said) when the run is prepared
        return cfg
    except (ConfigError, ValueError) as e:
        fail(str(e))


def run_dir_config(run_dir: str, missing: str) -> Config:
    """The config a prepared run directory holds (<run-dir>/config.toml); `missing` is the error
    to exit with when it has none."""
    from swarmrl.config import ConfigError, load_config

    config = Path(run_dir) / "config.toml"
    if not config.exists():
        fail(missing)
    try:
        return load_config(config)
    except ConfigError as e:
        fail(str(e))


def service_url(url: str, flag: str) -> str:
    """A service URL checked before anything starts: one that cannot work fails now, clearly,
    instead of being retried for minutes (issue 18); a trailing /v1 is accepted and dropped."""
    from swarmrl.protocol.client import service_url as checked

    return checked(url, flag)


def service_urls(text: str, flag: str) -> str:
    """A comma-separated list of service URLs, each checked (see `service_url`)."""
    return ",".join(service_url(u, flag) for u in text.split(",") if u.strip())


def url_list(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def key_arg(value: str | None) -> str | None:
    """A public key given as 64 hex characters or as a file holding them."""
    if value and Path(value).is_file():
        return Path(value).read_text().strip()
    return value


# The settings several roles share. A role's `Settings` inherits them; pydantic lists the fields of
# its bases first, those of the last base first (`Settings(CaFileSettings, OrchestratorUrlSettings)`
# lists --orchestrator, then --ca-file, then the role's own flags).


class CaFileSettings(RoleSettings):
    """--ca-file: the roles that reach services over https (`swarmrl.cli.main` trusts the file
    before the role starts)."""

    ca_file: str | None = None
    """PEM CA certificate(s) to trust besides the public CAs, for services with certificates from your own CA
    (https is always verified)"""


class TlsServeSettings(RoleSettings):
    """--tls-cert and --tls-key: the services that can serve https themselves."""

    tls_cert: str | None = None
    """PEM certificate (chain): serve https (with --tls-key)"""
    tls_key: str | None = None
    """PEM private key of --tls-cert"""

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both")
        return self


class OrchestratorUrlSettings(RoleSettings):
    """--orchestrator (required): the roles that join a running orchestrator; its URL is checked
    before anything starts (`service_url`)."""

    orchestrator: str
    """orchestrator URL, e.g. http://127.0.0.1:8000"""

    @field_validator("orchestrator")
    @classmethod
    def _orchestrator_url(cls, value: str) -> str:
        return service_url(value, "--orchestrator")
