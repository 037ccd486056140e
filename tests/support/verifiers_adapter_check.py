"""Run inside .venv-verifiers (tests/integration/test_verifiers_env.py): a verifiers MultiTurnEnv
written here, adapted by swarmrl.envs.verifiers_env, played, replayed and graded by swarmrl's own
episode code. Prints one JSON line of results; any failed check raises."""

from __future__ import annotations

import json
import re

import verifiers as vf
from datasets import Dataset
from episode_script import assert_forgery_refused, check, play

from swarmrl.envs import registry
from swarmrl.envs.verifiers_env import from_verifiers, rows


class Guess(vf.MultiTurnEnv):
    """Find the row's answer in [1, 16]: "higher" / "lower", "correct" ends the game."""

    async def env_response(self, messages, state, **kwargs):
        numbers = re.findall(r"\d+", str(messages[-1]["content"]))
        if not numbers:
            return [vf.UserMessage(content="say a number")]
        guess, target = int(numbers[-1]), int(state["answer"])
        if guess == target:
            msg = vf.UserMessage(content="correct")
            state["final_env_response"] = [msg]
            return [msg]
        return [vf.UserMessage(content="higher" if guess < target else "lower")]


def solved(completion, **kwargs) -> float:
    return 1.0 if any(m["role"] == "user" and m["content"] == "correct" for m in completion) else 0.0


def main() -> None:
    data = Dataset.from_list([{"question": "Guess a number from 1 to 16.", "answer": "11"}])
    vf_env = Guess(dataset=data, rubric=vf.Rubric(funcs=[solved]), max_turns=5)
    env = registry.register(from_verifiers(vf_env, "vf-guess"))
    assert registry.for_task_type("env:vf-guess") is env and env.max_turns == 5
    (row,) = rows(vf_env, "vf-guess")
    assert row["prompt"] == "Guess a number from 1 to 16." and env.check(json.loads(row["verification_info"])) is None
    task = json.loads(row["verification_info"])

    found = play(env, task, "8", "12", "10", "11", max_turns=5)
    assert found.done and found.turns == 4 and found.observations == 3, found
    replayed = check(env, task, found, 5)
    assert replayed.done and replayed.turns == ["8", "12", "10", "11"]
    assert env.reward(task, replayed.turns, 0) == (1.0, None)

    # The game not found in 3 turns: the budget ends it, the rubric gives 0.
    missed = play(env, task, "1", "2", "3", max_turns=3)
    assert not missed.done and missed.turns == 3 and check(env, task, missed, 3).turns == ["1", "2", "3"]
    assert env.reward(task, ["1", "2", "3"], 0) == (0.0, "the rubric gave 0")

    # A worker that edits the environment's answer ("lower" for "higher") is refused.
    assert_forgery_refused(env, task, found, "higher", "lower_", max_turns=5)
    print(json.dumps({"ok": True, "turns": found.turns, "observations": found.observations}))


if __name__ == "__main__":
    main()
