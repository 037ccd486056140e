"""What several commands share: the error exit, the run config, service URLs and key arguments."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

from swarmrl.config import Config

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

    try:
        cfg = load_config(path, overrides)
        if run_dir:
            cfg = cfg.model_copy(update={"run_dir": run_dir})
        registry.load(cfg.tasks.types)
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


def check_tls_pair(cert: str | None, key: str | None) -> None:
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together: give both")
