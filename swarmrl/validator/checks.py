"""The validator's checks as pure functions over a prefill's logits and hidden states.

Conventions are the sampler's: for a completion of n tokens after a prompt of p tokens, row t of
`logits` / `hidden` is the prefill at position p - 1 + t, the position whose output chose token t.
"""

from __future__ import annotations

import torch
from torch import Tensor

from swarmrl.inference import native
from swarmrl.inference.seeded import GUMBEL_MAX, gumbel_at, gumbel_noise, stream_keys, vocab_term_u32


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


def _seeded_score(logits: Tensor, seeds: Tensor, steps: Tensor, index: Tensor, temp: float) -> tuple[Tensor, Tensor]:
    """Per row, the scaled logit of entry `index` and its seeded score (scaled logit + its Gumbel
    noise), with the float32 operations of `sampling_margins`."""
    chosen = logits.gather(-1, index[:, None])[:, 0]
    base = chosen if temp == 1.0 else chosen / temp
    return base, base + gumbel_at(seeds, steps, index)


def seeded_rows(
    lib: native.Kernels, logits: list[Tensor], tokens: list[Tensor], seeds: list[int], temperatures: list[float]
) -> tuple[Tensor, Tensor]:
    """`sampling_margins` and `token_logprobs` of many completions in one pass over each
    completion's logits, through the built-in engine's own C kernel (`native.seeded_argmax`:
    the seeded choice and the row's log-sum-exp): per completion, float32 logits [n, V], its
    tokens [n], seed and temperature (> 0). Returns (margins, logprobs), each [sum n].

    Why: on a real vocabulary the torch forms make half a dozen passes over a [tokens, V] float32
    matrix (scaling, the contenders' mask and its count, a log-softmax) and one copy to join the
    completions; on SmolLM2-135M (49,152 entries) that was about 40 % of the validator's time.
    The values are the same to float32 rounding: the winner's and the token's scores are computed
    by the same torch code as `sampling_margins`, so an honest token (the kernel's choice) has a
    margin of exactly 0; where two scores tie to ~1e-7 (the kernel's logf is not torch's) the
    margin is that tie's width, never negative. The logprob is the token's scaled logit minus the
    kernel's log-sum-exp (float32 sums in another order than torch's log-softmax: ~1e-6 apart)."""
    margins, logps = [], []
    for lg, tok, seed, temp in zip(logits, tokens, seeds, temperatures):
        n = tok.shape[0]
        if n == 0:
            continue
        lg = lg.float().contiguous()
        steps = torch.arange(n, dtype=torch.int64)
        seed_col = torch.full((n,), seed, dtype=torch.int64)
        best, lse = native.seeded_argmax(
            lib, lg, stream_keys(seed_col, steps), vocab_term_u32(lg.shape[-1]), float(temp), with_lse=True
        )
        base_tok, s_tok = _seeded_score(lg, seed_col, steps, tok, temp)
        _, s_best = _seeded_score(lg, seed_col, steps, best, temp)
        margins.append((s_best - s_tok).clamp_(min=0.0))
        logps.append(base_tok - lse)
    if not margins:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(margins), torch.cat(logps)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: Tensor) -> Tensor:
    """log p(token) under softmax(logits / T), as the sampler reports it (T = 0: plain logits)."""
    temperature = temperature.float()
    scaled = logits.float() / torch.where(temperature <= 0, 1.0, temperature)
    return scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
