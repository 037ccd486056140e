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


def test_a_verifiers_environment_plays_replays_and_grades_through_swarmrl():
    if not PYTHON.exists():
        if os.environ.get("SWARMRL_REQUIRE_VERIFIERS") == "1":
            pytest.fail(f"{PYTHON} is missing: run `make verifiers-env`")
        pytest.skip("no .venv-verifiers (make verifiers-env)")
    proc = subprocess.run(
        [str(PYTHON), str(ROOT / "tests" / "support" / "verifiers_adapter_check.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["turns"] == 4 and result["observations"] == 3
