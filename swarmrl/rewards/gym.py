"""reasoning-gym rewards (``task_type = "reasoning_gym"``): graded by the dataset's own scorer.

reasoning-gym (PyPI `reasoning-gym`) makes procedural problems with a scorer each. A row names
its problem rather than carrying it: ``verification_info`` is ``{"dataset": NAME, "config":
{...}, "seed": S, "size": N, "index": I, "answer": A}``, and the grader rebuilds that dataset
(cached per process) and scores the completion's answer against item I with the dataset's
``score_answer``, so its metadata (which the scorers read) never has to survive JSON. ``answer``
is the expected answer, for people and the check.

The answer read from a completion, in order: the last ``\\boxed{...}`` of the answer region
(after ``</think>``), else the last ``<answer>...</answer>`` (reasoning-gym's own convention),
else the region's last non-empty line. A row made with ``extract = "last_number"`` (the task
source's option, for numeric datasets asked of a model never taught a format) is read as math rows
with that extraction are: the last ``\\boxed{}``, else the last number written. A partial score
(some scorers give 0.01 for a wrong but well-formed answer, fractions for partly right ones) is
the reward as it is.
"""

from __future__ import annotations

import functools
import json
import re

from swarmrl.rewards.answer import answer_region, boxed_contents, missing_answer_reason
from swarmrl.rewards.math import extract_last_number

REASONING_GYM = "reasoning_gym"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
EXTRACTS = ("answer", "last_number")
"""How a row's answer is read: "answer" (boxed, <answer> tags, else the last line) or "last_number"."""
INSTALL = "pip install reasoning-gym (or swarmrl[gym])"


def _gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def dataset(name: str, config: str, seed: int, size: int):
    """The reasoning-gym dataset of a row (config as canonical JSON, for the cache's key)."""
    gym = _gym()
    try:
        return gym.create_dataset(name, seed=seed, size=size, **json.loads(config))
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning-gym dataset {name!r} with config {config}: {type(e).__name__}: {e}") from None


def entry_of(info: dict) -> dict:
    ds = dataset(info["dataset"], json.dumps(info.get("config", {}), sort_keys=True), info["seed"], info["size"])
    return ds[info["index"]]


def check_gym(info: dict) -> str | None:
    for key, kind in (("dataset", str), ("seed", int), ("size", int), ("index", int)):
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            return f"a reasoning_gym task needs {key} ({kind.__name__})"
    if not isinstance(info.get("config", {}), dict):
        return "a reasoning_gym task's config must be an object (the dataset's settings)"
    if not 0 <= info["index"] < info["size"]:
        return f"index {info['index']} is outside the dataset's size {info['size']}"
    if info["dataset"] not in _gym().factory.DATASETS:
        return f"reasoning-gym has no dataset {info['dataset']!r}"
    if info.get("extract", "answer") not in EXTRACTS:
        return f"a reasoning_gym task's extract must be one of {', '.join(EXTRACTS)}, got {info.get('extract')!r}"
    return None


def extract(completion: str) -> str | None:
    """The answer a completion gives (see the module's docstring), None when it gives none."""
    region = answer_region(completion)
    if region is None:
        return None
    boxes = boxed_contents(region)
    if boxes:
        return boxes[-1].strip()
    tags = _ANSWER_TAG.findall(region)
    if tags:
        return tags[-1].strip()
    lines = [line.strip() for line in region.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def gym_task_reward(info: dict, completion: str) -> tuple[float, str | None]:
    answer = extract_last_number(completion) if info.get("extract") == "last_number" else extract(completion)
    if answer is None:
        return 0.0, missing_answer_reason(completion, "answer")
    entry = entry_of(info)
    ds = dataset(info["dataset"], json.dumps(info.get("config", {}), sort_keys=True), info["seed"], info["size"])
    score = float(ds.score_answer(answer=answer, entry=entry))
    return score, None if score >= 1.0 else f"reasoning-gym's scorer gave {score:g} for {answer[:40]!r}"
