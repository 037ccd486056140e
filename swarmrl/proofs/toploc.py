"""TOPLOC proofs: locality-sensitive hashes of a model's last hidden states.

A worker that claims to have run policy vN on a prompt has, while decoding, the final hidden state
that produced every token. For each chunk of `chunk_size` consecutive tokens it flattens those
states (cast to bf16), takes the `topk` entries largest in absolute value, and commits to them
with a polynomial over GF(65497) through the points (index mod m, bf16 bit pattern), m being the
largest modulus <= 65497 under which the chosen indices stay distinct. The proof is m and the
polynomial's coefficients, 2 bytes each, big-endian: 258 bytes for top-128. A validator repeats
the prefill of prompt + completion under vN, takes its own top-k, evaluates the polynomial at
those indices and compares what comes out with its own bf16 values. An honest worker's values
differ from the validator's by rounding noise only (kernels, batch shapes, thread counts), so
exponents match and mantissas are close; another model, another version or edited tokens give
unrelated hidden states.

The bytes are those of the public `toploc` package (0.1.x; `build_proofs_bytes(...,
skip_prefill=True)` on the same bf16 activations gives the same proofs, checked against golden
vectors in tests/data). What differs, on purpose (that implementation's gaps):

  * the sign is compared as well as the exponent (it compared only exponent and mantissa bits,
    so negated activations passed);
  * evaluation reduces the index by the proof's modulus, as construction does (it evaluated at
    the raw index, so every chunk whose modulus came out below 65497, about 1 in 8, failed);
  * a wrong number of proofs, a null (modulus 0) or malformed proof, a different top-k, and
    non-finite values are errors with a message, never a crash and never a silent null proof;
  * fp32 and fp16 inputs are cast to bf16 (round to nearest) before anything else, on both
    sides, so a CPU worker in fp32 and a GPU worker in bf16 agree on the format;
  * a 2-D [tokens, hidden] tensor and a list of per-token tensors give the same chunks, and the
    median of mantissa errors is the usual one (mean of the two middle values) on every path.

The arithmetic is vectorised over all proofs of a call with numpy int64 (values stay below 2**32
before each reduction), so building the proofs of a whole batch costs a few hundred numpy
operations, independent of how many sequences it holds.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

PRIME = 65497  # the field of the polynomial (the largest prime below 2**16 - 38; fixed by the format)
NULL_MODULUS = 0  # what the reference writes when it could not build a proof


class ProofError(ValueError):
    """A proof, or the activations given to check it, cannot be used; the message says why."""


@dataclass(frozen=True)
class ChunkResult:
    """Verification statistics of one chunk; each grows with the distance from the proof."""

    exp_mismatches: int  # top-k points whose sign or exponent differ
    mant_err_mean: float  # mean |mantissa difference| over points whose sign and exponent match
    mant_err_median: float  # its median; 2**64 for both when no point matches

    def passes(self, *, exp_mismatches_max: int, mant_err_mean_max: float, mant_err_median_max: float) -> bool:
        return (
            self.exp_mismatches <= exp_mismatches_max
            and self.mant_err_mean <= mant_err_mean_max
            and self.mant_err_median <= mant_err_median_max
        )


def _inverse_table() -> np.ndarray:
    """inv[a] = a^(p-2) mod p for every a in [0, p) (inv[0] = 0, never used)."""
    a = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    base, e = a.copy(), PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    return result


_INV = _inverse_table()
_INV2 = np.concatenate([_INV, _INV])  # indexed by a value in [0, 2 * PRIME)


# ---- the polynomial -------------------------------------------------------------------------
def find_injective_modulus(x: np.ndarray) -> int:
    """The largest m <= PRIME with x mod m all distinct (the reference's search order)."""
    return int(_find_moduli(np.asarray(x, dtype=np.int64)[None])[0])


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending powers, mod PRIME) of the polynomials through (x[i], y[i]).

    x, y: int64 [P, n], x distinct within each row and < PRIME. Newton divided differences,
    then expansion into monomial form, all rows at once. This is the worker's cost per proof,
    so: arrays are held transposed ([n, P]: every slice below is one contiguous block), updates
    are in place, and reductions mod PRIME are skipped where int64 allows (values stay < 2**40).
    """
    x = np.ascontiguousarray(np.asarray(x, dtype=np.int64).T)
    dd = np.ascontiguousarray(np.asarray(y, dtype=np.int64).T) % PRIME
    n = x.shape[0]
    for k in range(1, n):
        # dd[i] <- (dd[i] - dd[i-1]) / (x[i] - x[i-k]) for i >= k, from the previous round's dd.
        # Both differences are shifted into (0, 2 * PRIME) rather than reduced.
        num = dd[k:] - dd[k - 1 : -1]
        num += PRIME
        num *= _INV2[x[k:] - x[:-k] + PRIME]
        num %= PRIME
        dd[k:] = num
    coeffs = np.zeros_like(x)
    factor = np.zeros_like(x)  # (x - x_0)...(x - x_{i-1}), ascending powers
    factor[0] = 1
    minus_x = (PRIME - x) % PRIME
    for i in range(n):
        coeffs[: i + 1] += dd[i] * factor[: i + 1]  # < 2**32 per term, n terms at most
        if i + 1 < n:
            # factor <- factor * (x - x_i); only its first i + 2 entries can be non-zero.
            live = factor[: i + 2]
            new = live * minus_x[i]
            new[1:] += live[:-1]
            new %= PRIME
            factor[: i + 2] = new
    coeffs %= PRIME
    return np.ascontiguousarray(coeffs.T)


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Horner: coeffs [P, n] ascending, x [P, k] (already reduced) -> values [P, k] mod PRIME."""
    coeffs = np.asarray(coeffs, dtype=np.int64)
    x = np.asarray(x, dtype=np.int64) % PRIME
    out = np.repeat(coeffs[:, -1:], x.shape[1], axis=1)
    for i in range(coeffs.shape[1] - 2, -1, -1):
        out = (out * x + coeffs[:, i : i + 1]) % PRIME
    return out


# ---- encoding -------------------------------------------------------------------------------
def to_bytes(modulus: int, coeffs: Sequence[int]) -> bytes:
    out = bytearray(2 + 2 * len(coeffs))
    out[0:2] = int(modulus).to_bytes(2, "big")
    for i, c in enumerate(coeffs):
        out[2 + 2 * i : 4 + 2 * i] = int(c).to_bytes(2, "big")
    return bytes(out)


def parse(proof: bytes, topk: int) -> tuple[int, np.ndarray]:
    """(modulus, coefficients) of one proof, or ProofError naming what is wrong with it."""
    if not isinstance(proof, (bytes, bytearray)):
        raise ProofError(f"a proof must be bytes (decode base64 first), not {type(proof).__name__}")
    if len(proof) != 2 + 2 * topk:
        raise ProofError(
            f"a proof is {len(proof)} bytes; top-{topk} proofs are {2 + 2 * topk} bytes "
            f"(a different top-k, or a truncated proof)"
        )
    arr = np.frombuffer(proof, dtype=">u2").astype(np.int64)
    modulus, coeffs = int(arr[0]), arr[1:]
    if modulus == NULL_MODULUS:
        raise ProofError("a null proof (modulus 0): the worker did not build this proof")
    if modulus > PRIME:
        raise ProofError(f"modulus {modulus} is above {PRIME}")
    if int(coeffs.max()) >= PRIME:
        raise ProofError(f"a coefficient is {int(coeffs.max())}, not below {PRIME}")
    return modulus, coeffs


def encode(proofs: list[bytes]) -> list[str]:
    """Base64 (standard alphabet, padded), the reference's text form."""
    return [base64.b64encode(p).decode("ascii") for p in proofs]


def decode(proofs: list[str]) -> list[bytes]:
    out = []
    for i, p in enumerate(proofs):
        try:
            out.append(base64.b64decode(p.encode("ascii"), validate=True))
        except (binascii.Error, UnicodeEncodeError, AttributeError) as e:
            raise ProofError(f"proof {i} is not base64: {e}") from None
    return out


def _check_topk(topk: int) -> None:
    if not isinstance(topk, int) or topk < 1:
        raise ProofError(f"topk must be a positive integer, not {topk!r}")


def check_format(proofs: Sequence[str], n_tokens: int, hidden_size: int, *, chunk_size: int, topk: int) -> str | None:
    """None if `proofs` (base64) could be the proofs of n_tokens tokens of a model with this hidden
    size, else what is wrong: the cheap check an orchestrator runs on every submission."""
    _check_topk(topk)
    want = chunk_count(n_tokens, chunk_size)
    if len(proofs) != want:
        return f"{len(proofs)} proofs for {n_tokens} tokens; {want} chunks of {chunk_size} tokens need {want}"
    try:
        raw = decode(list(proofs))
        for i, proof in enumerate(raw):
            rows = min(chunk_size, n_tokens - i * chunk_size)
            try:
                parse(proof, min(topk, rows * hidden_size))
            except ProofError as e:
                raise ProofError(f"proof {i}: {e}") from None
    except ProofError as e:
        return str(e)
    return None


# ---- activations ----------------------------------------------------------------------------
def chunk_count(n_tokens: int, chunk_size: int) -> int:
    return math.ceil(n_tokens / chunk_size)


def as_bf16(t: Tensor) -> Tensor:
    """The agreed format: bf16, rounded to nearest from fp16/fp32/fp64; anything else is refused."""
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ProofError(f"activations must be floating point (bf16, fp16, fp32 or fp64), not {t.dtype}")
    if t.numel() == 0:
        raise ProofError("activations have no values (a hidden size of 0?)")
    t = t.detach().to("cpu", torch.bfloat16)
    if not bool(torch.isfinite(t).all()):
        raise ProofError("activations contain NaN or inf (after the cast to bf16)")
    return t


def chunks(activations: Tensor | Sequence[Tensor], chunk_size: int, *, cast: bool = True) -> list[Tensor]:
    """Flattened bf16 chunks of `chunk_size` tokens. A 2-D [tokens, hidden] tensor and a list of
    per-token tensors (any shape each) give the same chunks."""
    if chunk_size < 1:
        raise ProofError(f"chunk_size must be >= 1, not {chunk_size}")
    if isinstance(activations, Tensor):
        if activations.dim() != 2:
            raise ProofError(f"activations must be [tokens, hidden], not {tuple(activations.shape)}")
        if not len(activations):
            raise ProofError("no activations: a completion has at least one token")
        flat = as_bf16(activations) if cast else activations  # cast=False: done by the caller
        return [flat[i : i + chunk_size].reshape(-1) for i in range(0, len(flat), chunk_size)]
    rows = list(activations)
    if not rows:
        raise ProofError("no activations: a completion has at least one token")
    return [
        as_bf16(torch.cat([r.reshape(-1) for r in rows[i : i + chunk_size]])) for i in range(0, len(rows), chunk_size)
    ]


# ---- build and verify -----------------------------------------------------------------------
def build_proofs(activations: Tensor | Sequence[Tensor], *, chunk_size: int = 32, topk: int = 128) -> list[bytes]:
    """One proof per chunk of `chunk_size` tokens."""
    return build_proofs_many([activations], chunk_size=chunk_size, topk=topk)[0]


def _find_moduli(x: np.ndarray) -> np.ndarray:
    """find_injective_modulus for every row of x [P, k] at once (almost every row stops at the
    first candidate; the rest step down together)."""
    srt = np.sort(x, axis=1)
    if (srt[:, 1:] == srt[:, :-1]).any():
        raise ProofError("duplicate indices: no modulus can keep them distinct")
    moduli = np.zeros(len(x), dtype=np.int64)
    todo = np.arange(len(x))
    for m in range(PRIME, 0, -1):
        r = np.sort(x[todo] % m, axis=1)
        ok = (r[:, 1:] != r[:, :-1]).all(axis=1)
        moduli[todo[ok]] = m
        todo = todo[~ok]
        if not todo.size:
            return moduli
    raise ProofError("no modulus keeps these indices distinct (are there duplicate indices?)")


def build_proofs_many(
    seqs: Sequence[Tensor | Sequence[Tensor]], *, chunk_size: int = 32, topk: int = 128
) -> list[list[bytes]]:
    """The proofs of many sequences, built together: one top-k, one modulus search and one
    interpolation per chunk width, so the cost is per call rather than per proof."""
    _check_topk(topk)
    if (
        seqs
        and all(isinstance(a, Tensor) and a.dim() == 2 and len(a) for a in seqs)
        and len({a.shape[1] for a in seqs}) == 1
    ):
        # The usual worker call: one cast and one finiteness check for the whole batch.
        whole = torch.cat(list(seqs))
        if not whole.is_floating_point():
            raise ProofError(f"activations must be floating point (bf16, fp16, fp32 or fp64), not {whole.dtype}")
        per_seq = [chunks(a, chunk_size, cast=False) for a in as_bf16(whole).split([len(a) for a in seqs])]
    else:
        per_seq = [chunks(a, chunk_size) for a in seqs]
    flat = [c for cs in per_seq for c in cs]
    by_size: dict[int, list[int]] = {}  # full chunks share a size; only short final chunks differ
    for i, c in enumerate(flat):
        by_size.setdefault(c.numel(), []).append(i)
    # One batched top-k per chunk size, then one modulus search and one interpolation per top-k
    # width (a chunk smaller than top-k commits to all its values, so its width is its size).
    by_k: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for size, rows in by_size.items():
        k = min(topk, size)
        block = torch.stack([flat[i] for i in rows])  # [P, size] bf16
        idx = block.abs().topk(k, dim=1).indices
        bits = (block.gather(1, idx).view(torch.int16).to(torch.int64) & 0xFFFF).numpy()
        for r, i in enumerate(rows):
            by_k.setdefault(k, []).append((i, idx[r].numpy().astype(np.int64), bits[r]))
    out: list[bytes] = [b""] * len(flat)
    for entries in by_k.values():
        idx = np.stack([e[1] for e in entries])
        bits = np.stack([e[2] for e in entries])
        moduli = _find_moduli(idx)
        coeffs = interpolate(idx % moduli[:, None], bits)
        packed = np.concatenate([moduli[:, None], coeffs], axis=1).astype(">u2")
        for (i, _, _), row in zip(entries, packed):
            out[i] = row.tobytes()
    result, pos = [], 0
    for cs in per_seq:
        result.append(out[pos : pos + len(cs)])
        pos += len(cs)
    return result


def verify_proofs(
    activations: Tensor | Sequence[Tensor], proofs: Sequence[bytes], *, chunk_size: int = 32, topk: int = 128
) -> list[ChunkResult]:
    """Compare proofs with activations recomputed by the validator; one result per chunk.

    ProofError if the proofs cannot be compared at all (count, size, null or malformed).
    """
    result = verify_proofs_many([(activations, proofs)], chunk_size=chunk_size, topk=topk)[0]
    if isinstance(result, ProofError):
        raise result
    return result


def verify_proofs_many(
    items: Sequence[tuple[Tensor | Sequence[Tensor], Sequence[bytes]]], *, chunk_size: int = 32, topk: int = 128
) -> list[list[ChunkResult] | ProofError]:
    """verify_proofs for many (activations, proofs) pairs at once: per pair, its chunk results
    or the ProofError that stops it from being compared (other pairs are unaffected)."""
    _check_topk(topk)
    out: list = [None] * len(items)
    todo = []  # (item, chunk number, chunk, modulus, coeffs)
    acts = [a for a, _ in items]
    cast = True
    if (
        acts
        and all(isinstance(a, Tensor) and a.dim() == 2 and len(a) and a.is_floating_point() for a in acts)
        and len({a.shape[1] for a in acts}) == 1
    ):
        try:  # the validator's call: one cast and one finiteness check for everything
            acts, cast = list(as_bf16(torch.cat(acts)).split([len(a) for a in acts])), False
        except ProofError:
            pass  # some item is not finite: find which, one by one
    for n, ((_, proofs), activations) in enumerate(zip(items, acts)):
        try:
            cs = chunks(activations, chunk_size, cast=cast)
            if not isinstance(proofs, (list, tuple)):
                raise ProofError(f"proofs must be a list of bytes, not {type(proofs).__name__}")
            if len(proofs) != len(cs):
                raise ProofError(f"{len(proofs)} proofs for {len(cs)} chunks of {chunk_size} tokens")
            parsed = []
            for i, (chunk, proof) in enumerate(zip(cs, proofs)):
                try:
                    parsed.append((n, i, chunk, *parse(proof, min(topk, chunk.numel()))))
                except ProofError as e:
                    raise ProofError(f"proof {i}: {e}") from None
        except ProofError as e:
            out[n] = e
            continue
        out[n] = [None] * len(cs)
        todo.extend(parsed)
    by_size: dict[int, list] = {}
    for entry in todo:
        by_size.setdefault(entry[2].numel(), []).append(entry)
    for size, entries in by_size.items():
        block = torch.stack([e[2] for e in entries])
        idx = block.abs().topk(min(topk, size), dim=1).indices
        bits = (block.gather(1, idx).view(torch.int16).to(torch.int64) & 0xFFFF).numpy()
        idx = idx.numpy().astype(np.int64)
        moduli = np.array([e[3] for e in entries], dtype=np.int64)[:, None]
        claimed = evaluate(np.stack([e[4] for e in entries]), idx % moduli)
        # bf16: sign (bit 15), exponent (bits 7-14), mantissa (bits 0-6).
        head_match = (claimed >> 7) == (bits >> 7)
        mant_err = np.abs((claimed & 0x7F) - (bits & 0x7F))
        for r, (n, i, *_rest) in enumerate(entries):
            errs = mant_err[r][head_match[r]]
            mismatches = int((~head_match[r]).sum())
            if errs.size:
                out[n][i] = ChunkResult(mismatches, float(errs.mean()), float(np.median(errs)))
            else:
                out[n][i] = ChunkResult(mismatches, 2.0**64, 2.0**64)
    return out
