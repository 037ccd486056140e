"""Multi-turn episodes through a rollout engine (workers and held-out evaluation).

Each round samples the next model turn of every unfinished episode in one `generate` call: the
context is the prompt's ids and the episode so far, exactly as produced (never re-rendered
through the chat template), and turn k of the completion the lease seeded with s is drawn with
seed `turn_seed(s, k)`, its step count starting at 0, so the validator can check each turn as a
completion of its own with everything before it as the prompt. The engine's conventions (hidden
states, logprobs under the sampling temperature) hold per turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from swarmrl.envs.base import Environment
from swarmrl.envs.episode import Episode, Turn, chat_framing, run_episodes, runs, turn_seed
from swarmrl.inference.sampler import Completion
from swarmrl.model.tokenizer import decode_completion


@dataclass(frozen=True)
class EpisodeJob:
    task: dict
    """What the environment reads of the task (`Environment.visible`)."""
    env_seed: int
    """The environment's seed: the same for every episode of a group."""
    prompt: list[int]
    seed: int
    """The completion's sampling seed (the lease's); turn k samples with `turn_seed(seed, k)`."""


@dataclass
class PlayedEpisode:
    episode: Episode
    logprobs: list[float]
    """One per episode token: the model's under the sampling temperature, 0 at observations."""
    finish_reason: str
    """"stop" when the last model turn ended with a stop token, else "length" (the budget)."""
    hidden: list[Tensor] | None
    """Per model turn, the final hidden states behind its tokens (for the turn's TOPLOC proofs)."""


def _cut(c: Completion, budget: int, stop: Sequence[int]) -> Completion:
    """A completion sampled with a larger token limit, as if sampled with `budget`: token t does
    not depend on later ones, so the first `budget` are exactly what that limit gives."""
    if len(c.token_ids) <= budget:
        return c
    ids = c.token_ids[:budget]
    return Completion(
        ids,
        c.logprobs[:budget],
        "stop" if ids[-1] in stop else "length",
        None if c.hidden is None else c.hidden[:budget],
    )


def play_episodes(
    engine,
    tokenizer,
    env: Environment,
    jobs: list[EpisodeJob],
    *,
    max_turns: int,
    max_tokens: int,
    temperature: float,
    return_hidden: bool = False,
    seed_of: Callable[[int, int], int] = turn_seed,
) -> list[PlayedEpisode]:
    """Play one episode per job with `engine` (any RolloutEngine: rows of one round share one
    generate call, at the largest budget among them, each cut to its own). `seed_of(seed, turn)`
    is each turn's sampling seed (only a test's cheat changes it)."""
    stop = list(engine.stop_token_ids)
    sampled: dict[tuple[int, int], Completion] = {}

    def sample(rows: list[Turn]) -> list[list[int]]:
        outs = engine.generate(
            [r.context for r in rows],
            [seed_of(jobs[r.index].seed, r.turn) for r in rows],
            max_new_tokens=max(r.budget for r in rows),
            temperature=temperature,
            return_hidden=return_hidden,
        )
        turns = []
        for r, out in zip(rows, outs, strict=True):
            out = _cut(out, r.budget, stop)
            sampled[(r.index, r.turn)] = out
            turns.append(out.token_ids)
        return turns

    episodes = run_episodes(
        env,
        [(j.task, j.env_seed, j.prompt) for j in jobs],
        sample,
        chat_framing(tokenizer, env.observation_role),
        lambda ids: decode_completion(tokenizer, ids, stop),
        max_turns=max_turns,
        max_tokens=max_tokens,
    )
    played = []
    for i, ep in enumerate(episodes):
        logprobs: list[float] = []
        hidden: list[Tensor] = []
        k = 0
        for start, end, is_model in runs(ep.model_mask):
            if is_model:
                turn = sampled[(i, k)]
                logprobs += turn.logprobs
                if turn.hidden is not None:
                    hidden.append(turn.hidden)
                k += 1
            else:
                logprobs += [0.0] * (end - start)
        finish = "stop" if ep.tokens[-1] in stop else "length"
        played.append(PlayedEpisode(ep, logprobs, finish, hidden if return_hidden else None))
    return played
