"""Shared fixtures, and the tiers.

Tests live in one folder per cost, and the folder is the marker (`pytest -m unit` is
`pytest tests/unit`):
- `unit/`: pure functions and in-process objects; no process, no network socket (an in-process
  ASGI client is fine), at most a few training steps of a tiny model. `unit/conftest.py` fails a
  test that starts a process or opens a network socket.
- `integration/`: real processes and servers on 127.0.0.1, each bounded to seconds or a minute.
- `e2e/`: whole runs of `swarmrl rl` and the rehearsals in the docs.
Helpers that several modules import live in `support/` (on sys.path, imported by module name).
"""

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "support"))

from runs import EASY, swarmrl  # noqa: E402  (support/ is on the path only from here on)

TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.path)).resolve().relative_to(HERE).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}/ "
                                    f"(its cost tier); move it there")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e":
            item.add_marker(pytest.mark.slow)  # the old spelling of "skip the whole runs"


@pytest.fixture(scope="session")
def easy_base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base") / "model"
    swarmrl("sft", "--output", str(out), "--sft.steps", "150", *EASY)
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
