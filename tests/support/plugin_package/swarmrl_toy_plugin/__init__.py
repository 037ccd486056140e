"""A swarmrl plug-in from outside the package: importing it registers

- the environment "chain": two additions in two turns. The prompt asks for a + b; the environment
  answers the model's first turn with "Now add c." and grades the last number of the second turn
  against a + b + c (the first turn's own number is what it builds on, so a wrong first answer
  can still be carried correctly: the reward is 1 for a + b + c, 0.5 for (first answer) + c);
- the task source "chain" (options: `high`, the largest operand), its rows episodes of "chain",
  held out by a hash of each problem;
- the engine backend "counted": the built-in engine, logging each version it loads with the tag
  its option `tag` names (so a test can see that a run's workers used it). It reproduces the
  built-in sampler's arithmetic, so its groups declare "builtin" and carry the same proofs.
"""

from __future__ import annotations

import hashlib
import json
import re

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.envs.base import Environment, Reply
from swarmrl.envs.registry import register as register_environment
from swarmrl.envs.registry import task_type
from swarmrl.inference.backends import BuiltinSession, EngineBackend, NoOptions
from swarmrl.inference.backends import register as register_engine
from swarmrl.tasks.registry import TaskSource
from swarmrl.tasks.registry import register as register_source

_NUMBER = re.compile(r"-?\d+")


def _last(text: str) -> int | None:
    found = _NUMBER.findall(text[-200:])
    return int(found[-1]) if found else None


def _check(task: dict) -> str | None:
    if not all(isinstance(task.get(k), int) for k in ("a", "b", "c")):
        return "a chain task needs integers a, b and c"
    return None


def _respond(task: dict, turns: list[str], seed: int) -> Reply:
    if len(turns) == 1:
        return Reply(f"Now add {task['c']}.", done=False)
    return Reply("", done=True)


def _reward(task: dict, turns: list[str], seed: int) -> tuple[float, str | None]:
    if len(turns) < 2:
        return 0.0, "stopped after the first turn"
    first, final = _last(turns[0]), _last(turns[-1])
    if final == task["a"] + task["b"] + task["c"]:
        return 1.0, None
    if first is not None and final == first + task["c"]:
        return 0.5, "carried a wrong first sum correctly"
    return 0.0, "wrong final sum"


CHAIN = Environment("chain", _respond, _reward, check=_check, max_turns=2)


class ChainOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    high: int = Field(4, ge=1, le=9)


def _rows(tasks, options: ChainOptions, n: int, split: str) -> list[dict]:
    rows = []
    for a in range(1, options.high + 1):
        for b in range(1, options.high + 1):
            for c in range(1, options.high + 1):
                key = f"{a}+{b}+{c}"
                held = hashlib.sha256(key.encode()).digest()[0] < 26  # about 10 %
                if held == (split == "test"):
                    rows.append(
                        {
                            "problem_id": f"chain-{a}-{b}-{c}",
                            "task_type": task_type("chain"),
                            "prompt": f"Compute {a} + {b}.",
                            "verification_info": json.dumps({"a": a, "b": b, "c": c}),
                        }
                    )
    if len(rows) < n:
        raise ValueError(f"chain has {len(rows)} {split} problems with high = {options.high}: raise high or ask fewer")
    return rows[:n]


class CountedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = "counted"


class CountedSession(BuiltinSession):
    def __init__(self, options: CountedOptions, ctx):
        super().__init__(NoOptions(), ctx)
        self.tag, self.loads = options.tag, 0

    def load(self, folder, base, version, dtype):
        engine, tok, where = super().load(folder, base, version, dtype)
        self.loads += 1
        self.ctx.log(f"counted engine {self.tag}: load {self.loads}, policy v{version}")
        return engine, tok, where


register_environment(CHAIN)
register_source(TaskSource("chain", _rows, ChainOptions, mixable=False, help="two additions in two turns"))
register_engine(
    EngineBackend(
        "counted", CountedSession, CountedOptions, declares="builtin", streams=True, help="the built-in engine, counted"
    )
)
