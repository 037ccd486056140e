"""`swarmrl filter` (also `swarmrl tasks filter`): keep the problems a model finds neither always
easy nor always impossible, measured with the model itself.

Each row of --input is sampled --k times (through --model, the seeded sampler, or --endpoint, any
OpenAI-compatible server: the `swarmrl eval` backends), graded like a run grades it, and written
to --output when its pass rate lies in --band, with the rate in a `solve_rate` column (so a run
can also filter with `tasks.solve_rate_column = "solve_rate"` and `tasks.solve_rate_range`). The
report says how many problems had signal (rewards that differ) before and after."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import model_validator

from swarmrl.entrypoints.common import fail
from swarmrl.entrypoints.flags import RoleSettings, flag

HELP = "Measure a model's pass rate per problem (k samples) and keep the rows in a band (swarmrl tasks filter)."
RUN_CONFIG = None


class Settings(RoleSettings):
    input: str
    """task rows (JSONL, parquet or a dataset folder in the task schema, or any `swarmrl eval` benchmark format)"""
    output: str
    """the JSONL file of the kept rows, each with its `solve_rate`"""
    model: str | None = flag(None, exclusive="source")
    """local HF checkpoint folder or Hub id, sampled with the project's seeded sampler"""
    endpoint: str | None = flag(None, exclusive="source")
    """OpenAI-compatible server URL (swarmrl serve, vLLM, SGLang)"""
    served_model: str | None = None
    """model id at the endpoint (default: the first in /v1/models)"""
    api_key: str | None = None
    """bearer token for the endpoint (default: $OPENAI_API_KEY if set)"""
    band: str = "0.1,0.8"
    """LO,HI: keep rows whose pass rate r has LO <= r <= HI (the INTELLECT-2 seed kept 0.1-0.8 of a 7B
    model's solve rate)"""
    k: int = 8
    """samples per problem"""
    temperature: float = 1.0
    """sampling temperature (the run's, so the rate is what its groups will see)"""
    max_tokens: int | None = None
    """generated tokens per sample at most (default: as `swarmrl eval`)"""
    seed: int = 0
    """sampling seed"""
    limit: int | None = None
    """only the first N rows"""
    format: Literal["auto", "schema", "math", "code", "mcq", "ifeval"] = "auto"
    """the input's format (as `swarmrl eval --format`)"""
    extract: Literal["boxed", "last_number"] = "boxed"
    """math rows: grade the last \\boxed{} answer, or the last number written (as `swarmrl eval --extract`)"""
    device: str = "cpu"
    """--model only"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """--model only"""
    streams: int | None = None
    """--model on a CPU: decoding processes of one thread each (default: one per CPU)"""
    concurrency: int = 8
    """endpoint requests in flight"""
    workers: int = 2
    """grading processes"""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        from swarmrl.eval.difficulty import parse_band

        if bool(self.model) == bool(self.endpoint):
            raise ValueError("give one of --model (a checkpoint folder or Hub id) or --endpoint (a server URL)")
        if self.k < 2:
            raise ValueError(f"--k {self.k}: a pass rate needs at least 2 samples per problem")
        parse_band(self.band)
        if self.streams is None:
            from swarmrl.inference.streams import default_streams

            self.streams = default_streams(self.device) if self.model else 1
        return self


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.config import Config
    from swarmrl.entrypoints.eval import Settings as EvalSettingsFlags
    from swarmrl.entrypoints.eval import backend_for, benchmark_rows
    from swarmrl.eval.difficulty import parse_band, pass_rate, summary
    from swarmrl.eval.runner import EvalSettings, evaluate_rows, progress_bar
    from swarmrl.rewards.pool import DEFAULT_PRELOAD, VerifierPool
    from swarmrl.rewards.registry import open_graders, preload_for

    s = settings
    as_eval = EvalSettingsFlags(
        model=s.model, endpoint=s.endpoint, served_model=s.served_model, api_key=s.api_key, benchmark=s.input,
        format=s.format, limit=s.limit, k=s.k, temperature=s.temperature, max_tokens=s.max_tokens, seed=s.seed,
        output_dir=str(Path(s.output).parent), concurrency=s.concurrency, device=s.device, dtype=s.dtype,
        streams=s.streams, workers=s.workers, extract=s.extract,
    )  # fmt: skip
    cfg = Config()
    rows = benchmark_rows(as_eval, cfg, s.input)
    band = parse_band(s.band)
    backend = backend_for(as_eval)
    sampling = EvalSettings(k=s.k, temperature=s.temperature, max_tokens=s.max_tokens, seed=s.seed)
    print(f"filtering {len(rows)} problems x {s.k} samples on {backend.describe()}", file=sys.stderr)
    try:
        with (
            open_graders(rows, cfg.sandbox) as graders,
            VerifierPool(s.workers, 5.0, preload=(*DEFAULT_PRELOAD, *preload_for(rows))) as pool,
        ):
            results, _ = evaluate_rows(
                rows, backend, sampling, pool=pool, graders=graders, progress=progress_bar(len(rows), "filter")
            )
    except (ValueError, OSError) as e:
        fail(str(e))
    out = Path(s.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with open(out, "w", encoding="utf-8") as handle:
        for row, result in zip(rows, results, strict=True):
            rate = pass_rate(result)
            if band[0] <= rate <= band[1]:
                handle.write(json.dumps({**row, "solve_rate": rate}, ensure_ascii=False) + "\n")
                kept += 1
    report = {**summary(results, band), "input": s.input, "output": str(out), "k": s.k, "backend": backend.describe()}
    print(json.dumps(report, indent=1))
