"""Run a benchmark: k samples per problem from a local checkpoint or an OpenAI-compatible
endpoint, graded by the same reward code as training, summarised as avg@k and pass@k.

Both backends see the same thing: the problem's prompt (with the seed run's "Think for N tokens
before giving a response." suffix when a length target is set) as one user message under the
checkpoint's chat template. Sample j of problem i uses seed ``base_i + j`` with ``base_i =
seed * 1_000_003 + i * 1_000``: the local sampler gets those seeds directly, and an endpoint
gets ``seed = base_i`` with ``n = k``, which `swarmrl serve` expands to the same seeds. So
`swarmrl eval --model` and `swarmrl eval --endpoint` against `swarmrl serve` on the same
checkpoint sample the same tokens and give the same scores. vLLM also seeds choice j with
``seed + j`` but draws with its own sampler, and other servers derive per-sample seeds their own
way: their scores are comparable, not identical.

A completion's text keeps special tokens (``</think>`` decides where an answer may be) and
drops its final end-of-turn token; its length counts that token, as training does.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from swarmrl.config import EvalConfig
from swarmrl.eval.metrics import ks_for, length_adherence, pass_at_k
from swarmrl.model.tokenizer import decode_completion
from swarmrl.rewards.instructions import INSTRUCTION_FOLLOWING, instructions_detail
from swarmrl.rewards.length import with_length_target
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import Graders
from swarmrl.rewards.scoring import score_rows

SEED_STRIDE = 1_000  # samples per problem are at most this many
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class EvalSettings:
    k: int = EvalConfig().samples
    temperature: float = EvalConfig().temperature
    # None: DEFAULT_MAX_TOKENS, or fewer for a problem whose prompt leaves an endpoint's context
    # less room than that (`EndpointBackend` asks the server how long each prompt is).
    max_tokens: int | None = None
    length_target: int | None = None
    seed: int = 0
    batch_problems: int = 16  # problems generated (and scored) per round; the progress unit


@dataclass(frozen=True)
class Sample:
    text: str
    tokens: int


def sample_seeds(seed: int, index: int, k: int) -> list[int]:
    base = seed * 1_000_003 + index * SEED_STRIDE
    return [base + j for j in range(k)]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user message under the checkpoint's chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ModelBackend:
    """A local checkpoint through the project's batched, seeded sampler."""

    def __init__(self, model, tokenizer, *, batch_rows: int = 64, streams: int = 1):
        from swarmrl.inference.engine import build_engine

        self.tokenizer = tokenizer
        self.stop_ids = [tokenizer.eos_token_id]
        # streams > 1: processes that hold the weights as given (a fixed checkpoint, not a model
        # still training: the in-run eval keeps one engine).
        self.sampler = build_engine(
            model, tokenizer, stop_token_ids=self.stop_ids, max_batch=batch_rows, streams=streams
        )
        self.batch_rows = batch_rows
        self.model = model

    @classmethod
    def from_path(cls, path: str, *, device: str = "cpu", dtype: str = "float32", streams: int = 1) -> ModelBackend:
        import torch

        from swarmrl.model.checkpoint import load_policy

        model, tokenizer = load_policy(path, device=device, dtype=getattr(torch, dtype))
        return cls(model.eval(), tokenizer, streams=streams)

    def describe(self) -> str:
        return f"local model ({type(self.model).__name__})"

    def generate(
        self, prompts: list[str], seeds: list[list[int]], *, max_tokens: int | None, temperature: float
    ) -> list[list[Sample]]:
        was_training = self.model.training
        self.model.eval()
        rows = [(i, chat_ids(self.tokenizer, p), s) for i, p in enumerate(prompts) for s in seeds[i]]
        out: list[list[Sample]] = [[] for _ in prompts]
        try:
            # The built-in engine refills finished rows itself (continuous batching): give it
            # everything at once; the generic sampler gets static chunks.
            size = len(rows) if self.sampler.continuous else self.batch_rows
            for start in range(0, len(rows), size):
                chunk = rows[start : start + size]
                done = self.sampler.generate(
                    [ids for _, ids, _ in chunk],
                    [s for _, _, s in chunk],
                    max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS,
                    temperature=temperature,
                )
                for (i, _, _), c in zip(chunk, done):
                    out[i].append(
                        Sample(decode_completion(self.tokenizer, c.token_ids, self.stop_ids), len(c.token_ids))
                    )
        finally:
            self.model.train(was_training)
        return out


class EndpointBackend:
    """Any OpenAI-compatible server, through /v1/chat/completions (``n = k`` per problem)."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        import httpx

        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self.concurrency = concurrency
        self.model, self.context = self._served_model(model)
        self._tokenize: bool | None = None  # whether POST /tokenize works (None: not tried yet)

    def _served_model(self, wanted: str | None) -> tuple[str, int | None]:
        """The model's name and, where the server says (vLLM, SGLang and swarmrl serve do), its context."""
        response = self._checked(self.client.get(f"{self.url}/models"))
        data = response.get("data") or []
        if not data:
            raise ValueError(f"{self.url}/models lists no model; pass --served-model")
        entry = next((d for d in data if d.get("id") == wanted), None if wanted else data[0])
        if entry is None:
            return wanted, None
        context = entry.get("max_model_len")
        return entry["id"], context if isinstance(context, int) and context > 0 else None

    def _room(self, prompt: str) -> int:
        """max_tokens for a problem when none was asked: DEFAULT_MAX_TOKENS, or what the context
        leaves after the prompt. Counting the chat's tokens needs the server's tokenizer: vLLM's
        POST /tokenize (swarmrl serve has it too); without it, the default is sent as is."""
        if self.context is None or self._tokenize is False:
            return DEFAULT_MAX_TOKENS
        root = self.url[: -len("/v1")]
        response = self.client.post(
            f"{root}/tokenize", json={"model": self.model, "messages": [{"role": "user", "content": prompt}]}
        )
        if response.status_code in (404, 405):
            self._tokenize = False
            return DEFAULT_MAX_TOKENS
        count = self._checked(response).get("count")
        self._tokenize = True
        room = self.context - int(count)
        if room < 1:
            raise ValueError(f"a prompt of {count} tokens fills the endpoint's context of {self.context} tokens")
        return min(DEFAULT_MAX_TOKENS, room)

    def _post(self, path: str, body: dict) -> dict:
        """POST and the reply's JSON; ValueError naming the cause when the server failed it, with the
        fix when its engine has died (vLLM's CPU build on seeded, chunk-prefilled prompts)."""
        import httpx

        from swarmrl.inference.remote import DEAD_ENGINE_HINT

        try:
            response = self.client.post(path, json=body)
        except httpx.ConnectError as e:
            # vLLM shuts its HTTP server down once its engine has died.
            raise ValueError(
                f"the endpoint {self.url} stopped answering ({e}); it answered before, so it has exited: "
                + DEAD_ENGINE_HINT
            ) from None
        return self._checked(response)

    def _checked(self, response) -> dict:
        from swarmrl.inference.remote import DEAD_ENGINE_HINT, engine_dead

        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            message = (body or {}).get("error", {}).get("message") if isinstance(body, dict) else None
            message = message or response.text[:200]
            if response.status_code >= 500 and engine_dead(self.client, self.url[: -len("/v1")], message):
                raise ValueError(f"the endpoint answered {response.status_code}: {message}; {DEAD_ENGINE_HINT}")
            raise ValueError(f"the endpoint answered {response.status_code}: {message}")
        return body

    def describe(self) -> str:
        return f"endpoint {self.url} (model {self.model})"

    def _one(self, prompt: str, seeds: list[int], max_tokens: int | None, temperature: float) -> list[Sample]:
        if max_tokens is None:
            max_tokens = self._room(prompt)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "n": len(seeds),
            "seed": seeds[0],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": True,
        }
        reply = self._post(f"{self.url}/chat/completions", body)
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != len(seeds):
            raise ValueError(
                f"the endpoint returned {len(choices)} choices for n={len(seeds)}; "
                "it must support n (vLLM, SGLang and swarmrl serve do)"
            )
        samples = []
        for c in choices:
            content = (c.get("logprobs") or {}).get("content")
            tokens = len(content) if content is not None else reply.get("usage", {}).get("completion_tokens", 0)
            samples.append(Sample(c["message"]["content"] or "", tokens))
        return samples

    def generate(
        self, prompts: list[str], seeds: list[list[int]], *, max_tokens: int | None, temperature: float
    ) -> list[list[Sample]]:
        for s in seeds:
            if s != list(range(s[0], s[0] + len(s))):
                raise ValueError("an endpoint takes one seed per request: sample seeds must be consecutive")
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda a: self._one(a[0], a[1], max_tokens, temperature), zip(prompts, seeds)))


def progress_bar(total: int, label: str):
    """A rich progress bar on a terminal; plain lines otherwise. Returns advance(n)."""
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
        )
        bar.start()
        task = bar.add_task(label, total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)
            if bar.tasks[0].finished:
                bar.stop()

        return advance
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        print(f"{label}: {done[0]}/{total} problems", file=sys.stderr, flush=True)

    return advance


def evaluate_rows(
    rows: list[dict],
    backend,
    settings: EvalSettings,
    *,
    pool: VerifierPool,
    graders: Graders | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[dict], dict]:
    """Per-problem results and the summary (see the module docstring)."""
    if not 1 <= settings.k <= SEED_STRIDE:
        raise ValueError(f"k must be between 1 and {SEED_STRIDE}, got {settings.k}")
    if settings.seed < 0 or sample_seeds(settings.seed, len(rows), settings.k)[-1] >= 1 << 62:
        raise ValueError(f"seed must be between 0 and about 2**42, got {settings.seed}")
    started = time.monotonic()
    results: list[dict] = []
    for start in range(0, len(rows), settings.batch_problems):
        chunk = rows[start : start + settings.batch_problems]
        prompts = [
            with_length_target(r["prompt"], settings.length_target) if settings.length_target else r["prompt"]
            for r in chunk
        ]
        seeds = [sample_seeds(settings.seed, start + i, settings.k) for i in range(len(chunk))]
        samples = backend.generate(prompts, seeds, max_tokens=settings.max_tokens, temperature=settings.temperature)
        graded = [
            {
                "problem_id": r["problem_id"],
                "task_type": r["task_type"],
                "prompt": r["prompt"],
                "verification_info": r["verification_info"],
                "completion": s.text,
            }
            for r, group in zip(chunk, samples)
            for s in group
        ]
        scores = iter(score_rows(graded, pool=pool, count_tokens=lambda text: 0, graders=graders))
        details = iter(_instruction_details(graded, pool))
        for r, group in zip(chunk, samples):
            mine = [next(scores) for _ in group]
            detail = [next(details) for _ in group]
            rewards = [s.task_reward for s in mine]
            correct = sum(1 for s in mine if s.error is None and s.task_reward >= 1.0)
            result = {
                "problem_id": r["problem_id"],
                "task_type": r["task_type"],
                "rewards": rewards,
                "correct": correct,
                "lengths": [s.tokens for s in group],
                **{f"pass@{k}": pass_at_k(len(group), correct, k) for k in ks_for(len(group))},
                "reasons": [s.reason for s in mine],
                "errors": [s.error for s in mine],
                "completions": [s.text for s in group],
            }
            if r["task_type"] == INSTRUCTION_FOLLOWING:
                result["instructions"] = detail
            results.append(result)
        if progress is not None:
            progress(len(chunk))
    return results, summarize(results, settings, time.monotonic() - started)


def _instruction_details(graded: list[dict], pool: VerifierPool) -> list[dict | None]:
    """Per-instruction strict and loose verdicts for the instruction-following samples (None for
    the others and for one whose grading failed), graded in the pool like their rewards."""
    wanted = [i for i, row in enumerate(graded) if row["task_type"] == INSTRUCTION_FOLLOWING]
    out: list[dict | None] = [None] * len(graded)
    if wanted:
        calls = [(json.loads(graded[i]["verification_info"]), graded[i]["completion"]) for i in wanted]
        for i, outcome in zip(wanted, pool.map(instructions_detail, calls)):
            out[i] = outcome.value if outcome.ok else None
    return out


def instruction_metrics(results: list[dict]) -> dict[str, float]:
    """IFEval's four measures over every sample of the instruction-following problems, and the
    strict and loose pass rate of each instruction type: ``ifeval/prompt_strict`` (share of
    samples following all their instructions, strict), ``ifeval/prompt_loose``,
    ``ifeval/instruction_strict`` (share of instructions followed, strict),
    ``ifeval/instruction_loose``, ``ifeval/type/<id>/strict`` and ``.../loose``. A sample whose
    grading failed counts as following nothing."""
    prompts = {"strict": [], "loose": []}
    by_type: dict[str, dict[str, list[bool]]] = {}
    for result in results:
        for detail in result.get("instructions") or []:
            if detail is None:
                prompts["strict"].append(False)
                prompts["loose"].append(False)
                continue
            for mode in ("strict", "loose"):
                prompts[mode].append(detail[f"follow_all_instructions_{mode}"])
                for iid, ok in zip(detail["instruction_id_list"], detail[f"follow_instruction_list_{mode}"]):
                    by_type.setdefault(iid, {"strict": [], "loose": []})[mode].append(ok)
    if not prompts["strict"]:
        return {}
    metrics = {f"ifeval/prompt_{m}": statistics.fmean(prompts[m]) for m in ("strict", "loose")}
    for mode in ("strict", "loose"):
        every = [ok for verdicts in by_type.values() for ok in verdicts[mode]]
        metrics[f"ifeval/instruction_{mode}"] = statistics.fmean(every) if every else 0.0
    for iid in sorted(by_type):
        for mode in ("strict", "loose"):
            metrics[f"ifeval/type/{iid}/{mode}"] = statistics.fmean(by_type[iid][mode])
    return metrics


def summarize(results: list[dict], settings: EvalSettings, seconds: float) -> dict:
    rewards = [x for r in results for x in r["rewards"]]
    lengths = [x for r in results for x in r["lengths"]]
    summary: dict = {
        "problems": len(results),
        "samples_per_problem": settings.k,
        f"avg@{settings.k}": statistics.fmean(rewards) if rewards else 0.0,
    }
    for k in ks_for(settings.k):
        summary[f"pass@{k}"] = statistics.fmean(r[f"pass@{k}"] for r in results) if results else 0.0
    summary["length/mean"] = statistics.fmean(lengths) if lengths else 0.0
    if settings.length_target and lengths:
        summary["length/target"] = settings.length_target
        summary.update(
            {f"length/{key}": value for key, value in length_adherence(lengths, settings.length_target).items()}
        )
        summary["length/within_target"] = statistics.fmean(float(n <= settings.length_target) for n in lengths)
    summary.update(instruction_metrics(results))
    summary["errors"] = sum(1 for r in results for e in r["errors"] if e is not None)
    summary["seconds"] = round(seconds, 3)
    return summary
