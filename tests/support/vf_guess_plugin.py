"""A swarmrl plug-in, as a verifiers user writes one: it registers the verifiers environment of
tests/support/vf_guess_v1 (with its closest-guess reward) as swarmrl's environment "vf1-guess",
run by .venv-verifiers' interpreter in a process of its own (swarmrl.envs.verifiers_v1.in_process),
since verifiers cannot be installed beside swarmrl. $SWARMRL_VERIFIERS_PYTHON names another one."""

from __future__ import annotations

import os
from pathlib import Path

from swarmrl.envs.registry import register
from swarmrl.envs.verifiers_v1 import in_process

HERE = Path(__file__).resolve().parent
PYTHON = os.environ.get("SWARMRL_VERIFIERS_PYTHON") or str(HERE.parents[1] / ".venv-verifiers" / "bin" / "python")
CONFIG = {"taskset": {"id": "vf_guess_v1", "num_tasks": 16, "close_reward": True}}

register(in_process("vf1-guess", CONFIG, python=PYTHON, max_turns=4, path=[str(HERE)]))
