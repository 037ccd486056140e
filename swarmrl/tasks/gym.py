"""reasoning-gym as a task source: any of its datasets by name, with its config.

`tasks.source = "reasoning_gym"`, `tasks.options = {dataset = "leg_counting", config = {...}}`.
Problems are drawn from the dataset in index order and split by a hash of each question (the
held-out share is `tasks.held_out_fraction`), so the held-out set shares no question with the
training set whatever the sizes; duplicate questions are kept once. Rows are graded by the
dataset's own scorer (swarmrl/rewards/gym.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.rewards.gym import REASONING_GYM, dataset

MAX_POOL = 1 << 20


class GymOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dataset: str
    """the reasoning-gym dataset's name (`reasoning_gym.factory.DATASETS`), e.g. "leg_counting"."""
    config: dict = Field(default_factory=dict)
    """the dataset's own settings (its config class's fields: difficulty ranges and the like)."""
    seed: int | None = None
    """the dataset's seed (default: tasks.seed)."""
    suffix: str = ""
    """text appended to every question (e.g. " Give the final answer in \\boxed{}.")."""
    extract: Literal["answer", "last_number"] = "answer"
    """how a completion's answer is read: "answer" (the last \\boxed{}, else the last <answer> tag,
    else the last line: reasoning-gym's convention) or "last_number" (the last \\boxed{}, else the
    last number written: numeric datasets asked of a model never taught a format)."""


def _held_out(question: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def gym_rows(tasks, options: GymOptions, n: int, split: str) -> list[dict]:
    """`n` rows of `split` from the dataset, by index, split by a hash of each question."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    seed = tasks.seed if options.seed is None else options.seed
    share = tasks.held_out_fraction if split == "test" else 1.0 - tasks.held_out_fraction
    config = json.dumps(options.config, sort_keys=True)
    size = max(64, int(n / share * 1.5) + 16)
    while True:
        ds = dataset(options.dataset, config, seed, size)
        rows, seen = [], set()
        for index in range(size):
            entry = ds[index]
            question = entry["question"]
            fresh = question not in seen
            seen.add(question)
            if not fresh or _held_out(question, tasks.held_out_fraction) != (split == "test"):
                continue
            info = {
                "dataset": options.dataset,
                "config": options.config,
                "seed": seed,
                "size": size,
                "index": index,
                "answer": str(entry["answer"]),
            } | ({"extract": options.extract} if options.extract != "answer" else {})
            rows.append(
                {
                    "problem_id": f"rg-{options.dataset}-{seed}-{index}",
                    "task_type": REASONING_GYM,
                    "prompt": question.strip() + options.suffix,
                    "verification_info": json.dumps(info),
                }
            )
            if len(rows) == n:
                return rows
        if size >= MAX_POOL or len(seen) < size // 2:  # the dataset repeats itself: more draws will not help
            raise ValueError(
                f"reasoning-gym dataset {options.dataset!r} gave {len(rows)} distinct {split} problems of the {n} "
                f"asked for (from {size} draws): ask for fewer (tasks.train_size, tasks.eval_size) or widen its config"
            )
        size *= 4
