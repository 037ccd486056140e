"""Shared fixtures, and the tiers.

Tests live in one folder per cost, and the folder is the marker (`pytest -m unit` is
`pytest tests/unit`):
- `unit/`: pure functions and in-process objects; no process, no network socket (an in-process
  ASGI client is fine), at most a few training steps of a tiny model. `unit/conftest.py` fails a
  test that starts a process or opens a network socket.
- `integration/`: real processes and servers on 127.0.0.1, each bounded to seconds or a minute.
- `e2e/`: whole runs of `swarmrl rl` and the rehearsals in the docs.
- `real/`: the real pretrained checkpoint, benchmark rows and vLLM (`make real-assets`, `make
  vllm-env` prepare them; docs/real-models.md) through every role, bounded like integration tests.
Helpers that several modules import live in `support/` (on sys.path, imported by module name).
"""

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "support"))

from runs import EASY, swarmrl  # noqa: E402  (support/ is on the path only from here on)

TIERS = ("unit", "integration", "e2e", "real")
# The real tier writes 0.5 GB per copy of the real model (versions at the trainer, relay, worker and
# validator, checkpoints with optimizer state, vLLM's reload copies): its peak on 2 xdist workers
# was 10.7 GB above the start (machine E, 2026-12-06). A CI run once failed 180 tests on a full disk.
REAL_TIER_FREE_GB = 14


def _check_free_disk(config) -> None:
    where = Path(config.option.basetemp or tempfile.gettempdir())
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free / 1e9
    if free < REAL_TIER_FREE_GB:
        raise pytest.UsageError(
            f"tests/real needs about {REAL_TIER_FREE_GB} GB free under {where} (the real model's versions, "
            f"checkpoints and vLLM copies: 10.7 GB at its peak); {free:.1f} GB are free. Free space there "
            "(old run folders, /tmp/pytest-of-*), point --basetemp at a larger disk, or deselect the tier "
            "(-m 'not real')"
        )


def pytest_collection_modifyitems(config, items):
    if any(Path(str(item.path)).resolve().relative_to(HERE).parts[0] == "real" for item in items):
        _check_free_disk(config)
    for item in items:
        tier = Path(str(item.path)).resolve().relative_to(HERE).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}/ (its cost tier); move it there"
            )
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e":
            item.add_marker(pytest.mark.slow)  # the old spelling of "skip the whole runs"


@pytest.fixture(scope="session")
def easy_base(tmp_path_factory) -> Path:
    """The tiny warm-started base of the end-to-end runs (about a minute of SFT on 2 cores), built
    once per session: under pytest-xdist the workers share one build (the first builds it under a
    file lock, the others wait and read it), so running in parallel does not pay for it twice."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder every worker's basetemp sits in
    out, done = root / "easy-base" / "model", root / "easy-base" / "done"
    with open(root / "easy-base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a build that died half-way
            swarmrl("sft", "--output", str(out), "--sft.steps", "150", *EASY)
            done.touch()
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core box: one intra-op thread is fastest (two OpenMP threads
    contend for one free core and run several times slower) and deterministic."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
