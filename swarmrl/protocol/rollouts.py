"""What a worker hands back: one group of G completions of one prompt, and how it is scored.

A group is the unit of GRPO (advantages are relative within it) and the unit of transport: the
rollout record the trusted side builds from a worker's `GroupIn` (orchestrator/submissions.py),
stores as `to_json()`, projects into a validator's `ClaimedGroup` and hands the trainer in a
`Batch` (protocol/messages.py). Pydantic models, built by keyword; a keyword they do not have is
an error, as it was when they were dataclasses.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field


class _Record(BaseModel):
    # The trusted side's own record: read back from its store and from the orchestrator's batch
    # reply (lax, as json.loads read it), refused whole for a field it does not know.
    model_config = ConfigDict(extra="forbid")


class Sample(_Record):
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


class Group(_Record):
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
    rewards: list[float] = Field(default_factory=list)
    task_rewards: list[float] = Field(default_factory=list)

    def to_json(self) -> str:
        """The stored payload: every field, in this order, as json.dumps writes it (NaN included)."""
        return json.dumps(self.model_dump(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Group:
        return cls.model_validate_json(text)


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
