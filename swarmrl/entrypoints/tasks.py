"""`swarmrl tasks`: built-in procedural tasks written as JSONL (the INTELLECT-2 RL dataset schema)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from swarmrl.entrypoints.common import fail
from swarmrl.entrypoints.flags import RoleSettings

HELP = "Write built-in procedural tasks as JSONL in the INTELLECT-2 RL dataset schema."
RUN_CONFIG = None


class Settings(RoleSettings):
    output: str
    """the JSONL file to write (its folder is created)"""
    kind: Literal["arithmetic", "instructions", "code"] = "arithmetic"
    """arithmetic: procedural math rows; instructions: procedural instruction-following rows (a plain request
    with IFEval constraints, docs/instructions.md); code: the built-in programming tasks (fixed set)"""
    completions: Literal["reference", "wrong"] | None = None
    """code only: add a completion to each row (its reference or a wrong program), ready for `swarmrl score`"""
    n: int = 1000
    """arithmetic, instructions: how many distinct problems"""
    digits: int = 2
    """arithmetic: digits of each operand"""
    ops: str = "+-"
    """arithmetic: the operators drawn from, made of + and -"""
    split: Literal["train", "test"] = "train"
    """arithmetic, instructions: train, or test (the held-out problems, never in train)"""
    seed: int = 0
    """arithmetic, instructions: which problems are drawn"""
    max_constraints: int = 3
    """instructions: each prompt has 1 to this many constraints"""
    held_out_fraction: float = 0.1
    """instructions: share of the requests held out (as tasks.held_out_fraction; a run's split only with its value)"""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.completions and self.kind != "code":
            raise ValueError("--completions is for --kind code (other rows have no reference programs)")
        return self


def main(settings: Settings, cfg: None) -> None:
    from swarmrl.data.loading import write_jsonl
    from swarmrl.tasks import arithmetic, instructions
    from swarmrl.tasks import code as code_tasks

    try:
        if settings.kind == "code":
            rows = code_tasks.generate(completions=settings.completions)
        elif settings.kind == "instructions":
            rows = instructions.generate(
                settings.n,
                split=settings.split,
                seed=settings.seed,
                max_constraints=settings.max_constraints,
                held_out_fraction=settings.held_out_fraction,
            )
        else:
            rows = arithmetic.generate(
                settings.n, digits=settings.digits, ops=settings.ops, split=settings.split, seed=settings.seed
            )
    except ValueError as e:
        fail(str(e))
    print(f"wrote {write_jsonl(rows, settings.output)} rows to {settings.output}")
