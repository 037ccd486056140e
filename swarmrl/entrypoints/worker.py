"""`swarmrl worker`: an inference worker joining an orchestrator with its own ed25519 key.

The worker itself is `swarmrl.inference.worker`; this module is its flags, their checks, and the
start: the cache folder taken for this process alone, the engine chosen, the key read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError, create_model, field_validator, model_validator

from swarmrl.config import ADVERSARY_KINDS
from swarmrl.entrypoints.common import CaFileSettings, OrchestratorUrlSettings, fail, key_arg, service_urls, url_list
from swarmrl.entrypoints.flags import flag, flag_name
from swarmrl.inference import backends

HELP = (
    "An inference worker: joins an orchestrator over HTTP with its own ed25519 key (untrusted, with proofs; "
    "or a trusted key generating through vLLM, SGLang or swarmrl serve)."
)
RUN_CONFIG = None


def __getattr__(name: str):
    """`Settings` and `GROUPS` are made from the engine backends registered when they are asked
    for (after the command line's plug-ins are imported): each backend's options are flags."""
    if name == "Settings":
        return settings_model()
    if name == "GROUPS":
        return {b.title: b.group_help for b in backends.backends() if b.group_help}
    raise AttributeError(name)


class BaseSettings(CaFileSettings, OrchestratorUrlSettings):
    """The worker's flags but its engines' options (`settings_model` adds those)."""

    insecure: bool = False
    """allow a plain-http orchestrator that is not on this machine (by default refused: on the open internet plain
    http lets anyone read the traffic or pose as the orchestrator)"""
    run_id: str | None = None
    """the run to join (run_id of GET /v1/status, 32 hex): an orchestrator serving another run is refused before
    anything is signed for it"""
    key_file: str = ".cache/swarmrl/worker/key.pem"
    """ed25519 private key (PEM), created on first start; its public key is this worker's identity"""
    cache_dir: str | None = None
    """downloaded policy versions and the outbox of unsent submissions; one worker per folder (default:
    .cache/swarmrl/worker/<key file name>, so workers with their own keys never share one)"""
    name: str = "worker"
    """display name (letters, digits, _ . -)"""
    threads: int | None = None
    """torch threads (default: torch's choice)"""
    streams: int | None = None
    """built-in engine on a CPU: decode in this many independent streams of one thread each. At small model sizes
    this beats splitting each kernel over threads (docs/engines.md). Default: one per CPU this process may use
    when --threads is not given either; 1 with --threads, on a GPU, with another engine or an --adversary"""
    device: str = "cpu"
    """cpu or cuda (the CUDA path is checked on the device machine only)"""
    dtype: Literal["float32", "bfloat16"] | None = None
    """default: the run's precision, which every lease names (the validator prefills in it). Given, the worker
    stops with a message if the run samples in another"""
    relays: str = ""
    """comma-separated relay URLs to fetch policy versions from (the origin the orchestrator names is tried
    last)"""
    relay_files: str = ""
    """comma-separated files a relay writes its URL to (`swarmrl relay --url-file`), for relays that may
    start after this worker: each is used once it exists (how `swarmrl rl` starts workers beside the trainer)"""
    trainer_key: str | None = None
    """the trainer's ed25519 public key (64 hex) or a file holding it (<run-dir>/trainer.pub); versions it did
    not sign are refused"""
    engine: str = "builtin"
    """the registered engine backend that generates (each one's flags below): builtin, vllm, openai or a plug-in's
    (`swarmrl worker --help` lists those registered here)"""
    adversary: Literal[tuple(ADVERSARY_KINDS)] | None = flag(  # type: ignore[valid-type]
        None,
        metavar="KIND",
        description="FOR TESTING THE VALIDATOR ONLY: cheat in one way (the orchestrator "
        "bans the key). " + "; ".join(f"{k}: {v}" for k, v in ADVERSARY_KINDS.items()),
    )

    @field_validator("relays")
    @classmethod
    def _relay_urls(cls, value: str) -> str:
        return service_urls(value, "--relays")

    @model_validator(mode="after")
    def _check(self) -> BaseSettings:
        from swarmrl.protocol.tls import is_loopback

        backend = backends.get(self.engine)  # ValueError listing the registered ones
        if self.streams is None:
            from swarmrl.inference.streams import default_streams

            plain = backend.streams and not self.adversary
            self.streams = default_streams(self.device, self.threads) if plain else 1
        if self.streams < 1:
            raise ValueError(
                f"--streams {self.streams}: give at least 1 decoding stream (one per core is the usual choice)"
            )
        if self.streams > 1 and not self.device.startswith("cpu"):
            raise ValueError(
                f"--streams {self.streams} is for CPU workers; on --device {self.device} one engine "
                "fills the device: drop --streams"
            )
        if self.streams > 1 and not backend.streams:
            raise ValueError(f"--engine {self.engine} schedules its own batches: drop --streams")
        if self.orchestrator.startswith("http://") and not is_loopback(self.orchestrator) and not self.insecure:
            raise ValueError(
                f"--orchestrator {self.orchestrator} is plain http to another machine: anyone on the "
                "path could read this worker's traffic or pose as the orchestrator. Use its https "
                "URL, or pass --insecure on a network you trust"
            )
        if self.cache_dir is None:
            self.cache_dir = os.path.join(".cache", "swarmrl", "worker", Path(self.key_file).stem)
        for other in backends.backends():
            given = [f for f in other.flag_fields() if other is not backend and getattr(self, f, None) is not None]
            if given and not (set(given) & set(backend.flag_fields())):
                raise ValueError(f"{flag_name(given[0])} is for --engine {other.name}")
        self.engine_options()  # the chosen engine's options, checked now
        if self.adversary and not backend.proves:
            raise ValueError(
                f"--adversary cheats on an engine that proves its work (builtin or vllm), not through --engine "
                f"{self.engine}, whose groups carry no proofs"
            )
        return self

    def engine_options(self) -> BaseModel:
        """The chosen engine's options, from its flags (ValueError naming the flag otherwise)."""
        backend = backends.get(self.engine)
        values = {opt: getattr(self, f, None) for f, opt in backend.flag_fields().items()}
        try:
            return backend.options.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as e:
            fields = {opt: f for f, opt in backend.flag_fields().items()}
            problems = []
            for err in e.errors():
                where = fields.get(str(err["loc"][0])) if err["loc"] else None
                message = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
                problems.append(f"{flag_name(where)} {getattr(self, where)}: {message}" if where else message)
            raise ValueError("; ".join(problems)) from None


def settings_model() -> type[BaseSettings]:
    """The worker's settings: BaseSettings plus every registered engine's options as flags in the
    engine's help group (None unless given; the engine's options model holds the defaults)."""
    key = tuple((b.name, b.options) for b in backends.backends())
    if key not in _MODELS:
        engines = "; ".join(f"{b.name}: {b.help}" for b in backends.backends())
        fields: dict = {
            "engine": (str, flag("builtin", description=f"the engine backend that generates: {engines}")),
        }
        for backend in backends.backends():
            for flag_field, opt in backend.flag_fields().items():
                info = backend.options.model_fields[opt]
                default = "" if info.is_required() or info.default is None else f" (default: {info.default})"
                help_text = f"{info.description or opt}{default}"
                fields[flag_field] = (info.annotation | None, flag(None, group=backend.title, description=help_text))
        _MODELS[key] = create_model("Settings", __base__=BaseSettings, __module__=__name__, **fields)
    return _MODELS[key]


_MODELS: dict[tuple, type[BaseSettings]] = {}


_HELD: list = []  # open lock files: held until the process exits


def hold_folder(folder: str, role: str) -> None:
    """Take `folder` for this process alone (an flock on <folder>/.lock, released when the process
    ends, however it ends): two workers sharing a cache would share, and double-send, one outbox."""
    import fcntl

    Path(folder).mkdir(parents=True, exist_ok=True)
    handle = open(Path(folder) / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        fail(f"--cache-dir {folder} is in use by {holder}: give each {role} its own --cache-dir")
    handle.seek(0)
    handle.truncate()
    handle.write(f"{role} pid {os.getpid()}\n")
    handle.flush()
    _HELD.append(handle)


def main(settings: BaseSettings, cfg: None) -> None:
    from swarmrl.inference.worker import Worker, run_worker
    from swarmrl.protocol.signing import AuthError

    hold_folder(settings.cache_dir, "worker")
    worker_class = Worker
    if settings.adversary:  # test-only cheats live outside the production inference package
        from swarmrl.adversary.workers import adversary_class

        worker_class = adversary_class(settings.adversary)
    s = settings
    try:
        run_worker(
            s.orchestrator,
            key_file=s.key_file,
            cache_dir=s.cache_dir,
            name=s.name,
            threads=s.threads,
            device=s.device,
            dtype=s.dtype,
            worker_class=worker_class,
            relays=url_list(s.relays),
            relay_files=[f for f in s.relay_files.split(",") if f],
            trainer_key=key_arg(s.trainer_key),
            run_id=s.run_id,
            engine=s.engine,
            engine_options=s.engine_options(),
            streams=s.streams,
        )
    except AuthError as e:
        fail(str(e))
