"""`swarmrl orchestrator --run-dir DIR`: serve the orchestrator with uvicorn.

The run directory holds what the orchestrator trusts: `config.toml`, the starting policy's
tokenizer (`policies/v000000`, for prompts and reward decoding), `trainer.token` (the trainer's
bearer token, created here with mode 0600 if missing) and `orchestrator.sqlite` (all state).
Once listening it writes `orchestrator.json` ({"url": ...}) so local roles can find it; with
port 0 the OS picks a free port. A restart on the same run directory resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

from swarmrl.transport.filesystem import atomic_write_text


def trainer_token(run_dir: Path, role: str = "trainer") -> str:
    """A trusted role's bearer token (`<role>.token`: the trainer's, the validators'), created on
    first use, readable only by this user."""
    path = run_dir / f"{role}.token"
    if not path.exists():
        tmp = run_dir / f".{role}.token.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # someone else created it first: use theirs
        os.unlink(tmp)
    return path.read_text().strip()


def build_orchestrator(run_dir: str | Path, *, log=print):
    import torch  # noqa: F401  (imported before transformers, as everywhere else)
    from transformers import AutoConfig, AutoTokenizer

    from swarmrl.config import load_config
    from swarmrl.orchestrator.limits_reload import LimitsReload, published_by, stamp_of
    from swarmrl.orchestrator.service import Orchestrator
    from swarmrl.proofs.limits import run_limits
    from swarmrl.rewards import registry

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").exists():
        raise FileNotFoundError(f"{run_dir} has no config.toml: start the run with `swarmrl rl`, or write one")
    base = run_dir / "policies" / "v000000"
    if not (base / "config.json").exists():
        raise FileNotFoundError(f"{base} is missing: the orchestrator needs the starting policy's tokenizer")
    cfg = load_config(run_dir / "config.toml")
    registry.load(cfg.tasks.types)  # the run's own task types, before any row is checked
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model_cfg = AutoConfig.from_pretrained(base, local_files_only=True)
    # A bf16 run on its own model judges by its calibration, or does not start (LimitsError).
    stamp = stamp_of(Path(cfg.validator.limits_file)) if cfg.validator.limits_file else None
    limits = run_limits(cfg, cfg.model.path or base, run_dir, published_by(run_dir))
    if limits is not None:
        log(
            f"validator limits: {cfg.validator.limits_file} ({limits['dtype']}, measured on CPU kind "
            f"{limits['cpu']['kind']}; engines accepted: "
            + ", ".join(n for n, e in limits["engines"].items() if not e.get("refused"))
            + ")"
        )
    orch = Orchestrator(
        cfg,
        run_dir,
        tokenizer=tokenizer,
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        trainer_token=trainer_token(run_dir),
        validator_token=trainer_token(run_dir, "validator"),
        log=log,
        limits=limits,
    )
    if cfg.validator.limits_file:
        # Measured again while the run goes on (the drift watch asks for it): taken when it changes.
        orch.limits_reload = LimitsReload(cfg, run_dir, cfg.model.path or base, orch.validation, log, stamp)
    return orch


def serve(
    run_dir: str | Path,
    *,
    host: str | None = None,
    port: int | None = None,
    resume: bool = False,
    start_validator=None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Serve until stopped. With `validator.mode = "in-process"`, `start_validator(orch, run_dir)`
    starts the validator thread and returns (thread, stop event): passed in by the caller (the CLI
    passes `swarmrl.validator.runner.start_in_process`) because the validator is a client of the
    orchestrator and sits above it."""
    import uvicorn

    from swarmrl.orchestrator import limits_reload
    from swarmrl.orchestrator.app import create_app
    from swarmrl.protocol.tls import server_context
    from swarmrl.transport.connlimit import SourceSlots, guarded_h11

    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both")
        server_context(tls_cert, tls_key)  # a clear error now, not uvicorn's at the first request
    run_dir = Path(run_dir)
    orch = build_orchestrator(run_dir)
    if resume:
        orch.reopen()
    o = orch.cfg.orchestrator
    host = host or o.host
    port = o.port if port is None else port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it every response (headers, then body, two
    # writes) waited for the client's delayed ACK: 44 ms per request on loopback, 1.2 ms with.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    scheme = "https" if tls_cert else "http"
    url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{bound}"
    slots = orch.connections = SourceSlots.sized(o.max_connections, o.max_connections_per_source)
    config = uvicorn.Config(
        create_app(orch),
        log_level="warning",
        access_log=False,
        # One source's sockets must not deny service to another's (transport/connlimit.py):
        # connections are counted per source instead of uvicorn's limit_concurrency, whose 503
        # hits every source alike, and a request head must arrive within header_timeout_s.
        http=guarded_h11(slots, head_timeout_s=o.header_timeout_s, idle_timeout_s=o.keep_alive_s),
        timeout_keep_alive=o.keep_alive_s,
        limit_concurrency=None,
        h11_max_incomplete_event_size=64 * 1024,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )
    server = uvicorn.Server(config)
    thread = stop = None
    if orch.cfg.validator.mode == "in-process":
        if start_validator is None:
            raise ValueError('validator.mode is "in-process" but no validator was given to run in this process')
        thread, stop = start_validator(orch, run_dir)
    watch = orch.limits_reload and limits_reload.start(orch.limits_reload)
    atomic_write_text(run_dir / "orchestrator.json", json.dumps({"url": url, "pid": os.getpid()}))
    print(f"orchestrator listening on {url} (validator: {orch.cfg.validator.mode})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        if watch:
            watch[1].set()
        if stop is not None:
            stop.set()
            thread.join(timeout=30)  # let a check in progress record its verdicts
        orch.close()
