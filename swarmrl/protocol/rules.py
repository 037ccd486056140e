"""Rules of the protocol that both sides apply to a completion, as pure functions.

A worker's sampler must follow them; the orchestrator refuses a group that breaks one with the
reason named in :mod:`swarmrl.protocol.reasons` (docs/protocol.md).
"""

from __future__ import annotations


def termination_problem(
    token_ids: list[int], finish_reason: str, stop_ids: list[int], max_new_tokens: int
) -> str | None:
    """None if the completion ends the way the sampler ends one, else what is wrong.

    A completion stops at its first stop token, or runs to exactly the token limit.
    """
    n = len(token_ids)
    stops = [i for i, t in enumerate(token_ids) if t in stop_ids]
    if stops and stops[0] != n - 1:
        return f"{n - 1 - stops[0]} tokens follow the stop token at position {stops[0]}"
    if stops:
        if finish_reason != "stop":
            return f"ends with the stop token but finish_reason is {finish_reason!r}"
        return None
    if n != max_new_tokens:
        return f"{n} tokens without a stop token: a completion without one runs to the limit ({max_new_tokens})"
    if finish_reason != "length":
        return f"no stop token but finish_reason is {finish_reason!r}"
    return None
