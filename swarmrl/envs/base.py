"""The environment interface: two pure functions of (task, model turns, seed).

`respond` is called after every model turn with all of the model's turns so far (as text, each
decoded from the tokens the model produced) and returns the observation that follows the latest
one, or `done`. It gets the model's turns only, not the observations: those are its own earlier
answers, which it can recompute, so a transcript cannot smuggle in an observation the environment
never gave. `reward` grades a finished (or cut-off) episode from the same inputs. Neither may
read clocks, files, the network or global random state: the trusted side calls them again on a
worker's submission and must get the same answers (an environment that needs a remote service
cannot be replayed and belongs to trusted workers only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Reply:
    """What the environment says after a model turn."""

    observation: str
    """Text placed after the model's turn as context (never trained on). Empty only when `done`."""
    done: bool
    """The episode is over: the model gets no further turn."""
    tool_error: bool = False
    """The observation reports a failed tool call (bad input to the tool, not a wrong answer):
    counted in metrics apart from the reward, so a tool's failure is never read as the model's."""

    def __post_init__(self):
        if not self.done and not self.observation:
            raise ValueError("an environment reply that does not end the episode needs a non-empty observation")


@dataclass(frozen=True)
class Environment:
    name: str
    respond: Callable[[dict, list[str], int], Reply]
    """(task, model turns so far, seed) -> the reply to the latest turn."""
    reward: Callable[[dict, list[str], int], tuple[float, str | None]]
    """(task, all model turns, seed) -> (reward, why the episode is not solved; None when it is).
    A solved episode may pay less than 1 (guess's turn cost, a verifiers rubric's partial score);
    held-out evaluation counts it in `eval/episode/solved`."""
    check: Callable[[dict], str | None] = lambda task: None
    """task -> what is wrong with it, or None: run on a row before any episode starts."""
    max_turns: int = 4
    """Model turns at most, unless the run's config asks for fewer."""
    visible: Callable[[dict], dict] = lambda task: task
    """task -> the part of it a worker is sent to play the episode (`respond` is called with
    this on both sides; `reward` gets the whole task). Leave out what only grading needs."""
    observation_role: str = "user"
    """The chat role observations are framed as (`episode.chat_framing`)."""
