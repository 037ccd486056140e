"""The project's own batched KV-cache sampler over any Hugging Face causal LM (CPU or CUDA).

Why not `model.generate`: we need, per generated token, the logprob under the *sampling*
distribution (temperature applied, which the trainer reuses), the seeded Gumbel-max choice that a
validator can replay, and optionally the last hidden state that TOPLOC proofs are built from.

Conventions (the validator relies on them):
- Prompts are left-padded; positions count from each prompt's first real token.
- Token t of a completion is chosen from the logits at the position before it; `hidden[t]` is the
  final-layer hidden state at that same position, i.e. what a prefill of prompt + completion
  gives at positions `len(prompt) - 1 + t`.
- The noise for token t is keyed by (seed, t), t counted from 0 at the first generated token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from transformers import DynamicCache

from swarmrl.inference.seeded import seeded_choice


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under softmax(logits / temperature)
    finish_reason: Literal["stop", "length"]
    hidden: Tensor | None = None  # [len(token_ids), hidden_size], model dtype, on CPU
    # Per token, the `top_logprobs` most likely (token id, logprob) under the same distribution.
    top_logprobs: list[list[tuple[int, float]]] | None = None


def check_rows(prompts: list[list[int]], seeds: list[int]) -> bool:
    """Refuse malformed generate() input with a message; False when there is nothing to do."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: one seed per completion")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    return bool(prompts)


class Sampler:
    """The built-in rollout engine (swarmrl.inference.engine)."""

    provides_hidden = True
    seeded = True
    continuous = False  # static batches: callers chunk their prompts

    def __init__(self, model, *, stop_token_ids: list[int], pad_token_id: int):
        if not stop_token_ids:
            raise ValueError("the sampler needs at least one stop token id (the tokenizer's eos)")
        self.model = model
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = pad_token_id
        # transformers 5 renamed `past_key_values` to `cache`; support both.
        params = inspect.signature(model.base_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: DynamicCache
    ) -> tuple[Tensor, Tensor]:
        """Last-position hidden state [B, H] and logits [B, V]; lm_head only on that position."""
        out = self.model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        hidden = out.last_hidden_state[:, -1]  # [B, H]
        logits = self.model.get_output_embeddings()(hidden)  # [B, V]
        return hidden, logits

    @torch.inference_mode()
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
    ) -> list[Completion]:
        """Sample one completion per prompt (see the module docstring for the conventions).

        ``on_step(t, tokens)`` is called after every step with each row's token t (the pad id
        for rows already finished); it may return one bool per row to end those rows now, as
        if they had stopped (serving uses it for stop strings, per-request token limits and
        streaming). ``top_logprobs`` > 0 also records each step's most likely tokens.
        """
        if not check_rows(prompts, seeds):
            return []
        dev = self.device
        B = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
        next_pos = position_ids[:, -1] + 1  # [B]
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
        stop = torch.tensor(self.stop_token_ids, device=dev)

        cache = DynamicCache()
        hidden, logits = self._forward(input_ids, attention_mask, position_ids, cache)
        tokens = torch.empty((B, max_new_tokens), dtype=torch.long, device=dev)
        logps = torch.empty((B, max_new_tokens), dtype=torch.float32, device=dev)
        hiddens = [] if return_hidden else None
        tops = [] if top_logprobs > 0 else None
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)
        for t in range(max_new_tokens):
            steps = torch.full((B,), t, dtype=torch.int64, device=dev)
            tok = seeded_choice(logits, seed_t, steps, temperature)  # [B]
            scaled = logits.float() / temperature if temperature > 0 else logits.float()
            all_logp = scaled.log_softmax(-1)
            logp = all_logp.gather(-1, tok[:, None])[:, 0]  # [B]
            if tops is not None:
                tops.append(all_logp.topk(top_logprobs, -1))
            tok = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            tokens[:, t], logps[:, t] = tok, logp
            if return_hidden:
                hiddens.append(hidden.to("cpu"))
            is_stop = torch.isin(tok, stop) & ~done
            if on_step is not None:
                ended = on_step(t, tok.tolist())
                if ended is not None:
                    is_stop = is_stop | (torch.tensor(list(ended), dtype=torch.bool, device=dev) & ~done)
            lengths = torch.where(is_stop, torch.full_like(lengths, t + 1), lengths)
            done = done | is_stop
            # One host sync per token; cheap next to the forward pass, and it lets a batch
            # stop as soon as its last member does.
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones((B, 1), dtype=torch.long, device=dev)], 1)
            hidden, logits = self._forward(tok[:, None], attention_mask, next_pos[:, None], cache)
            next_pos = next_pos + 1

        tokens, logps, lengths = tokens.cpu(), logps.cpu(), lengths.cpu()
        stacked = torch.stack(hiddens, 1) if return_hidden else None  # [B, steps, H]
        if tops is not None:
            top_ids = torch.stack([t.indices for t in tops], 1).cpu().tolist()  # [B, steps, k]
            top_vals = torch.stack([t.values for t in tops], 1).cpu().tolist()
        out = []
        for i in range(B):
            n = int(lengths[i])
            ids = tokens[i, :n].tolist()
            out.append(
                Completion(
                    token_ids=ids,
                    logprobs=logps[i, :n].tolist(),
                    finish_reason="stop" if ids and ids[-1] in self.stop_token_ids else "length",
                    hidden=stacked[i, :n].clone() if return_hidden else None,
                    top_logprobs=[list(zip(top_ids[i][j], top_vals[i][j])) for j in range(n)]
                    if tops is not None
                    else None,
                )
            )
        return out
