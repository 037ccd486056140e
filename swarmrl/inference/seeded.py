"""Seeded Gumbel-max sampling that anyone holding the logits and the seed can replay.

Token t of a completion is `argmax(logits_t / T + g(seed, t))`, where `g` is Gumbel noise from a
counter-based generator: a pure hash of (seed, t, vocabulary index). Unlike a stateful RNG the
noise does not depend on batch composition, device or call order, so a validator that recomputes
the logits by prefill can check that every submitted token is the one the seed dictates (this is
what catches cherry-picked or edited completions; TOPLOC alone does not).

The hash is murmur3's 32-bit finaliser applied in int64 tensors. Products are split into 16-bit
halves so no intermediate exceeds 2**63: signed overflow is never relied on, and CPU and CUDA give
the same integers bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from swarmrl.inference.pool import worker_pool

_MASK32 = 0xFFFFFFFF


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2**32 for uint32 values held in int64, without int64 overflow."""
    lo = h * (c & 0xFFFF)  # < 2**48
    hi = ((h * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits survive the shift mod 2**32
    return (lo + hi) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def stream_keys(seeds: Tensor, steps: Tensor) -> Tensor:
    """One 32-bit key per (seed, step). seeds, steps: [B] int64 (seeds >= 0) -> [B] int64."""
    seeds = seeds.to(torch.int64)
    steps = steps.to(torch.int64)
    if seeds.device.type == "cpu" and steps.device.type == "cpu":  # the same integers, see _hash24
        s, t = seeds.numpy(), steps.numpy()
        k = _fmix32_np((s & _MASK32).astype(np.uint32) ^ np.uint32(0x9E3779B9))
        k = _fmix32_np(k ^ ((s >> 32) & _MASK32).astype(np.uint32))
        k = _fmix32_np(k ^ ((t & _MASK32).astype(np.uint32) * np.uint32(0x27D4EB2F)))
        return torch.from_numpy(k.astype(np.int64))
    return _stream_keys_torch(seeds, steps)


def _stream_keys_torch(seeds: Tensor, steps: Tensor) -> Tensor:
    """`stream_keys` in int64 tensor arithmetic (any device; what CUDA runs)."""
    key = _fmix32((seeds & _MASK32) ^ 0x9E3779B9)
    key = _fmix32(key ^ ((seeds >> 32) & _MASK32))
    return _fmix32(key ^ _mul32(steps & _MASK32, 0x27D4EB2F))


def _mul32_(h: Tensor, c: int) -> Tensor:
    """`_mul32` in place on ``h`` (the same integers; one temporary instead of five)."""
    hi = h * (c >> 16)
    hi.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return h.mul_(c & 0xFFFF).add_(hi).bitwise_and_(_MASK32)


def _fmix32_(h: Tensor) -> Tensor:
    """`_fmix32` in place on ``h``. The [rows, vocab] hash runs once per sampled token, and at
    the sizes of a CPU run its cost is allocations and kernel launches, not arithmetic."""
    h.bitwise_xor_(h >> 16)
    _mul32_(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    _mul32_(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


_VOCAB_TERMS: dict[tuple[int, str], Tensor] = {}


def _vocab_term(vocab_size: int, device: torch.device) -> Tensor:
    """_mul32(arange(V), 0x165667B1): the same for every row and step, so computed once."""
    key = (vocab_size, str(device))
    term = _VOCAB_TERMS.get(key)
    if term is None:
        term = _mul32(torch.arange(vocab_size, device=device, dtype=torch.int64), 0x165667B1)
        if len(_VOCAB_TERMS) < 16:
            _VOCAB_TERMS[key] = term
    return term


_VOCAB_U32: dict[int, Tensor] = {}


def vocab_term_u32(vocab_size: int) -> Tensor:
    """`_vocab_term` on the CPU as uint32 values (what the C sampling kernel reads), cached."""
    term = _VOCAB_U32.get(vocab_size)
    if term is None:
        term = torch.from_numpy(_vocab_term(vocab_size, torch.device("cpu")).numpy().astype(np.uint32))
        if len(_VOCAB_U32) < 16:
            _VOCAB_U32[vocab_size] = term
    return term


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    """`_fmix32` in place on a uint32 array: numpy's uint32 products wrap mod 2**32, which is
    exactly the arithmetic the int64 emulation spells out, so the integers are the same."""
    _fmix32_np_tmp(h, np.empty_like(h))
    return h


#: Rows the CPU hash processes at a time: [4, 49,152] uint32 is 786 KB, so a block's ten passes
#: stay in a core's L2 instead of streaming a [64, 49,152] matrix (12.6 MB) through memory ten
#: times (a 64-row step: 15-16 ms in one pass, 9.5 ms by blocks, ~7 ms by blocks on 2 threads).
HASH_BLOCK_ROWS = 4
#: Below this many elements the hash runs on the calling thread (a pool hand-off costs more).
HASH_PARALLEL_MIN = 1 << 18


def _fmix32_np_tmp(h: np.ndarray, tmp: np.ndarray) -> None:
    """`_fmix32_np` with the shifts written into ``tmp`` (no temporaries allocated per pass)."""
    np.right_shift(h, 16, out=tmp)
    h ^= tmp
    h *= np.uint32(0x85EBCA6B)
    np.right_shift(h, 13, out=tmp)
    h ^= tmp
    h *= np.uint32(0xC2B2AE35)
    np.right_shift(h, 16, out=tmp)
    h ^= tmp


def _hash24_rows(keys: np.ndarray, term: np.ndarray, out: np.ndarray, uniform: bool) -> None:
    """`_hash24` of ``keys`` [R] uint32 into ``out`` [R, V] float32, HASH_BLOCK_ROWS rows at a
    time; with ``uniform``, `_uniform`'s values instead (the same float32 operations as its
    tensor form, each correctly rounded, so the same bits, while the block is in cache)."""
    n = min(HASH_BLOCK_ROWS, keys.shape[0])
    h_buf = np.empty((n, term.shape[0]), np.uint32)
    t_buf = np.empty_like(h_buf)
    for r in range(0, keys.shape[0], n):
        m = min(n, keys.shape[0] - r)
        h, tmp = h_buf[:m], t_buf[:m]
        np.bitwise_xor(keys[r : r + m, None], term[None, :], out=h)
        _fmix32_np_tmp(h, tmp)
        h ^= np.uint32(0x5BD1E995)
        _fmix32_np_tmp(h, tmp)
        h >>= 8
        block = out[r : r + m]
        block[:] = h  # < 2**24: exact in float32
        if uniform:
            block += np.float32(0.5)
            block *= np.float32(1.0 / 2**24)
            np.minimum(block, np.float32(_U_MAX), out=block)


def _hash24(keys: Tensor, vocab_size: int, uniform: bool = False) -> Tensor:
    """The 24-bit integer behind each noise value [B, V], as float32 (exact below 2**24); with
    ``uniform``, `_uniform` of it."""
    if keys.device.type == "cpu":
        # On a CPU this hash is a tenth of a sampling step at a 135M model's sizes: ~25 int64
        # kernels in torch, each with dispatch and thread-pool overhead. numpy's native uint32
        # does it in ~10 passes and gives the same integers; by blocks of rows (cache-sized)
        # split over torch's threads (numpy releases the GIL in its loops). The rows are
        # independent, so the split cannot change a value.
        k = (keys.numpy() & _MASK32).astype(np.uint32)
        t = vocab_term_u32(vocab_size).numpy()
        out = np.empty((k.shape[0], vocab_size), np.float32)
        parts = min(torch.get_num_threads(), k.shape[0] // HASH_BLOCK_ROWS)
        if parts <= 1 or out.size < HASH_PARALLEL_MIN:
            _hash24_rows(k, t, out, uniform)
        else:
            bounds = [round(i * k.shape[0] / parts) for i in range(parts + 1)]
            pool = worker_pool(parts)
            jobs = [pool.submit(_hash24_rows, k[a:b], t, out[a:b], uniform) for a, b in zip(bounds, bounds[1:])]
            for job in jobs:
                job.result()
        return torch.from_numpy(out)
    h = _hash24_torch(keys, vocab_size)
    return _to_uniform(h) if uniform else h


def _hash24_torch(keys: Tensor, vocab_size: int) -> Tensor:
    """`_hash24` in int64 tensor arithmetic (any device; what CUDA runs)."""
    h = keys[:, None] ^ _vocab_term(vocab_size, keys.device)[None, :]  # [B, V], a fresh tensor
    _fmix32_(h)
    _fmix32_(h.bitwise_xor_(0x5BD1E995))
    return h.bitwise_right_shift_(8).to(torch.float32)


# float32 cannot hold 2**24 - 0.5, so the top value rounds to exactly 1.0, whose Gumbel noise is
# +inf (that token would win even at logit -inf). It is clamped to the largest float below 1;
# every other value is unchanged bit for bit.
_U_MAX = 1.0 - 2**-24


def _to_uniform(h: Tensor) -> Tensor:
    return h.add_(0.5).mul_(1.0 / 2**24).clamp_(max=_U_MAX)


def _uniform(keys: Tensor, vocab_size: int) -> Tensor:
    return _hash24(keys, vocab_size, uniform=True)


def uniform_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """U(0,1) noise [B, V] float32, open interval, 24 bits of resolution."""
    return _uniform(stream_keys(seeds, steps), vocab_size)


def gumbel_at(seeds: Tensor, steps: Tensor, index: Tensor) -> Tensor:
    """The Gumbel noise of single entries: element i is gumbel_noise(...)[i, index[i]] for the
    row keyed by (seeds[i], steps[i]); all [M]. Bit for bit the same values, without building
    the [rows, vocab] matrix (a validator needs only the few entries that could win)."""
    keys = stream_keys(seeds, steps)
    h = _fmix32(keys ^ _mul32(index.to(torch.int64), 0x165667B1))
    h = _fmix32(h ^ 0x5BD1E995)
    u = (((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)).clamp(max=1.0 - 2**-24)
    return -torch.log(-torch.log(u))


# The largest value the noise can take (u is at most 1 - 2**-24), plus a little for rounding.
GUMBEL_MAX = 16.64


def gumbel_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise [B, V] float32 keyed by (seed, step, vocab index)."""
    return uniform_noise(seeds, steps, vocab_size).log_().neg_().log_().neg_()  # -log(-log(u))


def seeded_choice(logits: Tensor, seeds: Tensor, steps: Tensor, temperature: float) -> Tensor:
    """The Gumbel-max token [B] for logits [B, V]; temperature 0 is plain argmax.

    argmax(logits/T + Gumbel) is an exact sample from softmax(logits/T) (the Gumbel-max trick).
    """
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    noise = gumbel_noise(seeds, steps, logits.shape[-1])
    scores = noise.add_(logits if temperature == 1.0 else logits / temperature)  # x / 1.0 == x exactly
    # max(-1).indices is argmax (the first maximal index on ties, NaN counted as maximal, on
    # every device) at half the cost of torch.argmax on a CPU at these sizes.
    return scores.max(-1).indices
