"""An episode as one token sequence, and its replay by the trusted side.

Token in, token out: the episode is the prompt's ids followed by `tokens`, the model's turns and
the environment's observations in order, each kept as the ids that were actually produced or
appended; earlier turns are never re-rendered through a chat template (a template that drops
earlier `<think>` blocks, or retokenises text differently from the ids the model sampled, would
make the trained sequence differ from the sampled one). `model_mask[i]` says whether tokens[i]
was produced by the model: loss, advantages, proofs and logprob checks use those positions only;
observation tokens are context.

The budget is `max_turns` model turns and `max_tokens` episode tokens after the prompt. The
episode ends when the environment says so, after the last allowed turn, when a turn uses up the
token budget, or when the next observation would leave no room for another model token (it is
then not appended: observations are never cut, so a replay can compare them whole).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from swarmrl.envs.base import Environment


@dataclass(frozen=True)
class Episode:
    tokens: list[int]
    """After the prompt: model turns and observations, in order."""
    model_mask: list[bool]
    """One per token: True where the model produced it."""
    turns: int
    """Model turns."""
    done: bool
    """The environment ended it (False: the turn or token budget did)."""
    tool_errors: int = 0
    """Observations that reported a failed tool call."""

    @property
    def observation_tokens(self) -> int:
        return len(self.tokens) - sum(self.model_mask)

    @property
    def observations(self) -> int:
        """Observations appended (for a tool environment: tool calls answered)."""
        return sum(1 for _, _, is_model in runs(self.model_mask) if not is_model)


def runs(mask: list[bool]) -> list[tuple[int, int, bool]]:
    """Maximal runs of equal mask values as (start, end, is_model), in order."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def run_episode(
    env: Environment,
    task: dict,
    seed: int,
    prompt: list[int],
    sample: Callable[[list[int], int], list[int]],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    *,
    max_turns: int,
    max_tokens: int,
) -> Episode:
    """Play one episode. `sample(context ids, budget)` returns the model's next turn (at least one
    id, at most `budget`, ending with its stop token unless the budget ran out); `encode` turns an
    observation's text into the ids appended after the turn; `decode` a turn's ids into the text
    the environment reads."""
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"an episode needs max_turns >= 1 and max_tokens >= 1 (got {max_turns}, {max_tokens})")
    tokens: list[int] = []
    mask: list[bool] = []
    said: list[str] = []
    errors = 0
    while True:
        budget = max_tokens - len(tokens)
        turn = list(sample(prompt + tokens, budget))
        if not 1 <= len(turn) <= budget:
            raise ValueError(f"the sampler returned a turn of {len(turn)} tokens for a budget of {budget}")
        tokens += turn
        mask += [True] * len(turn)
        said.append(decode(turn))
        reply = env.respond(task, said, seed)
        if reply.done or len(said) >= max_turns:
            return Episode(tokens, mask, len(said), reply.done, errors)
        observation = encode(reply.observation)
        if not observation:
            raise ValueError(f"environment {env.name!r}: observation {reply.observation!r} encodes to no tokens")
        if len(tokens) + len(observation) >= max_tokens:  # no room left for the model to answer it
            return Episode(tokens, mask, len(said), False, errors)
        tokens += observation
        mask += [False] * len(observation)
        errors += reply.tool_error


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """What the dashboard and metrics show of a batch of episodes: turns per episode, tool calls
    (observations) per episode, tool errors, the share of observation tokens (context, never
    trained on) and the share the environment ended (the rest ran out of budget)."""
    if not episodes:
        return {}
    n, tokens = len(episodes), sum(len(e.tokens) for e in episodes)
    return {
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/tool_calls_mean": sum(e.observations for e in episodes) / n,
        "episode/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "episode/observation_token_share": sum(e.observation_tokens for e in episodes) / max(tokens, 1),
        "episode/ended_by_env_frac": sum(e.done for e in episodes) / n,
    }


@dataclass(frozen=True)
class Replayed:
    """The trusted side's reading of an episode that replayed cleanly."""

    turns: list[str]
    """The model's turns as text, as the environment read them."""
    done: bool
    tool_errors: int


class EpisodeRejected(ValueError):
    """The submitted episode is not what the environment would have produced. `reason` is the
    rejection's short name (counted as fraud: only an edited episode can fail a replay)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def replay(
    env: Environment,
    task: dict,
    seed: int,
    episode: Episode,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    *,
    stop_ids: Collection[int],
    max_turns: int,
    max_tokens: int,
) -> Replayed:
    """Run the environment again on a submitted episode's model turns; raise `EpisodeRejected`
    where an observation differs from the environment's (edited or forged tool output, an
    observation the model sampled itself), where the episode goes on after it should have ended,
    or stops before it had to, or where a turn that was answered did not end with a stop token
    (a turn cut short to change what the environment reads). Whether each model token is the
    policy's is the proof and sampling checks' job, over the model positions of `model_mask`."""
    tokens, mask = episode.tokens, episode.model_mask
    if len(tokens) != len(mask):
        raise EpisodeRejected("malformed_episode", f"{len(tokens)} tokens but {len(mask)} mask entries")
    if not tokens or not mask[0]:
        raise EpisodeRejected("malformed_episode", "an episode starts with a model turn")
    if len(tokens) > max_tokens:
        raise EpisodeRejected("over_budget", f"{len(tokens)} tokens, the budget is {max_tokens}")
    spans, said, errors = runs(mask), [], 0
    for k in range(0, len(spans), 2):  # model runs at even places, observations at odd ones
        start, end, _ = spans[k]
        said.append(decode(tokens[start:end]))
        reply = env.respond(task, said, seed)
        last = k + 1 >= len(spans)
        if reply.done or len(said) >= max_turns:
            if not last:
                raise EpisodeRejected("continued_after_end", f"tokens follow turn {len(said)}, where the episode ended")
            return Replayed(said, reply.done, errors)
        if end == max_tokens:  # this turn used the budget up: nothing may follow
            return Replayed(said, False, errors)
        if tokens[end - 1] not in stop_ids:
            raise EpisodeRejected("turn_not_stopped", f"turn {len(said)} ends without a stop token")
        expected = encode(reply.observation)
        if end + len(expected) >= max_tokens:
            if not last:
                raise EpisodeRejected("continued_after_end", f"no room for turn {len(said)}'s observation")
            return Replayed(said, False, errors)
        if last:
            raise EpisodeRejected("stopped_early", f"the episode stops after turn {len(said)} with budget left")
        o_start, o_end, _ = spans[k + 1]
        if tokens[o_start:o_end] != expected:
            raise EpisodeRejected(
                "observation_mismatch", f"the observation after turn {len(said)} is not the environment's"
            )
        if k + 2 >= len(spans):
            raise EpisodeRejected("stopped_early", f"no model turn answers observation {len(said)}")
        errors += reply.tool_error
    raise AssertionError("unreachable: the loop returns or raises at the last run")
