"""Build functions for tests/unit/test_process_env.py: environments that swarmrl/envs/process.py
runs in a child interpreter (standard library and swarmrl.envs only, as a child may have)."""

from __future__ import annotations

import time

from swarmrl.envs.base import Environment, Reply
from swarmrl.envs.builtin import GUESS


def guess(name: str = "guess") -> Environment:
    return Environment(name, GUESS.respond, GUESS.reward, check=GUESS.check, max_turns=GUESS.max_turns)


def _noisy_respond(task: dict, turns: list[str], seed: int) -> Reply:
    print("a library that prints on stdout")  # must not be read as the reply
    if turns[-1] == "hang":
        time.sleep(60)
    if turns[-1] == "boom":
        raise KeyError("the environment's own bug")
    return Reply(f"you said {turns[-1]}", done=len(turns) >= 2)


def noisy() -> Environment:
    return Environment("noisy", _noisy_respond, lambda task, turns, seed: (0.5, "half"), max_turns=2)
