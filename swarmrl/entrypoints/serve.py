"""`swarmrl serve`: an OpenAI-compatible HTTP server over a local checkpoint."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from swarmrl.entrypoints.common import TlsServeSettings, fail
from swarmrl.entrypoints.flags import flag

HELP = "An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) over a local checkpoint."
DESCRIPTION = (
    HELP + " Requests share the built-in engine's continuous batches: a request joins the running batch "
    "at the next token step. CUDA serving is untested (CPU only here)."
)
RUN_CONFIG = None


class Settings(TlsServeSettings):
    model: str
    """local HF checkpoint folder (a swarmrl policy or any causal LM) or Hub id (from the Hugging Face cache)"""
    host: str = "127.0.0.1"
    """bind address (0.0.0.0 to serve other machines)"""
    port: int = 8080
    """0 picks a free port"""
    served_model_name: str | None = None
    """the model id clients ask for (default: the folder's name)"""
    device: str = "cpu"
    """cpu or cuda"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the precision the model computes in"""
    engine: Literal["builtin", "hf"] = "builtin"
    """builtin: continuous batching (Qwen2/2.5, Qwen3 and Llama/SmolLM models; others fall back to hf, saying why);
    hf: the generic engine over the model's own forward, in static batches"""
    max_batch: int = flag(32, aliases=("--max-batch-rows",))
    """completions generated together at most"""
    batch_window_ms: float = 5.0
    """static batches only (--engine hf): how long a batch waits for more requests to join"""
    max_n: int = 16
    """largest n a request may ask for"""
    max_request_kb: int = 1024
    """larger request bodies get a 413"""
    default_max_tokens: int = 256
    """chat max_tokens when the request has none"""
    threads: int | None = None
    """torch CPU threads (default: torch's)"""
    url_file: str | None = None
    """write {url, model} here as JSON once listening (for scripts and tests)"""
    max_connections: int = Field(512, ge=1)
    """connections open at once, all clients together (the last quarter kept for addresses holding few)"""
    max_connections_per_source: int = Field(128, ge=1)
    """connections one client address (IPv6: one /64) may hold; more get 503 at once. Raise it when clients
    come through one proxy or NAT address"""
    header_timeout_s: float = Field(10.0, gt=0)
    """a request's line and headers must arrive within this many seconds (else 408 and closed)"""
    body_timeout_s: float = Field(30.0, gt=0)
    """a request's body must arrive within this many seconds of its headers (else 408)"""
    max_queued_per_client: int = Field(256, ge=1)
    """completions (n counts each) one client address (IPv6: one /64) may have queued or generating; more get
    429 with Retry-After. At least --max-n. An endpoint worker keeps 16 in flight, `swarmrl eval --endpoint`
    8 x k; raise it when clients come through one proxy or NAT address"""
    max_queued_total: int = Field(1024, ge=1)
    """completions queued or generating, all clients together; more get 429 with Retry-After"""
    tokenizer_threads: int = Field(2, ge=1)
    """threads that tokenise prompts and detokenise replies, off the event loop that answers every request; one
    client address may use all but one of them (at least one)"""
    reload_token_file: str | None = None
    """enable POST /v1/reload {"model_path": FOLDER} (load another checkpoint in place) for callers sending
    'Authorization: Bearer' + this file's content; how an endpoint worker loads each new policy version
    (docs/engines.md). Anyone with the token can make the server load any folder it can read"""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.max_n <= self.max_queued_per_client <= self.max_queued_total:
            raise ValueError(
                f"--max-queued-per-client ({self.max_queued_per_client}) must be at least --max-n ({self.max_n}), "
                f"so that a request of n = {self.max_n} can run, and at most --max-queued-total "
                f"({self.max_queued_total})"
            )
        return self


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.model.hub import resolve
    from swarmrl.serve.app import serve

    s = settings
    folder = resolve(s.model, what="--model").folder  # HubError (printed by the CLI) names the id and the cache
    try:
        serve(
            str(folder),
            host=s.host,
            port=s.port,
            device=s.device,
            dtype=s.dtype,
            model_name=s.served_model_name,
            max_batch_rows=s.max_batch,
            batch_window_ms=s.batch_window_ms,
            max_n=s.max_n,
            max_request_kb=s.max_request_kb,
            default_max_tokens=s.default_max_tokens,
            url_file=s.url_file,
            threads=s.threads,
            reload_token_file=s.reload_token_file,
            engine=s.engine,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
            max_connections=s.max_connections,
            max_connections_per_source=s.max_connections_per_source,
            header_timeout_s=s.header_timeout_s,
            body_timeout_s=s.body_timeout_s,
            max_queued_per_client=s.max_queued_per_client,
            max_queued_total=s.max_queued_total,
            tokenizer_threads=s.tokenizer_threads,
        )
    except (OSError, ValueError) as e:
        fail(str(e))
