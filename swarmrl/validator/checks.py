"""The validator's checks as pure functions over a prefill's logits and hidden states.

Conventions are the sampler's: for a completion of n tokens after a prompt of p tokens, row t of
`logits` / `hidden` is the prefill at position p - 1 + t, the position whose output chose token t.
"""

from __future__ import annotations

import torch
from torch import Tensor

from swarmrl.inference.seeded import GUMBEL_MAX, gumbel_at, gumbel_noise


def sampling_margins(logits: Tensor, tokens: Tensor, seeds: Tensor, steps: Tensor, temperature: Tensor) -> Tensor:
    """Per row, how far the submitted token's score is below the best score its seed gives:
    max_v(logits/T + g(seed, step, v)) - (logits/T + g(seed, step, token)). 0 when the token is
    the seeded sampler's choice. Rows may come from many completions: logits [N, V], tokens,
    seeds, steps [N] (step = position in its completion), temperature [N, 1] (0: plain logits).

    The noise is computed only where it could matter: a token whose logit/T is more than the
    largest possible noise below the submitted token's score cannot beat it whatever its noise,
    so with a real vocabulary (150k entries) only a handful of entries per row are hashed.
    """
    logits = logits.float()
    temperature = temperature.float()
    greedy = (temperature <= 0)[:, 0]
    base = logits / torch.where(temperature <= 0, 1.0, temperature)
    g_tok = torch.where(greedy, 0.0, gumbel_at(seeds, steps, tokens))
    s_tok = base.gather(-1, tokens[:, None])[:, 0] + g_tok
    reach = torch.where(greedy, 0.0, GUMBEL_MAX)
    contenders = base + reach[:, None] >= s_tok[:, None]
    if int(contenders.sum()) > contenders.numel() // 4:
        # Small vocabularies (the built-in char model): most entries contend; hash them all.
        noise = gumbel_noise(seeds, steps, base.shape[-1])
        best = (base + torch.where(greedy[:, None], 0.0, noise)).max(-1).values
        return best - s_tok
    rows, cols = contenders.nonzero(as_tuple=True)
    scores = base[rows, cols] + torch.where(greedy[rows], 0.0, gumbel_at(seeds[rows], steps[rows], cols))
    best = torch.full_like(s_tok, -torch.inf).scatter_reduce(0, rows, scores, "amax")
    return best - s_tok


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: Tensor) -> Tensor:
    """log p(token) under softmax(logits / T), as the sampler reports it (T = 0: plain logits)."""
    temperature = temperature.float()
    scaled = logits.float() / torch.where(temperature <= 0, 1.0, temperature)
    return scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
