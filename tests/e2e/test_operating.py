"""docs/operating.md's rehearsal, run exactly as written (issue 18): every role started by hand
(orchestrator, trainer, external validator, relay, two workers) over https with a CA made by
openssl, through to the run's last step.

The block is taken from the docs at test time, so the docs cannot drift from what works. It runs
in bash from a scratch folder holding the project's configs/ (as if it were the project's
folder), with this interpreter's `swarmrl` first on PATH and HOME pointing into the scratch
folder. Its fixed ports (8410-8412) must be free.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness import metrics, run_store, store_rows
from runs import EASY

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- tests/e2e/test_operating.py runs the next block as written -->"
pytestmark = pytest.mark.timeout(600)


def rehearsal_block() -> str:
    text = (ROOT / "docs" / "operating.md").read_text()
    assert MARKER in text, "docs/operating.md lost its rehearsal block"
    found = re.search(r"```bash\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert found is not None
    return found.group(1)


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_readme_holds_the_same_rehearsal():
    readme = (ROOT / "README.md").read_text()
    assert "```bash\n" + rehearsal_block() + "```" in readme, (
        "README.md's hand-started block differs from docs/operating.md's rehearsal: copy it over"
    )


def test_the_rehearsal_block_names_every_role():
    block = rehearsal_block()
    for role in ("rl --prepare", "orchestrator", "trainer", "validator", "relay", "worker", "status"):
        assert f"swarmrl {role}" in block, role
    for flag in ("--tls-cert", "--ca-file", "--trainer-key"):
        assert flag in block


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the rehearsal makes its certificates with openssl")
def seed_the_base_cache(root: Path, easy_base: Path) -> bool:
    """Put the session's easy base where the rehearsal's `rl --prepare` looks for its base, when
    the rehearsal's SFT recipe is the easy base's (the same cache key): the minute of SFT it would
    spend is the one the session already spent (`swarmrl sft` builds both the same way; the build
    itself is tested by the easy_base fixture). False, and nothing copied, when the recipes differ."""
    from swarmrl.config import load_config
    from swarmrl.sft.warmstart import base_cache_key

    cfg = load_config(root / "configs" / "rehearsal.toml")
    if base_cache_key(cfg) != base_cache_key(load_config(None, [*EASY, "--sft.steps", "150"])):
        return False
    shutil.copytree(easy_base, root / cfg.model.base_cache_dir / base_cache_key(cfg))
    return True


def test_every_role_started_by_hand_as_docs_operating_says(tmp_path, easy_base):
    if not all(_free(p) for p in (8410, 8411, 8412)):
        pytest.skip("the rehearsal's ports 8410-8412 are taken on this machine")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    seeded = seed_the_base_cache(tmp_path, easy_base)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # `swarmrl` as installed for this interpreter (a venv's console script, or the module).
    (bindir / "swarmrl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m swarmrl.cli "$@"\n')
    (bindir / "swarmrl").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        ["bash", "-c", rehearsal_block()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}{logs}"
    assert ("building the built-in base model" in proc.stdout + proc.stderr) != seeded, "the base cache was not used"
    run = tmp_path / "runs" / "rehearsal"
    rows = metrics(run)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4], rows
    assert json.loads((run / "trainer_summary.json").read_text())["steps"] == 4
    # Every role did its part: the validator checked groups, the workers fetched through the relay
    # over https, and nobody was rejected.
    assert (
        "https://127.0.0.1:8412"
        in (tmp_path / "logs" / "worker-1.log").read_text() + (tmp_path / "logs" / "worker-2.log").read_text()
    )
    with run_store(run) as store, store.read() as db:
        states = store.group_state_counts(db)
    workers = store_rows(run, "SELECT name, validated, banned FROM workers")
    assert states.get("consumed", 0) >= 4 * 4, states
    assert "rejected" not in states, states
    assert sum(v for _, v, _ in workers) > 0 and not any(b for *_, b in workers), workers
    assert "the run is finished" in (tmp_path / "logs" / "validator.log").read_text()
    # `swarmrl status`, run after the trainer's last step, shows the run at its end.
    assert re.search(r"step 4/4", proc.stdout), proc.stdout[-2000:]
