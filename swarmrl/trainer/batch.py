"""Turning scored groups into padded training tensors.

Alignment convention (shared with `algorithm/loss.py`): every [N, L-1] tensor is indexed by the
*predicted* position, so column t holds the logprob of token t+1 given tokens 0..t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swarmrl.algorithm.advantages import group_advantages
from swarmrl.protocol.rollouts import Group


@dataclass
class TrainBatch:
    input_ids: Tensor  # [N, L] long, right-padded prompt + completion
    attention_mask: Tensor  # [N, L] long
    loss_mask: Tensor  # [N, L-1] bool, True where the predicted token is a completion token
    inference_logprobs: Tensor  # [N, L-1] float, the worker's logprobs (0 off the mask)
    advantages: Tensor  # [N] float
    policy_versions: Tensor  # [N] long, the version that sampled each sequence
    prompt_lens: Tensor | None = None  # [N] long, each row's prompt tokens (None: not known, no shared prompts)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, idx: slice | Tensor) -> TrainBatch:
        return TrainBatch(
            *(
                t[idx]
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.loss_mask,
                    self.inference_logprobs,
                    self.advantages,
                    self.policy_versions,
                )
            ),
            prompt_lens=None if self.prompt_lens is None else self.prompt_lens[idx],
        )

    def trimmed(self) -> TrainBatch:
        """Drop padding columns no sequence of this slice uses (micro-batches vary in length)."""
        width = int(self.attention_mask.sum(1).max())
        return TrainBatch(
            self.input_ids[:, :width],
            self.attention_mask[:, :width],
            self.loss_mask[:, : width - 1],
            self.inference_logprobs[:, : width - 1],
            self.advantages,
            self.policy_versions,
            self.prompt_lens,
        )


def build_train_batch(groups: list[Group], *, pad_token_id: int, normalize_std: bool, adv_eps: float) -> TrainBatch:
    """Groups (with rewards filled in by the trusted side) -> one padded batch."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [P, G]
    adv = group_advantages(rewards, normalize_std=normalize_std, eps=adv_eps).flatten()  # [P*G]
    seqs = [(g, s) for g in groups for s in g.samples]
    width = max(len(g.prompt_ids) + len(s.token_ids) for g, s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    inf_lp = torch.zeros((n, width - 1), dtype=torch.float32)
    versions = torch.empty(n, dtype=torch.long)
    prompt_lens = torch.tensor([len(g.prompt_ids) for g, _ in seqs], dtype=torch.long)
    for i, (g, s) in enumerate(seqs):
        p, c = len(g.prompt_ids), len(s.token_ids)
        input_ids[i, : p + c] = torch.tensor(g.prompt_ids + s.token_ids)
        attention[i, : p + c] = 1
        # Completion token j sits at position p + j and is predicted from position p + j - 1.
        # An episode's observation tokens are context: off the mask, so no loss, no gradient.
        loss_mask[i, p - 1 : p - 1 + c] = True if s.model_mask is None else torch.tensor(s.model_mask)
        inf_lp[i, p - 1 : p - 1 + c] = torch.tensor(s.logprobs)
        versions[i] = g.policy_version
    return TrainBatch(input_ids, attention, loss_mask, inf_lp, adv, versions, prompt_lens)
