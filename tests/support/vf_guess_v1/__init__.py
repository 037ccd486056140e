"""A multi-turn guessing game written for verifiers' current API (`verifiers.v1`, all of 0.4), as
a verifiers user writes one: a Taskset of tasks, a Task with its reward, an Env whose `run` drives
the model's seat. Loaded by tests/support/verifiers_v1_check.py inside .venv-verifiers."""

from __future__ import annotations

import re

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: int
    close_reward: bool = False


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.info.get("found", False))

    @vf.reward(weight=0.5)
    async def close(self, trace: vf.Trace) -> float:
        """Half a point for the closest guess (1 - distance / 16), for tasks made with close_reward:
        a group of a model that rarely finds the number still has rewards that differ (the e2e
        run's tiny model)."""
        if not self.data.close_reward or "closest" not in trace.info:
            return 0.0
        return max(0.0, 1.0 - trace.info["closest"] / 16)

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 2
    close_reward: bool = False


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        return [
            GuessTask(
                GuessData(
                    prompt="Guess a number from 1 to 16.",
                    answer=(10 + i) % 16 + 1,
                    close_reward=self.config.close_reward,
                ),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


class GuessEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()  # a prompted task: the model speaks first
            while not segment.terminated:
                numbers = re.findall(r"\d+", segment.last_reply)
                if not numbers:
                    reply = "say a number"
                else:
                    guess = int(numbers[-1])
                    distance = abs(guess - task.data.answer)
                    interaction.trace.info["closest"] = min(distance, interaction.trace.info.get("closest", distance))
                    if guess == task.data.answer:
                        interaction.trace.info["found"] = True
                        break  # leaving the interaction ends the episode
                    reply = "higher" if guess < task.data.answer else "lower"
                segment = await interaction.turn(reply)


__all__ = ["GuessEnv", "GuessTaskset"]
