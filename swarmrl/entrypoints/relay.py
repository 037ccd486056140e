"""`swarmrl relay`: an untrusted HTTP relay mirroring signed policy versions (the relay itself is
`swarmrl.transport.relay`)."""

from __future__ import annotations

import sys

from pydantic import Field, field_validator

from swarmrl.entrypoints.common import CaFileSettings, TlsServeSettings, key_arg, service_urls, url_list

HELP = "An untrusted HTTP relay: mirrors signed, sharded policy versions from upstream and serves them."
DESCRIPTION = HELP + (
    " Versions are verified shard by shard (sha256 from the manifest) before they are served, and their "
    "manifest against the trainer's key (required: a version that does not verify is never mirrored). Serves "
    "HTTP Range requests to many clients at once; keeps the newest --keep versions."
)
RUN_CONFIG = None


class Settings(CaFileSettings, TlsServeSettings):
    upstream: str
    """comma-separated URLs of the origin (the trainer's broadcast server) or other relays"""
    cache_dir: str
    """where mirrored versions are kept"""
    host: str = "127.0.0.1"
    """bind address (0.0.0.0 to serve other machines)"""
    port: int = 0
    """port (0 picks a free one)"""
    keep: int = 3
    """versions kept (a version being downloaded is never deleted)"""
    trainer_key: str | None = None
    """required: the trainer's ed25519 public key (64 hex) or a file holding it (<run-dir>/trainer.pub)"""
    startup_tries: int = 10
    """tries to reach an upstream at start before giving up with an error"""
    url_file: str | None = None
    """write {"url": ...} here once listening (for launchers)"""
    max_bytes_per_s: float | None = None
    """cap on the bytes per second this relay serves in all"""
    max_connections: int = Field(128, ge=1)
    """connections served at once, all clients together (one thread each)"""
    max_connections_per_source: int | None = Field(None, ge=1)
    """connections one client address (IPv6: one /64) may hold; default min(16, --max-connections), or all of
    them when --host is a loopback address (only this machine can connect). Raise it when many clients reach
    this relay through one proxy or NAT address"""
    client_timeout_s: float = Field(20.0, gt=0)
    """a connection making no progress this long is closed, and a request's line and headers must arrive within
    it (a slow client cannot hold a slot)"""

    @field_validator("upstream")
    @classmethod
    def _upstream_urls(cls, value: str) -> str:
        return service_urls(value, "--upstream")


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.protocol.tls import server_context
    from swarmrl.transport.broadcast import BroadcastError
    from swarmrl.transport.relay import run_relay

    s = settings
    tls = server_context(s.tls_cert, s.tls_key) if s.tls_cert else None
    try:
        run_relay(
            url_list(s.upstream),
            s.cache_dir,
            host=s.host,
            port=s.port,
            keep=s.keep,
            public_key=key_arg(s.trainer_key),
            startup_tries=s.startup_tries,
            url_file=s.url_file,
            max_bytes_per_s=s.max_bytes_per_s,
            max_connections=s.max_connections,
            max_connections_per_source=s.max_connections_per_source,
            client_timeout_s=s.client_timeout_s,
            tls=tls,
        )
    except BroadcastError as e:
        print(f"swarmrl relay: {e}", file=sys.stderr)
        raise SystemExit(1) from None
