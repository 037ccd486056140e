"""Shared prompts: a GRPO group's completions all follow one prompt, so a training forward can run
that prompt once and let every completion attend to its keys and values.

A padded micro-batch computes every row's prompt again: on the default run the prompt is ~30 of a
row's ~66 tokens, and 8 rows share it. Here a micro-batch holds whole prompt sets (rows with the
same prompt ids); the prompts run once, left-padded, filling a KV cache; the cache rows are then
repeated for each completion (`batch_select_indices`), and the completions run on top of it,
right-padded. Autograd flows through the cache, so each prompt's gradient is the sum over its
completions, as in the padded path. Logprobs and gradients match the padded path to float32
rounding (tests/unit/test_trainer.py).

Layout: position j of a completion's logits predicts completion token j (its first token from
the prompt's last position); `unpack` moves values to batch.py's [n, width - 1] layout, column
prompt_len - 1 + j, 0 elsewhere (the loss mask excludes those columns anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swarmrl.trainer.batch import TrainBatch


def prompt_sets(batch: TrainBatch, rows: Tensor) -> list[list[int]]:
    """`rows` grouped by identical prompt ids, in order of first appearance."""
    sets: dict[tuple[int, ...], list[int]] = {}
    for r in rows.tolist():
        p = int(batch.prompt_lens[r])
        sets.setdefault(tuple(batch.input_ids[r, :p].tolist()), []).append(r)
    return list(sets.values())


@dataclass
class SharedPrompts:
    """One micro-batch laid out as k prompts + n completions (see the module docstring)."""

    prompt_ids: Tensor  # [k, P] long, left-padded
    prompt_mask: Tensor  # [k, P] long
    owner: Tensor  # [n] long: the prompt of each row
    completion_ids: Tensor  # [n, C] long, right-padded
    completion_mask: Tensor  # [n, C] long
    prompt_lens: Tensor  # [n] long
    width: int  # the micro-batch's trimmed width minus 1: columns of batch.py's layout

    @classmethod
    def of(cls, mb: TrainBatch) -> SharedPrompts:
        pl = mb.prompt_lens
        lens = mb.attention_mask.sum(1)
        n = len(mb)
        keys: dict[tuple[int, ...], int] = {}
        owner = torch.empty(n, dtype=torch.long)
        first: list[int] = []
        for r in range(n):
            key = tuple(mb.input_ids[r, : int(pl[r])].tolist())
            if key not in keys:
                keys[key] = len(first)
                first.append(r)
            owner[r] = keys[key]
        big_p = int(pl.max())
        prompt_ids = torch.zeros((len(first), big_p), dtype=torch.long)
        prompt_mask = torch.zeros_like(prompt_ids)
        for i, r in enumerate(first):
            p = int(pl[r])
            prompt_ids[i, big_p - p :] = mb.input_ids[r, :p]
            prompt_mask[i, big_p - p :] = 1
        comp = lens - pl  # [n]
        big_c = max(int(comp.max()), 1)
        completion_ids = torch.zeros((n, big_c), dtype=torch.long)
        completion_mask = torch.zeros_like(completion_ids)
        for r in range(n):
            p, c = int(pl[r]), int(comp[r])
            completion_ids[r, :c] = mb.input_ids[r, p : p + c]
            completion_mask[r, :c] = 1
        return cls(
            prompt_ids, prompt_mask, owner, completion_ids, completion_mask, pl.clone(), mb.input_ids.shape[1] - 1
        )

    def logits(self, model, device) -> tuple[Tensor, Tensor]:
        """(logits [n, C, V], targets [n, C]): position j predicts completion token j."""
        from transformers import DynamicCache

        cache = DynamicCache()
        prompt_mask = self.prompt_mask.to(device)
        first = model(
            input_ids=self.prompt_ids.to(device),
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
        )
        owner = self.owner.to(device)
        cache.batch_select_indices(owner)  # each completion's own copy of its prompt's keys and values
        c = self.completion_ids.shape[1]
        rest = model(
            input_ids=self.completion_ids.to(device),
            attention_mask=torch.cat([prompt_mask[owner], self.completion_mask.to(device)], dim=1),
            position_ids=self.prompt_lens.to(device)[:, None] + torch.arange(c, device=device)[None],
            cache=cache,
            use_cache=True,
        )
        logits = torch.cat([first.logits[owner, -1:], rest.logits[:, :-1]], dim=1)
        return logits.float(), self.completion_ids.to(device)

    def unpack(self, values: Tensor) -> Tensor:
        """[n, C] per-completion-position values -> [n, width], batch.py's layout. Differentiable."""
        mask = self.completion_mask.bool().to(values.device)
        rows = torch.arange(len(mask), device=values.device)[:, None].expand_as(mask)
        cols = self.prompt_lens.to(values.device)[:, None] - 1 + torch.arange(mask.shape[1], device=values.device)
        out = values.new_zeros((len(mask), self.width))
        return out.index_put((rows[mask], cols[mask]), values[mask])
