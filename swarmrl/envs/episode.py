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

import functools
import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

from swarmrl.envs.base import Environment, Reply


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
    env_error: str | None = None
    """The environment raised on the last turn's text (its `respond` failed): the episode ended
    there. The trusted side's replay meets the same failure and refuses the group
    (`environment_error`, not fraud); the worker's loop goes on with its other episodes."""

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


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of model turn `turn` (0-based) of the completion the lease seeded with
    `seed`. Each turn is sampled as a completion of its own (its step count starts at 0), so it
    needs its own noise: the first turn keeps the lease's seed (a one-turn episode samples
    exactly as a single completion does), later ones take a hash of both, below 2**63."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"swarmrl-turn:{seed}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True)
class Turn:
    """A model turn to sample: episode `index`'s turn `turn` (0-based), after `context` (prompt
    and episode so far), at most `budget` tokens."""

    index: int
    turn: int
    context: list[int]
    budget: int


def run_episodes(
    env: Environment,
    jobs: list[tuple[dict, int, list[int]]],
    sample: Callable[[list[Turn]], list[list[int]]],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    *,
    max_turns: int,
    max_tokens: int,
) -> list[Episode]:
    """Play episodes side by side, one per job (task as the worker sees it, the environment's
    seed, prompt ids). Each round `sample` gets every unfinished episode's next `Turn` and returns
    one turn of ids per row (at least one, at most its budget, ending with the stop token unless
    the budget ran out); `encode` turns an observation's text into the ids appended after the turn
    (`chat_framing` for chat models), `decode` a turn's ids into the text the environment reads."""
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"an episode needs max_turns >= 1 and max_tokens >= 1 (got {max_turns}, {max_tokens})")
    tokens: list[list[int]] = [[] for _ in jobs]
    masks: list[list[bool]] = [[] for _ in jobs]
    said: list[list[str]] = [[] for _ in jobs]
    errors = [0] * len(jobs)
    out: list[Episode | None] = [None] * len(jobs)
    live = list(range(len(jobs)))
    while live:
        rows = [Turn(i, len(said[i]), jobs[i][2] + tokens[i], max_tokens - len(tokens[i])) for i in live]
        turns = sample(rows)
        if len(turns) != len(rows):
            raise ValueError(f"the sampler returned {len(turns)} turns for {len(rows)} rows")
        still = []
        for row, turn in zip(rows, turns):
            i, turn = row.index, list(turn)
            if not 1 <= len(turn) <= row.budget:
                raise ValueError(f"the sampler returned a turn of {len(turn)} tokens for a budget of {row.budget}")
            tokens[i] += turn
            masks[i] += [True] * len(turn)
            said[i].append(decode(turn))
            task, seed, _ = jobs[i]
            try:
                reply = env.respond(task, said[i], seed)
            except Exception as e:  # worker-written text the environment cannot take: end this episode only
                out[i] = Episode(tokens[i], masks[i], len(said[i]), False, errors[i], failure(env, e))
                continue
            if reply.done or len(said[i]) >= max_turns:
                out[i] = Episode(tokens[i], masks[i], len(said[i]), reply.done, errors[i])
                continue
            observation = encode(reply.observation)
            if not observation:
                raise ValueError(f"environment {env.name!r}: observation {reply.observation!r} encodes to no tokens")
            if len(tokens[i]) + len(observation) >= max_tokens:  # no room left for the model to answer it
                out[i] = Episode(tokens[i], masks[i], len(said[i]), False, errors[i])
                continue
            tokens[i] += observation
            masks[i] += [False] * len(observation)
            errors[i] += reply.tool_error
            still.append(i)
        live = still
    return [e for e in out if e is not None]


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
    """One episode (`run_episodes` of one job); `sample(context ids, budget)` returns a turn."""
    return run_episodes(
        env,
        [(task, seed, prompt)],
        lambda rows: [sample(r.context, r.budget) for r in rows],
        encode,
        decode,
        max_turns=max_turns,
        max_tokens=max_tokens,
    )[0]


def chat_framing(tokenizer, role: str = "user") -> Callable[[str], list[int]]:
    """`encode` for a chat model: an observation becomes what the tokenizer's chat template puts
    between the end of an assistant turn and the start of the next one, around a message of
    `role` (ChatML: "\\n<|im_start|>user\\nOBS<|im_end|>\\n<|im_start|>assistant\\n"). The model's
    turn already ends with the end-of-turn token, so the template's copy of it is left out.
    Found by rendering a conversation with a marker and cutting after it, so any template that
    renders earlier turns unchanged works; a tokenizer without a template appends the text."""
    if not getattr(tokenizer, "chat_template", None):
        return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    marker = "\u2063swarmrl-turn\u2063"
    end = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""

    @functools.lru_cache(maxsize=4096)  # observations repeat ("higher", a tool's errors): render each once
    def framed(text: str) -> tuple[int, ...]:
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": marker},
                {"role": role, "content": text},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        at = rendered.find(marker)
        if at < 0:
            raise ValueError("the chat template drops earlier assistant turns: frame observations another way")
        rest = rendered[at + len(marker) :]
        if end and rest.startswith(end):
            rest = rest[len(end) :]
        return tuple(tokenizer(rest, add_special_tokens=False)["input_ids"])

    return lambda text: list(framed(text))


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


def failure(env: Environment, e: BaseException) -> str:
    """What an environment's exception says, short enough for a refusal's detail (no traceback)."""
    return f"environment {env.name!r} raised {type(e).__name__}: {e}"[:300]


Responses = Callable[[list[list[str]]], list["Reply | EpisodeRejected"]]
"""Answers for prefixes of an episode's model turns: `respond(task, prefix, seed)` of each, in
order, or the EpisodeRejected that stands for a turn's answer that could not be had (the environment
failed, the time ran out). `replay` raises it only when its checks reach that turn, so a failure on
a later turn never hides what an earlier one shows (an edited observation is fraud, a failing
environment is not)."""


def respond_here(
    env: Environment, task: dict, seed: int, out_of_time: Callable[[], str | None] | None = None
) -> Responses:
    """`Responses` computed in this process, one call after another; before each, `out_of_time()`
    (None: go on; a text: why not) lets a caller stop between turns when its time is spent."""

    def responses(prefixes: list[list[str]]) -> list[Reply | EpisodeRejected]:
        out: list[Reply | EpisodeRejected] = []
        for prefix in prefixes:
            why = out_of_time() if out_of_time is not None else None
            if why:  # this turn and every later one go unanswered
                return out + [EpisodeRejected("not_graded", why)] * (len(prefixes) - len(out))
            try:
                reply = env.respond(task, prefix, seed)
            except Exception as e:
                out.append(EpisodeRejected("environment_error", f"turn {len(prefix)}: {failure(env, e)}"))
                continue
            out.append(reply)
            if reply.done:  # the episode ends here: a later turn is refused before its answer is read
                return out + [reply] * (len(prefixes) - len(out))
        return out

    return responses


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
    responses: Responses | None = None,
) -> Replayed:
    """Run the environment again on a submitted episode's model turns; raise `EpisodeRejected`
    where an observation differs from the environment's (edited or forged tool output, an
    observation the model sampled itself), where the episode goes on after it should have ended,
    or stops before it had to, or where a turn that was answered did not end with a stop token
    (a turn cut short to change what the environment reads). Whether each model token is the
    policy's is the proof and sampling checks' job, over the model positions of `model_mask`.

    The shape is checked first (cheap, in this process); the environment is then asked once for
    all turns (`responses`: in this process by default, or in a grading pool with a timeout), so
    what its code costs on worker-written text can be run where it is bounded and charged."""
    tokens, mask = episode.tokens, episode.model_mask
    if len(tokens) != len(mask):
        raise EpisodeRejected("malformed_episode", f"{len(tokens)} tokens but {len(mask)} mask entries")
    if not tokens or not mask[0]:
        raise EpisodeRejected("malformed_episode", "an episode starts with a model turn")
    if len(tokens) > max_tokens:
        raise EpisodeRejected("over_budget", f"{len(tokens)} tokens, the budget is {max_tokens}")
    spans = runs(mask)  # model runs at even places, observations at odd ones
    if (len(spans) + 1) // 2 > max_turns:  # before any decoding: a mask flipping at every token is cheap to send
        raise EpisodeRejected("continued_after_end", f"{(len(spans) + 1) // 2} model turns; at most {max_turns}")
    said = []
    for k in range(0, len(spans), 2):
        start, end, _ = spans[k]
        # A turn ends at its first stop token, or runs to the episode's budget: a turn cut short
        # would change what the environment reads, two turns run together would skip a reply.
        inner = [j for j in range(start, end - 1) if tokens[j] in stop_ids]
        if inner:
            raise EpisodeRejected("turn_not_stopped", f"turn {len(said) + 1} goes on after a stop token")
        if tokens[end - 1] not in stop_ids and end != max_tokens:
            raise EpisodeRejected(
                "turn_not_stopped", f"turn {len(said) + 1} ends without a stop token before the budget ({max_tokens})"
            )
        said.append(decode(tokens[start:end]))
    replies = (responses or respond_here(env, task, seed))([said[: t + 1] for t in range(len(said))])
    errors = 0
    for t, k in enumerate(range(0, len(spans), 2)):
        end, reply, turn = spans[k][1], replies[t], t + 1
        if not isinstance(reply, Reply):
            raise reply
        last = k + 1 >= len(spans)
        if reply.done or turn >= max_turns:
            if not last:
                raise EpisodeRejected("continued_after_end", f"tokens follow turn {turn}, where the episode ended")
            return Replayed(said, reply.done, errors)
        if end == max_tokens:  # this turn used the budget up: nothing may follow
            return Replayed(said, False, errors)
        expected = encode(reply.observation)
        if end + len(expected) >= max_tokens:
            if not last:
                raise EpisodeRejected("continued_after_end", f"no room for turn {turn}'s observation")
            return Replayed(said, False, errors)
        if last:
            raise EpisodeRejected("stopped_early", f"the episode stops after turn {turn} with budget left")
        o_start, o_end, _ = spans[k + 1]
        if tokens[o_start:o_end] != expected:
            raise EpisodeRejected("observation_mismatch", f"the observation after turn {turn} is not the environment's")
        if k + 2 >= len(spans):
            raise EpisodeRejected("stopped_early", f"no model turn answers observation {turn}")
        errors += reply.tool_error
    raise AssertionError("unreachable: the loop returns or raises at the last run")
