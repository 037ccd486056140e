"""`swarmrl eval`: a checkpoint or an OpenAI-compatible endpoint on a benchmark (avg@k, pass@k, lengths)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Literal

from pydantic import model_validator

from swarmrl.config import Config
from swarmrl.entrypoints.common import fail
from swarmrl.entrypoints.flags import RoleSettings, flag

HELP = "Evaluate a checkpoint or an OpenAI-compatible endpoint on a benchmark: avg@k, pass@k, lengths."
EPILOG = (
    "Built-in sets take --tasks.FIELD overrides (e.g. --tasks.digits 3), code rows --sandbox.FIELD ones. "
    "See docs/eval.md."
)
RUN_CONFIG = "flags"
CONFIG_HELP = "TOML config file: its [tasks] and [sandbox] sections are used"
OVERRIDE_SECTIONS = ("tasks", "sandbox")


class Settings(RoleSettings):
    model: str | None = flag(None, exclusive="source")
    """local HF checkpoint folder or Hub id (from the Hugging Face cache), sampled with the project's seeded
    sampler (its fast engine for Qwen2/2.5, Qwen3 and Llama/SmolLM models, the model's own forward for others)"""
    endpoint: str | None = flag(None, exclusive="source")
    """OpenAI-compatible server URL, e.g. http://127.0.0.1:8080/v1 (swarmrl serve, vLLM, SGLang)"""
    served_model: str | None = None
    """model id at the endpoint (default: the first in /v1/models)"""
    api_key: str | None = None
    """bearer token for the endpoint (default: $OPENAI_API_KEY if set)"""
    benchmark: str
    """a JSONL/parquet file, or a registered task source: 'arithmetic', 'instructions' or a plug-in's (its held-out
    split, as --config sets it) or 'code'; several, comma-separated, are evaluated one after the other on one
    loaded model, each into OUTPUT_DIR/NAME/ (NAME: the set's name or the file's name without its suffix)"""
    format: Literal["auto", "schema", "math", "code", "mcq", "ifeval"] = "auto"
    """the file's format (auto: decided from the first row's fields; ifeval: IFEval/IFBench rows with
    instruction_id_list and kwargs, reported as prompt- and instruction-level strict and loose accuracy)"""
    limit: int | None = None
    """only the first N problems"""
    k: int = 4
    """samples per problem (avg@k, pass@1..k)"""
    temperature: float = 1.0
    """sampling temperature"""
    max_tokens: int | None = None
    """generated tokens per sample at most (default: 512, or fewer where an --endpoint's context leaves less room
    after a problem's prompt)"""
    length_target: int | None = None
    """append ' Think for N tokens before giving a response.' and report adherence"""
    seed: int = 0
    """sample j of problem i uses seed seed*1000003 + i*1000 + j"""
    output_dir: str
    """writes results.jsonl (per problem) and summary.json"""
    concurrency: int = 8
    """endpoint requests in flight"""
    device: str = "cpu"
    """--model only (cuda is untested: no GPU here)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """--model only"""
    streams: int | None = None
    """--model on a CPU: decode in this many processes of one thread each (the same samples whatever the number,
    docs/engines.md). Default: one per CPU this process may use (on a GPU: 1)"""
    workers: int = 2
    """math grading processes"""
    extract: Literal["boxed", "last_number"] = "boxed"
    """math rows: grade the last \\boxed{} answer (the format their prompt asks for), or with last_number the
    \\boxed{} if there is one, else the last number written (for a chat model that never learned the boxed
    format; lm-eval's GSM8K "flexible extract" is the same idea). Reported in summary.json"""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if bool(self.model) == bool(self.endpoint):
            raise ValueError("give one of --model (a local checkpoint folder) or --endpoint (a server URL)")
        for name, value in (("--k", self.k), ("--max-tokens", self.max_tokens), ("--concurrency", self.concurrency)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.length_target is not None and self.length_target < 1:
            raise ValueError(f"--length-target must be a positive number of tokens, got {self.length_target}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.streams is None:
            from swarmrl.inference.streams import default_streams

            self.streams = default_streams(self.device) if self.model else 1
        if self.streams < 1 or (self.streams > 1 and (not self.model or not self.device.startswith("cpu"))):
            raise ValueError(f"--streams {self.streams}: give 1, or more with --model on a CPU (one per core)")
        names = [name_of(b) for b in self.benchmarks]
        if not names:
            raise ValueError("--benchmark is empty: give a file or a built-in set")
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(
                f"--benchmark names {', '.join(twice)} twice (each writes OUTPUT_DIR/NAME/): give each once, "
                "or rename one of the files"
            )
        return self

    @property
    def benchmarks(self) -> list[str]:
        """The benchmarks in the order given (`--benchmark a.jsonl,code`)."""
        return [b.strip() for b in self.benchmark.split(",") if b.strip()]


def name_of(benchmark: str) -> str:
    """Where a benchmark's results go when several are evaluated: a built-in set's name, or the
    file's name without its suffix (aime24.jsonl -> aime24)."""
    from swarmrl.tasks import registry as sources

    if sources.find(benchmark) is not None or benchmark == "code":
        return benchmark
    name = Path(benchmark).name
    for suffix in (".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name


def benchmark_rows(settings: Settings, cfg: Config, benchmark: str) -> list[dict]:
    """A benchmark's problems: a built-in set or a file."""
    from swarmrl.eval.formats import load_benchmark
    from swarmrl.tasks import registry as sources

    try:
        if sources.find(benchmark) is not None:  # its held-out split, the one `swarmrl rl` evaluates on
            rows = sources.source_rows(cfg.tasks, benchmark, cfg.tasks.eval_size, "test")
        elif benchmark == "code":
            from swarmrl.tasks import code as code_tasks

            rows = code_tasks.generate()
        else:
            rows = load_benchmark(benchmark, settings.format)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if settings.limit is not None:
        rows = rows[: settings.limit]
    if not rows:
        fail(f"{benchmark} has no problems")
    if settings.extract != "boxed":
        rows = [_with_extract(row, settings.extract) for row in rows]
    return rows


def _with_extract(row: dict, mode: str) -> dict:
    """A math row graded with answer extraction ``mode``; other rows unchanged."""
    from swarmrl.data.schema import MATH

    if row.get("task_type") != MATH:
        return row
    info = json.loads(row["verification_info"])
    return {**row, "verification_info": json.dumps({**info, "extract": mode})}


def backend_for(settings: Settings):
    from swarmrl.eval.runner import EndpointBackend, ModelBackend

    if settings.model:
        from swarmrl.model.hub import resolve

        folder = resolve(
            settings.model, what="--model"
        ).folder  # HubError (printed by the CLI) names the id and the cache
        return ModelBackend.from_path(folder, device=settings.device, dtype=settings.dtype, streams=settings.streams)
    return EndpointBackend(
        settings.endpoint,
        model=settings.served_model,
        api_key=settings.api_key or os.environ.get("OPENAI_API_KEY"),
        concurrency=settings.concurrency,
    )


def main(settings: Settings, cfg: Config) -> None:
    """Load the benchmarks (all of them first: a bad file fails before any sampling), pick the
    backend once, run each, write results.jsonl and summary.json for each."""
    from swarmrl.eval.runner import EvalSettings
    from swarmrl.rewards.pool import DEFAULT_PRELOAD, VerifierPool
    from swarmrl.rewards.registry import open_graders, preload_for
    from swarmrl.sandbox.runner import SandboxUnavailable

    benchmarks = {b: benchmark_rows(settings, cfg, b) for b in settings.benchmarks}
    every_row = [row for rows in benchmarks.values() for row in rows]
    sampling = EvalSettings(
        k=settings.k,
        temperature=settings.temperature,
        max_tokens=settings.max_tokens,
        length_target=settings.length_target,
        seed=settings.seed,
    )
    try:
        backend = backend_for(settings)
        graders = open_graders(every_row, cfg.sandbox)
    except (ValueError, OSError, SandboxUnavailable) as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - e.g. an unreachable endpoint (httpx errors)
        fail(f"{type(e).__name__}: {e}")
    out = Path(settings.output_dir)
    several = len(benchmarks) > 1
    summaries = {}
    try:
        with VerifierPool(settings.workers, 5.0, preload=(*DEFAULT_PRELOAD, *preload_for(every_row))) as pool:
            for benchmark, rows in benchmarks.items():
                where = out / name_of(benchmark) if several else out
                summaries[name_of(benchmark)] = _evaluate(
                    settings, benchmark, rows, backend, sampling, pool, graders, where
                )
    finally:
        graders.close()
    if several:
        (out / "summary.json").write_text(json.dumps({"benchmarks": summaries}, indent=1) + "\n")


def _evaluate(settings: Settings, benchmark: str, rows, backend, sampling, pool, graders, out: Path) -> dict:
    """One benchmark on the loaded backend: OUT/results.jsonl and OUT/summary.json; the summary."""
    from swarmrl.eval.runner import evaluate_rows, progress_bar

    what = f"{benchmark}: {len(rows)} problems x {settings.k} samples on {backend.describe()}"
    print(f"evaluating {what}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    try:
        results, summary = evaluate_rows(
            rows, backend, sampling, pool=pool, graders=graders, progress=progress_bar(len(rows), "eval")
        )
    except ValueError as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - a failing endpoint mid-run: say so, no traceback
        fail(f"evaluation stopped: {type(e).__name__}: {e}")
    with open(out / "results.jsonl", "w", encoding="utf-8") as handle:
        for r in results:
            handle.write(json.dumps(r, ensure_ascii=False) + "\n")
    summary = {
        **summary,
        "benchmark": benchmark,
        "backend": backend.describe(),
        "settings": {
            "k": settings.k,
            "temperature": settings.temperature,
            "max_tokens": settings.max_tokens if settings.max_tokens is not None else "auto",
            "length_target": settings.length_target,
            "seed": settings.seed,
            "extract": settings.extract,
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return summary
