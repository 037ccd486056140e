"""Sequence packing: micro-batches by token budget instead of by sequence count.

A padded micro-batch of n sequences costs n x (longest length) tokens of compute; on GRPO's mixed
lengths (a short answer next to one that hit `max_new_tokens`) most of that is padding. Packing
lays whole sequences end to end in one row of at most `trainer.max_tokens_per_micro_batch`
tokens, so every forward computes real tokens only and its memory is bounded by the budget, not
by the longest sequence times the count.

Each pack is one forward pass of shape [1, T]:
- `position_ids` restart at 0 at every sequence start, so rotary embeddings see the positions each
  sequence has on its own; Hugging Face models (transformers 5.x, `masking_utils`) read the restarts
  as sequence boundaries and keep attention block-diagonal, for sdpa, eager, flex and
  flash attention alike, provided no 2D attention mask is passed and no KV cache is created (the
  caller passes `use_cache=False`; tests/unit/test_packing.py checks the isolation on a real Qwen2);
- the logprob column that predicts a sequence's first token from the previous sequence's last
  token is never mapped back: `unpack` only copies the columns a sequence predicts itself.

The index maps (`src`, `dst_row`, `dst_col`) scatter per-token values of the packed row back into
batch.py's [n, L-1] layout (column t predicts token t+1), so the loss and metrics code is shared
with the padded path unchanged.

Bin packing is first-fit decreasing: the whole rank share is known before the first forward (no
streaming), FFD never uses more than 11/9 OPT + 6/9 bins, and it is deterministic (ties broken by
row index), so every rank that packs the same rows gets the same packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BUDGET_FIELD = "trainer.max_tokens_per_micro_batch"


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sequence indices into bins whose lengths sum to at most `budget`.

    Longest first, each into the first bin with room (else a new bin); bins list their indices in
    ascending order. A sequence longer than the budget is an error that names the config field.
    """
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ValueError(
            f"{BUDGET_FIELD}={budget} is smaller than a sequence of {max(too_long)} tokens "
            f"(prompt + completion) in this batch: set it to at least {max(too_long)}, "
            "or leave it unset to pad micro-batches of trainer.micro_batch_size sequences"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(budget - lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class Pack:
    """One packed forward: several whole sequences laid end to end in a single row."""

    rows: Tensor  # [k] long, which of the packed sequences (indices into the input), in row order
    input_ids: Tensor  # [1, T] long, the k sequences concatenated, no padding
    position_ids: Tensor  # [1, T] long, 0..len-1 within each sequence
    src: Tensor  # [M] long, column of the packed [1, T-1] layout (column c predicts token c+1)
    dst_row: Tensor  # [M] long, 0..k-1: which sequence of `rows` the value belongs to
    dst_col: Tensor  # [M] long, its column in batch.py's [k, width] layout
    width: int  # longest sequence - 1: the columns of the unpacked layout

    def unpack(self, packed: Tensor) -> Tensor:
        """[1, T-1] per-position values (logprobs, entropy) -> [k, width], batch.py's layout.

        Differentiable; columns a sequence does not predict (padding, and the packed column that
        crosses into it from the previous sequence) are 0, which the loss mask excludes anyway.
        """
        out = packed.new_zeros((len(self.rows), self.width))  # [k, width]
        return out.index_put(
            (self.dst_row.to(out.device), self.dst_col.to(out.device)), packed[0, self.src.to(packed.device)]
        )


def pack_sequences(input_ids: Tensor, lengths: Tensor, budget: int) -> list[Pack]:
    """Right-padded sequences [N, L] with `lengths` [N] -> packs of at most `budget` tokens each.

    Every sequence lands in exactly one pack; a pack's `rows` index into the N sequences.
    """
    lens = [int(n) for n in lengths]
    if min(lens, default=1) < 1:
        raise ValueError("cannot pack an empty sequence: every sequence needs at least one token")
    packs = []
    for members in first_fit_decreasing(lens, budget):
        ids, pos, src, dst_row, dst_col = [], [], [], [], []
        offset = 0
        for r, i in enumerate(members):
            n = lens[i]
            ids.append(input_ids[i, :n])
            pos.append(torch.arange(n))
            # Packed column offset + c predicts token offset + c + 1, which is the sequence's own
            # token c + 1 for c < n - 1: batch.py's column c. Column offset + n - 1 would predict
            # the next sequence's first token from this one's last: never mapped.
            src.append(torch.arange(offset, offset + n - 1))
            dst_row.append(torch.full((n - 1,), r))
            dst_col.append(torch.arange(n - 1))
            offset += n
        packs.append(
            Pack(
                rows=torch.tensor(members, dtype=torch.long),
                input_ids=torch.cat(ids)[None],  # [1, T]
                position_ids=torch.cat(pos)[None],  # [1, T]
                src=torch.cat(src),
                dst_row=torch.cat(dst_row),
                dst_col=torch.cat(dst_col),
                width=max(lens[i] for i in members) - 1,
            )
        )
    return packs
