"""Deterministic bf16 activations for the TOPLOC golden vectors: a pure function of (seed, T, H),
independent of torch's and numpy's random generators, shared by tests/test_proofs.py and the
generator tests/data/make_toploc_golden.py."""

from __future__ import annotations

import numpy as np
import torch

_M64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def make_bf16(seed: int, T: int, H: int) -> torch.Tensor:
    """[T, H] bf16 activations, a pure function of (seed, T, H)."""
    n = T * H
    i = np.arange(n, dtype=np.uint64)
    base = np.uint64((seed * 0x9E3779B97F4A7C15 + T * 0x1000193 + H) & _M64)
    h1 = _mix(i * np.uint64(4) + base)
    h2 = _mix(i * np.uint64(4) + base + np.uint64(1))
    h3 = _mix(i * np.uint64(4) + base + np.uint64(2))
    # k = leading zeros of h1 (geometric: P(k >= j) = 2**-j), capped at 30.
    k = np.zeros(n, dtype=np.int64)
    for bit in range(30):
        k += (h1 >> np.uint64(63 - bit)) == 0  # true for every bit up to the first set one
    k = np.minimum(k, 30)
    mag = k * 1040 + (h2 % np.uint64(1040)).astype(np.int64)
    dup = (h3 & np.uint64(15)) == 0
    src = (np.arange(n) + 1 + ((h3 >> np.uint64(8)) % np.uint64(7)).astype(np.int64)) % n
    mag = np.where(dup, mag[src], mag)
    sign = (h3 >> np.uint64(63)).astype(np.int64)
    bits = (sign << 15) | mag
    assert int(mag.max()) < 0x7F80
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16).reshape(T, H)
