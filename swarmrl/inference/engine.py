"""The rollout-engine seam: what a worker, the validator's callers, eval and serve need from
whatever generates completions, and the one place an engine is built.

An engine turns prompts (token ids) and one seed per row into `Completion`s: token ids, the
logprob of each token under softmax(logits / T), how the completion ended, and, when asked, the
final-layer hidden state behind each token (TOPLOC proofs are built from it) and the top
logprobs per step (serving). `on_step(t, tokens)` is called after each step and may end rows
early (serving's stop strings). The conventions the validator relies on (seeded Gumbel-max
choice keyed by (seed, t), positions of hidden states, the same completion for the same
(policy, prompt, seed) whatever else is in the batch) are the built-in sampler's docstring.

Built-in engines:
- "builtin" (`inference/batch.py`): continuous batching over a pre-allocated KV cache with one
  prefill per distinct prompt, for the families `inference/decoder.py` implements (Qwen2/2.5,
  Qwen3 dense, Llama/SmolLM; `supports(model)` says why a model is refused); for any other model
  it falls back to "hf" and says so on stderr. With ``streams`` above 1, several of them, one per
  core, each on one intra-op thread (`inference/streams.py`): faster on a CPU at small sizes.
- "hf" (`inference/sampler.py`): the generic path over any Hugging Face causal LM's own forward
  (static batches, a growing cache); slower, kept for other architectures and as the reference.
  It keeps every convention above, so its completions carry proofs too.

Engines that cannot provide hidden states or replayable seeds (an OpenAI-compatible server, for
trusted fleets) say so with `provides_hidden` and `seeded`, and a worker that needs proofs
refuses them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Protocol

from swarmrl.inference.batch import BatchEngine
from swarmrl.inference.decoder import supports
from swarmrl.inference.sampler import Completion, Sampler
from swarmrl.inference.streams import StreamedEngine

ENGINES = ("builtin", "hf")


class RolloutEngine(Protocol):
    model: object  # the policy (the validator's prefill and the adversaries need it)
    stop_token_ids: list[int]
    provides_hidden: bool  # can return final-layer hidden states (needed for TOPLOC proofs)
    seeded: bool  # follows the seeded Gumbel-max scheme, so a validator can replay every token
    continuous: bool  # refills finished rows from the prompts it was given (give it them all)

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        return_hidden: bool = False,
        top_logprobs: int = 0,
        on_step: Callable[[int, list[int]], Sequence[bool] | None] | None = None,
    ) -> list[Completion]: ...


def build_engine(
    model,
    tokenizer,
    *,
    kind: str = "builtin",
    stop_token_ids: list[int] | None = None,
    max_batch: int = 64,
    capacity: int | None = None,
    streams: int = 1,
) -> RolloutEngine:
    """The engine for a loaded policy; stops at the tokenizer's end of sequence unless told otherwise.

    ``max_batch`` rows generate at once (the built-in engine refills finished rows from the rest,
    the generic one takes whatever batch it is given); ``capacity`` is the longest prompt + completion
    the built-in engine accepts (its KV cache grows up to it as longer jobs arrive); ``streams``
    above 1 splits the built-in engine's rows over that many single-threaded streams (one per
    core: `inference/streams.py`). The generic engine ignores it.
    """
    if streams < 1:
        raise ValueError(f"streams must be at least 1, got {streams}")
    stop = list(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
    why = supports(model) if kind == "builtin" else None
    if kind == "builtin" and why is None:
        if streams > 1:
            return StreamedEngine(
                model,
                stop_token_ids=stop,
                pad_token_id=tokenizer.pad_token_id,
                streams=streams,
                max_batch=max_batch,
                capacity=capacity,
            )
        return BatchEngine(
            model, stop_token_ids=stop, pad_token_id=tokenizer.pad_token_id, max_batch=max_batch, capacity=capacity
        )
    if kind in ("builtin", "hf"):
        if why is not None:
            # Not an error (the generic engine samples the same way and proves its work), but a
            # user who expected the fast path should learn why a run is slower than documented.
            print(
                f"swarmrl: the built-in engine cannot run this model ({why}); using the generic engine "
                "(the same seeded sampling and proofs, slower; docs/engines.md, 'Model families')",
                file=sys.stderr,
                flush=True,
            )
        return Sampler(model, stop_token_ids=stop, pad_token_id=tokenizer.pad_token_id)
    raise ValueError(f"unknown rollout engine {kind!r}; one of: {', '.join(ENGINES)}")
