"""Running the CLI as a user would, and the tiny configuration most end-to-end tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A tiny base that learns 1-digit addition in seconds, for tests that need a policy with signal.
EASY = [
    "--tasks.digits",
    "1",
    "--tasks.ops",
    "+-",
    "--tasks.train_size",
    "40",
    "--tasks.eval_size",
    "8",
    "--sft.examples",
    "40",
    "--sft.batch_size",
    "32",
    "--sft.slip_rate",
    "0.5",
    "--sampling.max_new_tokens",
    "32",
    "--sampling.prompts_per_step",
    "4",
    "--sampling.group_size",
    "4",
    "--sampling.worker_batch_prompts",
    "4",
    "--trainer.micro_batch_size",
    "16",
    "--eval.samples",
    "1",
    "--eval.every",
    "0",
    "--logging.progress",
    "false",
]


# Small everything: 2 prompts per lease and per batch, groups of 2, short completions: the
# orchestrator's tests, in a process (orchestrator_harness) or in this one (tests/unit).
TINY_GROUPS = [
    "--sampling.prompts_per_step",
    "2",
    "--sampling.group_size",
    "2",
    "--sampling.worker_batch_prompts",
    "2",
    "--sampling.max_new_tokens",
    "16",
    "--tasks.train_size",
    "40",
    "--tasks.eval_size",
    "4",
    "--async.bound",
    "1",
]


def swarmrl(*args, timeout=300, check=True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a user would; on failure, the assertion shows its output. `env`: variables
    set for it on top of this process's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"swarmrl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def swarmrl_rl(run: Path, base: Path, steps: int, *args: str, **kw) -> subprocess.CompletedProcess:
    """`swarmrl rl` of `steps` steps from `base` into `run`, as a user types it (EASY is the caller's
    to add: where it stands among the other options decides which of two settings wins)."""
    return swarmrl("rl", "--run-dir", str(run), "--model.path", str(base), "--trainer.steps", str(steps), *args, **kw)
