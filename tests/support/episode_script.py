"""Episodes played from scripted model turns through swarmrl's own episode code, for the
`verifiers` adapter checks (run inside .venv-verifiers: nothing here needs torch). A character
is a token; token 0 ends a turn."""

from __future__ import annotations

from swarmrl.envs.episode import Episode, EpisodeRejected, replay, run_episode

STOP = 0


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != STOP)


def play(env, task, *said, max_turns):
    queue = list(said)
    return run_episode(
        env,
        task,
        0,
        [],
        lambda ctx, budget: encode(queue.pop(0)) + [STOP],
        encode,
        decode,
        max_turns=max_turns,
        max_tokens=300,
    )


def check(env, task, ep, max_turns):
    return replay(env, task, 0, ep, encode, decode, stop_ids={STOP}, max_turns=max_turns, max_tokens=300)


def assert_forgery_refused(env, task, found, said: str, forged_as: str, *, max_turns: int) -> None:
    """The episode `found` with the environment's observation `said` replaced by `forged_as` (one
    token longer, as a worker that edits an answer would send it) is refused by the replay."""
    obs = encode(said)
    at = next(i for i in range(len(found.tokens)) if found.tokens[i : i + len(obs)] == obs)
    forged = found.tokens[:at] + encode(forged_as) + found.tokens[at + len(obs) :]
    try:
        check(env, task, Episode(forged, found.model_mask, found.turns, True), max_turns)
    except EpisodeRejected as e:
        assert e.reason == "observation_mismatch", e
        return
    raise AssertionError("an edited observation passed the replay")
