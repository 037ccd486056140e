"""The real tier's assets: the cache `make real-assets` prepares (docs/real-models.md).

Missing assets fail the tier with the command that makes them, never skip it: in CI they are
installed by the project's own files (`make test` depends on `real-assets`), and a skipped real
tier would hide exactly what this tier is for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swarmrl.assets.prepare import MANIFEST, MODEL_NAME, default_cache


@pytest.fixture(scope="session")
def assets() -> Path:
    cache = default_cache()
    manifest = cache / MANIFEST
    if not manifest.is_file():
        pytest.fail(f"the real assets are not prepared in {cache}: run `make real-assets` (or set SWARMRL_ASSETS)")
    assert json.loads(manifest.read_text())["model"] == f"models/{MODEL_NAME}"
    return cache


@pytest.fixture(scope="session")
def real_model(assets) -> Path:
    return assets / "models" / MODEL_NAME


@pytest.fixture(scope="session")
def real_data(assets) -> Path:
    return assets / "data"


VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """vLLM's environment (`make vllm-env`), where proving vLLM workers run. Skipped only when it
    is missing and SWARMRL_REQUIRE_VLLM is unset (CI sets it, so there it fails instead)."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("SWARMRL_REQUIRE_VLLM"):
            pytest.fail(f"{VLLM_PYTHON} is missing and SWARMRL_REQUIRE_VLLM is set: run `make vllm-env`")
        pytest.skip(f"no vLLM environment ({VLLM_PYTHON}): `make vllm-env` builds it")
    return VLLM_PYTHON
