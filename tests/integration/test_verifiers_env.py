"""The `verifiers` adapter (swarmrl/envs/verifiers_env.py) against the real library: a
MultiTurnEnv written in tests/support/verifiers_adapter_check.py, run in .venv-verifiers (`make
verifiers-env`, requirements/verifiers.txt), played, replayed (an edited observation refused) and
graded by its rubric through swarmrl's episode code. Skipped when the venv is missing, unless
SWARMRL_REQUIRE_VERIFIERS=1 (CI's `make test` sets it, so there it cannot be skipped)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"


def run_check(script: str) -> dict:
    """`script` (tests/support/) run in .venv-verifiers: its one JSON line of results."""
    if not PYTHON.exists():
        if os.environ.get("SWARMRL_REQUIRE_VERIFIERS") == "1":
            pytest.fail(f"{PYTHON} is missing: run `make verifiers-env`")
        pytest.skip("no .venv-verifiers (make verifiers-env)")
    proc = subprocess.run(
        [str(PYTHON), str(ROOT / "tests" / "support" / script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_verifiers_environment_plays_replays_and_grades_through_swarmrl():
    result = run_check("verifiers_adapter_check.py")
    assert result["ok"] and result["turns"] == 4 and result["observations"] == 3


def test_a_verifiers_v1_environment_plays_replays_and_grades_through_swarmrl():
    """The same for an environment written for verifiers' current API (verifiers.v1: all of 0.4,
    shipped in 0.3.1 too): tests/support/verifiers_v1_check.py, adapted by swarmrl.envs.verifiers_v1.
    The check also passed against verifiers 0.4.0 itself, in a venv of its own (docs/environments.md)."""
    result = run_check("verifiers_v1_check.py")
    assert result["ok"] and result["turns"] == 4
