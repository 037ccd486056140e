"""What a worker hands back: one group of G completions of one prompt, and how it is scored.

A group is the unit of GRPO (advantages are relative within it) and the unit of transport. It is
plain JSON so it can cross a process, a disk or (later) an HTTP request unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(kw_only=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # inference logprobs under the sampling temperature
    finish_reason: str  # "stop" | "length"
    seed: int  # the Gumbel-max seed the tokens were drawn with (an episode's turn k: envs.episode.turn_seed)
    # An episode's tokens (model turns and observations): True where the model produced the token.
    # None: a single completion, every token the model's.
    model_mask: list[bool] | None = None
    # An episode's replay by the trusted side: whether the environment ended it (not the budget),
    # and how many of its observations reported a tool error.
    ended_by_env: bool | None = None
    tool_errors: int = 0


@dataclass(kw_only=True)
class Group:
    problem_id: str
    task_type: str
    prompt: str  # the task prompt as given to the model (length suffix included)
    verification_info: str  # JSON string, as in the task schema
    prompt_ids: list[int]
    samples: list[Sample]
    policy_version: int
    worker: str
    temperature: float
    target_length: int | None = None
    created: float = 0.0
    gen_seconds: float = 0.0  # this group's share of the worker's generate call (for time/generation)
    # What the worker declared generated it: "builtin" or "vllm" (with proofs), "openai" (a trusted key's server).
    engine: str = "builtin"
    engine_dtype: str | None = None  # the precision that engine declared, if not the run's
    env_seed: int | None = None  # an episode group's environment seed (its first completion's seed)
    # Filled in by the trusted side, never by a worker:
    rewards: list[float] = field(default_factory=list)
    task_rewards: list[float] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> Group:
        return cls(**{**data, "samples": [Sample(**s) for s in data["samples"]]})

    @classmethod
    def from_json(cls, text: str) -> Group:
        return cls.from_dict(json.loads(text))


def scored_group(
    problem_id: str, prompt_ids: list[int], samples: list[Sample], rewards: list[float], *, worker: str
) -> Group:
    """A group already scored (task reward = reward), of a synthetic task: what builds a trainer batch
    without an orchestrator (benchmarks, the device check)."""
    return Group(
        problem_id=problem_id,
        task_type="synthetic",
        prompt="",
        verification_info="{}",
        prompt_ids=prompt_ids,
        samples=samples,
        policy_version=0,
        worker=worker,
        temperature=1.0,
        rewards=list(rewards),
        task_rewards=list(rewards),
    )
