"""Environments of PrimeIntellect's `verifiers` library as swarmrl environments (optional extra).

`from_verifiers(vf_env)` wraps a `verifiers.MultiTurnEnv` (verifiers 0.1.8 to 0.3.x, where
`env_response(messages, state)` returns the new messages only and `is_completed(state)` runs the
environment's stop conditions; requirements/verifiers.txt pins 0.3.1) into an `Environment`:

- the task is a row of the environment's formatted dataset (`vf_env.get_dataset()`: its
  `prompt` messages, `answer`, `info`, `example_id`), as `rows()` writes them for swarmrl;
- `respond(task, turns, seed)` rebuilds the environment's state from the row and replays the model
  turns through it (each one: the assistant message, the stop conditions, `env_response`), so it
  is a function of its arguments, as swarmrl's trusted side needs to replay an untrusted worker's
  episode; the observation is the text of the messages `env_response` returned;
- `reward` replays the same way, then scores the transcript with the environment's rubric.

What does not map: an environment whose `env_response`, stop conditions or rubric use randomness,
clocks, a judge model or any remote service (JudgeRubric, sandboxes, MCP and tool environments)
cannot be replayed by the trusted side and gives different observations there (its workers would
be refused as `observation_mismatch`); tool calls (`ToolEnv`) need structured `tool_calls` that
swarmrl's text turns do not carry; system prompts and few-shot messages in a row's prompt are not
sent (swarmrl frames the row's question as one user message); the replay costs O(turns^2)
`env_response` calls per episode. Build the verifiers environment in the main thread (it installs
signal handlers) and register the result before the run starts.
"""

from __future__ import annotations

import asyncio
import json
from copy import deepcopy

from swarmrl.envs.base import Environment, Reply

DEFAULT_MAX_TURNS = 4


def _text(messages) -> str:
    return "\n".join(str(m["content"]) for m in messages if m.get("content"))


def _state(vf_env, row: dict):
    """The state `init_state` makes from a dataset row, without a model client."""
    from verifiers.legacy.types import RolloutTiming, State
    from verifiers.legacy.utils.message_utils import normalize_messages

    state_input = deepcopy(row)
    if isinstance(state_input.get("info"), str):
        state_input["info"] = json.loads(state_input["info"])
    state = State(input=state_input)
    state["task"] = dict(state_input)
    state["prompt"] = normalize_messages(state_input["prompt"], field_name="input.prompt")
    state.update(
        trajectory=[],
        completion=None,
        reward=None,
        metrics=None,
        error=None,
        final_env_response=None,
        is_completed=False,
        is_truncated=False,
        trajectory_id="swarmrl-replay",
        timing=RolloutTiming(),
    )
    return state


async def _replay(vf_env, row: dict, turns: list[str]):
    """(state, messages, reply to the last turn) after replaying `turns` through `vf_env`."""
    import verifiers as vf

    state = _state(vf_env, row)
    messages = list(state["prompt"])
    reply = Reply("", done=True)
    for k, turn in enumerate(turns):
        messages.append(vf.AssistantMessage(content=turn))
        # What the rollout loop records per model turn; max_turns and num_turns count these.
        state["trajectory"].append({"prompt": [], "completion": [], "response": None, "extras": {}})
        if await vf_env.is_completed(state):
            reply = Reply("", done=True)
        else:
            out = await vf_env.env_response(messages, state)
            messages.extend(out)
            text = _text(out)
            done = state.get("final_env_response") is not None or not text
            reply = Reply("" if done else text, done=done)
        if reply.done and k + 1 < len(turns):
            break  # swarmrl's replay refuses turns after the end; nothing more to compute
    state["completion"] = messages[len(state["prompt"]) :]
    return state, messages, reply


def from_verifiers(vf_env, name: str, *, max_turns: int | None = None) -> Environment:
    """A swarmrl `Environment` named `name` that plays `vf_env` (a verifiers MultiTurnEnv)."""

    def respond(task: dict, turns: list[str], seed: int) -> Reply:
        return asyncio.run(_replay(vf_env, task, turns))[2]

    def reward(task: dict, turns: list[str], seed: int) -> tuple[float, str | None]:
        async def score():
            state, _, _ = await _replay(vf_env, task, turns)
            await vf_env.rubric.score_rollout(state)
            return float(state["reward"] or 0.0)

        value = asyncio.run(score())
        return value, None if value > 0 else "the rubric gave 0"

    def check(task: dict) -> str | None:
        missing = [k for k in ("prompt", "answer") if k not in task]
        return f"a verifiers row needs {', '.join(missing)} (rows() writes them)" if missing else None

    turns = max_turns or (vf_env.max_turns if vf_env.max_turns > 0 else DEFAULT_MAX_TURNS)
    return Environment(name, respond, reward, check=check, max_turns=turns)


def rows(vf_env, name: str) -> list[dict]:
    """The environment's dataset as swarmrl task rows (task_type "env:NAME"): the prompt is the
    text of the row's last user message, the verification_info the whole formatted row."""
    out = []
    for i, row in enumerate(vf_env.get_dataset()):
        row = {k: v for k, v in dict(row).items() if k in ("prompt", "answer", "info", "example_id")}
        users = [m for m in row["prompt"] if m["role"] == "user"]
        out.append(
            {
                "problem_id": f"{name}-{row.get('example_id', i)}",
                "task_type": f"env:{name}",
                "prompt": users[-1]["content"] if users else "",
                "verification_info": json.dumps(row, default=str),
            }
        )
    return out
