"""Engine backends: what generates a worker's completions, by name (`swarmrl worker --engine NAME`).

A backend is a registry entry:

    name       what `--engine` (and a run's `async.worker_engine`) says
    options    a pydantic model: its fields become the worker's flags for this engine, in a help
               group of their own (`--vllm-max-model-len` for vllm's `max_model_len`), checked by
               the model when the engine is chosen and refused when another engine is
    proves     whether its completions carry TOPLOC proofs and follow the seeded sampling rule
               (any key may submit them), or not (only keys the orchestrator trusts may)
    declares   the engine name its groups carry on the wire (GroupIn.engine): the validator's
               limits are measured per engine, so a backend that reproduces the built-in
               sampler's arithmetic declares "builtin"; a new arithmetic needs its own limits
    open       (options, EngineContext) -> an EngineSession, once per worker process; the
               session's `load(folder, base, version, dtype)` makes a policy version the one it
               generates with (in place where it can) and returns the engine, the tokenizer and
               a few words for the log

The built-in backends below are registrations like any other; a plug-in (docs/plugins.md) adds
one with `register(EngineBackend(...))`, and the worker has no branch on an engine's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmrl.plugins import Registry

if TYPE_CHECKING:  # the registry is read to build the worker's flags: no torch for --help
    from swarmrl.inference.engine import RolloutEngine

WIRE_ENGINES = ("builtin", "vllm", "openai")
"""The engine names a group may declare (protocol/messages.py, GroupIn.engine)."""


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class EngineContext:
    """What a worker tells its backend: where it computes, its cache folder, its log."""

    device: str
    cache: Path
    streams: int = 1
    log: Callable[[str], None] = print


class EngineSession(Protocol):
    in_process_model: bool  # engine.model is the live torch model (a cheat may alter it in place)
    fixed_dtype: bool  # the precision is chosen at the first load: another one needs a restart

    def load(self, folder: Path, base: Path | None, version: int, dtype: str) -> tuple[RolloutEngine, Any, str]: ...

    def declared(self, run_dtype: str) -> dict: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class EngineBackend:
    name: str
    open: Callable[[Any, EngineContext], EngineSession]
    options: type[BaseModel] = NoOptions
    proves: bool = True
    declares: str = ""
    """Default: `name`, which must then be one of WIRE_ENGINES."""
    flag_prefix: str | None = None
    """Prefix of its options' flags (default "NAME_"; "" keeps a field's own name)."""
    streams: bool = False
    """Whether it decodes in the worker's `--streams` (one process per core); others refuse it."""
    help: str = ""
    group: str = ""
    """Title of its flags' help group (default "--engine NAME")."""
    group_help: str = ""

    def __post_init__(self) -> None:
        if self.wire_name not in WIRE_ENGINES:
            raise ValueError(
                f"engine backend {self.name!r} declares {self.wire_name!r}, which the protocol does not carry: "
                f"declare one of {', '.join(WIRE_ENGINES)} whose arithmetic (and the validator's limits for it) "
                "yours reproduces (docs/architecture.md, 'Adding an engine')"
            )

    @property
    def wire_name(self) -> str:
        return self.declares or self.name

    @property
    def prefix(self) -> str:
        return f"{self.name}_" if self.flag_prefix is None else self.flag_prefix

    @property
    def title(self) -> str:
        return self.group or f"--engine {self.name}"

    def flag_fields(self) -> dict[str, str]:
        """{worker settings field: options field} of this backend's flags."""
        return {self.prefix + name: name for name in self.options.model_fields}


BACKENDS: Registry[EngineBackend] = Registry("engine backend", EngineBackend)
names, get, backends = BACKENDS.names, BACKENDS.get, BACKENDS.entries


def register(backend: EngineBackend) -> EngineBackend:
    """Add an engine backend (or replace one of the same name: the last registration wins). Its
    flags may not collide with another backend's."""
    if isinstance(backend, EngineBackend):
        for other in backends():
            if other.name != backend.name and (clash := set(other.flag_fields()) & set(backend.flag_fields())):
                raise ValueError(
                    f"engine backend {backend.name!r}: its option(s) {', '.join(sorted(clash))} would be the same "
                    f"flags as engine {other.name!r}'s: give it another flag_prefix"
                )
    return BACKENDS.register(backend)


# ---- built-in: the seeded sampler in this process ---------------------------------------------------
class BuiltinSession:
    """The built-in engine (or the generic one for a family it does not implement) on the
    policy loaded into this process; decoding streams take each new version in place."""

    in_process_model, fixed_dtype = True, False

    def __init__(self, options: NoOptions, ctx: EngineContext):
        self.ctx, self.engine = ctx, None

    def load(self, folder: Path, base: Path | None, version: int, dtype: str):
        import torch

        from swarmrl.inference.engine import build_engine
        from swarmrl.inference.streams import StreamedEngine
        from swarmrl.model.checkpoint import load_policy

        model, tok = load_policy(folder, device=self.ctx.device, dtype=getattr(torch, dtype), base=base)
        if isinstance(self.engine, StreamedEngine):
            self.engine.model = model.eval()  # the running stream processes take the new version
        else:
            self.engine = build_engine(model.eval(), tok, streams=self.ctx.streams)
        return self.engine, tok, f"({dtype})"

    def declared(self, run_dtype: str) -> dict:
        return {"engine": "builtin"}

    def describe(self) -> str:
        return "the built-in engine"


# ---- vLLM in this process -------------------------------------------------------------------------
class VllmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_model_len: int | None = None
    """the longest prompt + completion vLLM accepts (default: the checkpoint's max_position_embeddings)"""
    kv_cache_gib: float = 1.0
    """vLLM's CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE unless that is set)"""

    @field_validator("max_model_len")
    @classmethod
    def _length(cls, value: int | None) -> int | None:
        if value is not None and value < 2:
            raise ValueError("give at least 2 tokens")
        return value

    @field_validator("kv_cache_gib")
    @classmethod
    def _cache(cls, value: float) -> float:
        if not value > 0:
            raise ValueError("give a positive size in GiB")
        return value


class VllmSession:
    """vLLM's offline engine in this process: started on the first version, later ones loaded in
    place (inference/vllm_engine.py). A LoRA version is merged into its base first."""

    in_process_model, fixed_dtype = False, True

    def __init__(self, options: VllmOptions, ctx: EngineContext):
        self.options, self.ctx, self.engine = options, ctx, None

    def load(self, folder: Path, base: Path | None, version: int, dtype: str):
        from swarmrl.inference.vllm_engine import VllmEngine
        from swarmrl.model.checkpoint import load_tokenizer

        if base is not None:
            folder = merged_folder(folder, base, version, dtype, self.ctx.cache)
        tok = load_tokenizer(folder)
        if self.engine is None:
            self.engine = VllmEngine(
                folder,
                dtype=dtype,
                stop_token_ids=[tok.eos_token_id],
                max_model_len=self.options.max_model_len,
                kv_cache_gib=self.options.kv_cache_gib,
            )
            return self.engine, tok, f"into vLLM in this process ({dtype}, max_model_len {self.engine.max_model_len})"
        self.engine.load(folder)
        return self.engine, tok, f"into vLLM in place ({dtype})"

    def declared(self, run_dtype: str) -> dict:
        return {"engine": "vllm"}

    def describe(self) -> str:
        return "vLLM in this process"


def merged_folder(adapter: Path, base: Path, version: int, dtype: str, cache: Path) -> Path:
    """An adapter version merged into its base, saved as a plain HF folder for an engine that
    loads whole models (<cache>/merged/vNNNNNN, the newest two kept), in `dtype`."""
    import shutil

    import torch

    from swarmrl.model.checkpoint import load_policy, save_policy

    model, tok = load_policy(adapter, dtype=getattr(torch, dtype), base=base)
    out = save_policy(model, tok, cache / "merged" / f"v{version:06d}")
    for old in sorted(p for p in out.parent.iterdir() if p.name.startswith("v"))[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return out


# ---- an OpenAI-compatible server (trusted keys) ----------------------------------------------------
class OpenAIOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    endpoint: str | None = None
    """the server's URL, e.g. http://127.0.0.1:8100 (or .../v1)"""
    endpoint_key_file: str | None = None
    """bearer token for every request to the server (vLLM --api-key, swarmrl serve --reload-token-file)"""
    served_model: str | None = None
    """the model id to ask the server for (default: the first of /v1/models)"""
    load: Literal["reload", "restart", "sglang", "vllm"] | None = None
    """how each new policy version gets into the server: reload (swarmrl serve's POST /v1/reload; the default),
    restart (this worker runs --server-command and restarts it per version; the default with --server-command),
    sglang (POST /update_weights_from_disk), vllm (re-point <cache-dir>/serving, POST /collective_rpc
    reload_weights; vLLM started with VLLM_SERVER_DEV_MODE=1). vllm and restart were run with vLLM's CPU build
    (docs/engines.md, 'vLLM on a CPU'); sglang is untested here"""
    server_command: str | None = None
    """restart mode: the server's command line, {model} standing for the checkpoint folder, e.g.
    "python -m vllm.entrypoints.openai.api_server --model {model} --port 8100 ..." (docs/engines.md has the flags
    vLLM needs: --dtype, --generation-config vllm, and on CPU --no-enable-chunked-prefill)"""
    endpoint_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """the precision the server computes in, declared with every group (the validator's logprob tolerance follows
    it); default: the run's"""
    concurrency: int = Field(16, ge=1)
    """requests in flight to the server"""

    @model_validator(mode="after")
    def _check(self) -> OpenAIOptions:
        if not self.endpoint:
            raise ValueError("--engine openai needs --endpoint URL, the OpenAI-compatible server to generate with")
        return self


class OpenAISession:
    """Versions loaded into an OpenAI-compatible server (inference/remote.py). Its groups carry
    no proofs and declare the server's precision."""

    in_process_model, fixed_dtype = False, False

    def __init__(self, options: OpenAIOptions, ctx: EngineContext):
        from swarmrl.inference.remote import ServerLink

        self.options, self.ctx = options, ctx
        self.server = ServerLink(endpoint_settings(options), ctx.cache, log=ctx.log)

    def load(self, folder: Path, base: Path | None, version: int, dtype: str):
        from swarmrl.model.checkpoint import load_tokenizer

        if base is not None:  # inference servers load whole models: the merged one
            folder = merged_folder(folder, base, version, dtype, self.ctx.cache)
        tok = load_tokenizer(folder)
        self.server.load(folder, version)  # EndpointError stops the worker: the server needs fixing
        return self.server.engine([tok.eos_token_id]), tok, f"into {self.server.describe()}"

    def declared(self, run_dtype: str) -> dict:
        from swarmrl.inference.remote import ENGINE_NAME

        return {"engine": ENGINE_NAME, "dtype": self.options.endpoint_dtype or run_dtype}

    def describe(self) -> str:
        return self.server.describe()

    def close(self) -> None:
        self.server.close()


def endpoint_settings(options: OpenAIOptions):
    """The --engine openai flags as the remote module's EndpointSettings."""
    from swarmrl.errors import SwarmrlError
    from swarmrl.inference.remote import EndpointSettings

    api_key = None
    if options.endpoint_key_file:
        try:
            api_key = Path(options.endpoint_key_file).read_text().strip()
        except OSError as e:
            raise SwarmrlError(f"--endpoint-key-file {options.endpoint_key_file}: {e.strerror}") from None
    load = options.load or ("restart" if options.server_command else "reload")
    try:
        return EndpointSettings(
            str(options.endpoint),
            load=load,
            api_key=api_key,
            served_model=options.served_model,
            server_command=options.server_command,
            dtype=options.endpoint_dtype,
            concurrency=options.concurrency,
        )
    except ValueError as e:
        raise SwarmrlError(str(e)) from None


BUILTIN = (
    EngineBackend(
        "builtin",
        BuiltinSession,
        streams=True,
        help="the seeded sampler with proofs (anyone; fast path for Qwen2/2.5, Qwen3 and Llama/SmolLM models, other "
        "causal LMs through their own slower forward: docs/engines.md, 'Model families')",
    ),
    EngineBackend(
        "vllm",
        VllmSession,
        VllmOptions,
        group="vLLM in this process",
        help="vLLM in this process, with the same seeded choice and proofs (anyone; from vLLM's environment)",
        group_help="--engine vllm: vLLM's offline engine inside this worker, choosing every token by the seeded rule "
        "and building TOPLOC proofs from its final hidden states, so any key may submit its work. Run it from vLLM's "
        "environment (make vllm-env; .venv-vllm/bin/swarmrl worker ...). Run here with vllm-cpu 0.32.0; CUDA untested "
        "(docs/engines.md, 'Proving vLLM workers').",
    ),
    EngineBackend(
        "openai",
        OpenAISession,
        OpenAIOptions,
        proves=False,
        flag_prefix="",
        group="trusted fleets",
        help="the OpenAI-compatible server at --endpoint (trusted keys)",
        group_help="--engine openai: generate through an OpenAI-compatible server instead of the built-in sampler. "
        "Such work has no TOPLOC proofs: the orchestrator accepts it only from keys in its "
        "orchestrator.trusted_keys_file. docs/engines.md has the vLLM and SGLang commands.",
    ),
)
for _backend in BUILTIN:
    register(_backend)
