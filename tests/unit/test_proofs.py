"""TOPLOC proofs (swarmrl.proofs.toploc): byte compatibility with the public `toploc` 0.1.4 package
through golden vectors (tests/data/toploc_golden.json, written by tests/data/make_toploc_golden.py,
which needs toploc; these tests do not), the polynomial arithmetic by hand, and verification of
honest, perturbed, foreign and malformed inputs."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmrl.proofs.toploc import (
    PRIME,
    ChunkResult,
    ProofError,
    build_proofs,
    build_proofs_many,
    decode,
    encode,
    evaluate,
    find_injective_modulus,
    interpolate,
    parse,
    to_bytes,
    verify_proofs,
    verify_proofs_many,
)

from bf16_inputs import _M64, _mix, make_bf16

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "data" / "toploc_golden.json").read_text())
CASES = GOLDEN["cases"]
NO_MATCH = 2.0**64  # mant_err_mean/median when no top-k point has a matching sign and exponent

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def uniform(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float64 in [-1, 1) from the same hash."""
    n = int(np.prod(shape))
    h = _mix(np.arange(n, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 & _M64))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) / 2.0**52 - 1.0).reshape(shape)


def make_fp32(seed: int, T: int, H: int) -> torch.Tensor:
    """fp32 values off the bf16 grid: make_bf16's bits, then 16 low bits that are never zero."""
    high = make_bf16(seed, T, H).view(torch.int16).to(torch.int32) << 16
    low = (uniform(seed + 1, (T, H)) * 32767).to(torch.int32) + 32768  # in [1, 65535]
    return (high | low).view(torch.float32)


def bits_of(x: torch.Tensor) -> np.ndarray:
    return x.reshape(-1).view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def sorted_magnitudes(x: torch.Tensor, chunk_size: int = 32) -> list[np.ndarray]:
    return [np.sort(bits_of(x[s : s + chunk_size]) & 0x7FFF)[::-1] for s in range(0, x.shape[0], chunk_size)]


def case_id(c: dict) -> str:
    return f"seed{c['seed']}-T{c['T']}-H{c['H']}"


def golden_input(c: dict) -> torch.Tensor:
    return make_bf16(c["seed"], c["T"], c["H"])


# ---- golden vectors from toploc 0.1.4 --------------------------------------------------------
def test_golden_file_covers_what_it_should():
    assert GOLDEN["toploc_version"] == "0.1.4"
    assert (GOLDEN["chunk_size"], GOLDEN["topk"]) == (32, 128)
    shapes = {(c["T"], c["H"]) for c in CASES}
    assert {(T, H) for T in (1, 5, 31, 32, 33, 64, 100) for H in (128, 256)} <= shapes
    low = [c for c in CASES if min(c["moduli"]) < PRIME]
    assert len(low) >= 2 and all(c["T"] * c["H"] > PRIME for c in low)
    # A large case whose indices exceed PRIME but stay distinct mod PRIME (modulus 65497).
    assert any(c["T"] * c["H"] > 2 * PRIME and c["moduli"] == [PRIME] for c in CASES)
    assert sum(c["inner_ties"] for c in CASES) > 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_golden_proofs_match_reference(case):
    x = golden_input(case)
    # The regenerated input is the one the reference saw (else a proof mismatch would mislead).
    assert hashlib.sha256(x.view(torch.int16).numpy().astype("<i2").tobytes()).hexdigest() == case["input_sha256"]
    # No tie at the top-k boundary: which of two equal values torch.topk keeps is unspecified.
    for mags in sorted_magnitudes(x):
        assert len(mags) <= 128 or mags[127] != mags[128]

    proofs = build_proofs(x, chunk_size=32, topk=128)
    assert [p.hex() for p in proofs] == case["proofs_hex"]
    assert [int.from_bytes(p[:2], "big") for p in proofs] == case["moduli"]
    assert encode(proofs) == case["proofs_base64"]
    assert decode(case["proofs_base64"]) == proofs
    assert decode(encode(proofs)) == proofs
    # The reference was called with the list of rows; that form gives the same bytes here too.
    assert build_proofs([row for row in x], chunk_size=32, topk=128) == proofs

    results = verify_proofs(x, proofs, chunk_size=32, topk=128)
    assert results == [ChunkResult(0, 0.0, 0.0)] * len(proofs)
    for modulus, (ref_mismatches, _, _) in zip(case["moduli"], case["reference_verify"]):
        # toploc 0.1.4 evaluates its polynomial at the raw index instead of index mod modulus, so
        # it rejects its own honest proof whenever the modulus is below 65497; we accept it above.
        assert (ref_mismatches > 0) == (modulus < PRIME)


# ---- the polynomial by hand ------------------------------------------------------------------
def test_interpolate_by_hand():
    # Through (1, 0), (2, 1), (3, 0): Lagrange gives -(x - 1)(x - 3) = -x^2 + 4x - 3, i.e.
    # coefficients [-3, 4, -1] = [65494, 4, 65496] mod 65497.
    # Through (0, 0), (1, 0), (2, 1): x(x - 1)/2 = (x^2 - x) / 2; 1/2 = 32749 (2 * 32749 = 65498 = 1),
    # so [0, -32749, 32749] = [0, 32748, 32749].
    x = np.array([[1, 2, 3], [0, 1, 2]])
    y = np.array([[0, 1, 0], [0, 0, 1]])
    coeffs = interpolate(x, y)
    assert coeffs.tolist() == [[65494, 4, 65496], [0, 32748, 32749]]
    assert evaluate(coeffs, x).tolist() == y.tolist()
    # evaluate reduces its points mod PRIME: x + PRIME is the same point.
    assert evaluate(coeffs, x + PRIME).tolist() == y.tolist()
    # A fourth point on the second polynomial: 3 * 2 / 2 = 3.
    assert evaluate(coeffs[1:], np.array([[3]])).tolist() == [[3]]


def test_interpolate_reduces_mod_prime_and_rows_are_independent():
    # One point: the constant polynomial; 65500 = 3 mod 65497.
    assert interpolate(np.array([[7]]), np.array([[65500]])).tolist() == [[3]]
    # y at or above PRIME is the same as y mod PRIME.
    x = np.array([[0, 5, 9, 40000]])
    high = interpolate(x, np.array([[PRIME, 65535, 1, 2]]))
    assert high.tolist() == interpolate(x, np.array([[0, 38, 1, 2]])).tolist()
    # 128 points with bf16-like values: every coefficient is in [0, PRIME), and the polynomial
    # goes through the points; two rows at once give what each gives alone.
    idx = np.stack([np.arange(128) * 511 % PRIME, (np.arange(128) * 97 + 3) % PRIME])
    vals = np.stack([np.arange(128) * 499 % 65408, 65407 - np.arange(128) * 3])
    both = interpolate(idx, vals)
    assert both.min() >= 0 and both.max() < PRIME
    assert evaluate(both, idx).tolist() == vals.tolist()
    assert both[0].tolist() == interpolate(idx[:1], vals[:1])[0].tolist()
    assert both[1].tolist() == interpolate(idx[1:], vals[1:])[0].tolist()
    assert both[0].tolist() != both[1].tolist()


def test_find_injective_modulus():
    assert find_injective_modulus(np.array([0, 1, 2, 8191, 40000, PRIME - 1])) == PRIME
    # 5 and 65502 differ by exactly 65497; mod 65496 they are 5 and 6.
    assert find_injective_modulus(np.array([5, 65502])) == PRIME - 1
    # 0, 65497, 130992: mod 65496 -> 0, 1, 0; mod 65495 -> 0, 2, 2; mod 65494 -> 0, 3, 4.
    assert find_injective_modulus(np.array([0, PRIME, 2 * (PRIME - 1)])) == PRIME - 3
    with pytest.raises(ProofError, match="duplicate"):
        find_injective_modulus(np.array([3, 3]))


def test_to_bytes_and_parse():
    b = to_bytes(PRIME, [0, 1, 258, PRIME - 1])
    assert b == bytes([0xFF, 0xD9, 0, 0, 0, 1, 1, 2, 0xFF, 0xD8])
    modulus, coeffs = parse(b, 4)
    assert modulus == PRIME and coeffs.tolist() == [0, 1, 258, PRIME - 1]


# ---- verification statistics ----------------------------------------------------------------
def test_sign_flip_is_a_mismatch_everywhere():
    # toploc 0.1.4 compares exponent and mantissa bits only, so it accepts negated activations
    # (0 mismatches); here the sign is part of what must match.
    for case in CASES[:8] + CASES[-4:]:
        x = golden_input(case)
        proofs = build_proofs(x)
        results = verify_proofs(-x, proofs)
        assert results == [ChunkResult(128, NO_MATCH, NO_MATCH)] * len(proofs), case_id(case)


def test_median_is_the_usual_one_and_signs_count():
    # A 4-value chunk (fewer values than top-k: all four are committed to). The proof claims
    # mantissas off by 0, 1, 2 and 5 ulps: mean 2.0, median (1 + 2) / 2 = 1.5 (toploc's C++
    # path would say 2, the upper middle value).
    x = torch.tensor([[1.0, -2.0, 3.0, 0.25]], dtype=torch.bfloat16)
    bits = bits_of(x)
    assert bits.tolist() == [0x3F80, 0xC000, 0x4040, 0x3E80]

    def proof_claiming(values):
        return to_bytes(PRIME, interpolate(np.arange(4)[None], np.array(values)[None])[0].tolist())

    assert verify_proofs(x, [proof_claiming(bits + [0, 1, 2, 5])]) == [ChunkResult(0, 2.0, 1.5)]
    # Claim +2.0 for -2.0: a sign mismatch; the other three errors are 0, 2, 5.
    assert verify_proofs(x, [proof_claiming(bits + [0, 1 - 0x8000, 2, 5])]) == [ChunkResult(1, 7 / 3, 2.0)]
    # Claim 4.0 (0x4080) for 3.0 (0x4040): exponent 0x80 -> 0x81, an exponent mismatch.
    assert verify_proofs(x, [proof_claiming(bits + [0, 0, 0x40, 0])]) == [ChunkResult(1, 0.0, 0.0)]
    ok = ChunkResult(2, 1.0, 1.0)
    assert ok.passes(exp_mismatches_max=2, mant_err_mean_max=1.0, mant_err_median_max=1.0)
    assert not ok.passes(exp_mismatches_max=1, mant_err_mean_max=1.0, mant_err_median_max=1.0)
    assert not ok.passes(exp_mismatches_max=2, mant_err_mean_max=0.5, mant_err_median_max=1.0)
    assert not ok.passes(exp_mismatches_max=2, mant_err_mean_max=1.0, mant_err_median_max=0.5)


@pytest.mark.parametrize("seed,T,H", [(1, 100, 128), (2, 64, 256), (3, 32, 4096)])
def test_small_noise_passes_and_unrelated_activations_do_not(seed, T, H):
    # The worker's fp32 activations (off the bf16 grid, so that noise moves some roundings) and
    # the validator's, off by up to 0.1% (1e-2 for the second level), both cast inside.
    x = make_fp32(seed, T, H)
    proofs = build_proofs(x)
    noise = uniform(seed + 7, (T, H)).float()
    for eps, mean_max in ((1e-3, 0.3), (1e-2, 1.5)):
        results = verify_proofs(x * (1 + eps * noise), proofs)
        assert all(r.exp_mismatches <= 6 for r in results), (eps, results)
        assert all(r.mant_err_mean <= mean_max and r.mant_err_median <= 1.0 for r in results), (eps, results)
        assert sum(r.mant_err_mean for r in results) > 0  # the noise did change some values
    for r in verify_proofs(make_fp32(seed + 1000, T, H), proofs):
        assert r.exp_mismatches >= 100


# ---- input forms -----------------------------------------------------------------------------
def test_list_input_equals_2d_input():
    x = make_bf16(11, 70, 128)
    proofs = build_proofs(x)
    assert len(proofs) == 3
    assert build_proofs([row for row in x]) == proofs
    # Per-token tensors of any shape: only their flattened order matters.
    assert build_proofs([row.reshape(2, 64) for row in x]) == proofs
    y = make_fp32(12, 70, 128)  # a different tensor, so the statistics are not all zero
    two_d = verify_proofs(y, proofs)
    assert verify_proofs([row for row in y], proofs) == two_d
    assert verify_proofs([row.reshape(4, 32) for row in y], proofs) == two_d
    assert any(r.exp_mismatches > 0 for r in two_d)


def test_fp32_is_rounded_to_nearest_bf16():
    x = make_fp32(21, 40, 128)
    assert not torch.equal(x, x.to(torch.bfloat16).float())  # really off the bf16 grid
    proofs = build_proofs(x)
    assert proofs == build_proofs(x.to(torch.bfloat16))
    assert verify_proofs(x, proofs) == [ChunkResult(0, 0.0, 0.0)] * 2
    assert verify_proofs(x.to(torch.bfloat16), proofs) == [ChunkResult(0, 0.0, 0.0)] * 2
    # Truncating instead of rounding gives other top values, hence other proofs.
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert build_proofs(truncated) != proofs


def test_fp16_is_accepted_and_cast():
    x16 = (uniform(31, (40, 64)) * 60).to(torch.float16)
    proofs = build_proofs(x16)
    assert proofs == build_proofs(x16.to(torch.bfloat16))
    assert proofs == build_proofs(x16.float())
    assert verify_proofs(x16, proofs) == [ChunkResult(0, 0.0, 0.0)] * 2
    assert verify_proofs(x16.to(torch.bfloat16), proofs) == [ChunkResult(0, 0.0, 0.0)] * 2


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool])
def test_integer_activations_are_refused(dtype):
    x = torch.ones(3, 8, dtype=dtype)
    with pytest.raises(ProofError, match="floating point"):
        build_proofs(x)
    with pytest.raises(ProofError, match="floating point"):
        build_proofs([row for row in x])
    good = build_proofs(torch.ones(3, 8))
    with pytest.raises(ProofError, match="floating point"):
        verify_proofs(x, good)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3.4028234663852886e38])
def test_non_finite_activations_are_refused(bad):
    # The last one is fp32's largest value: finite in fp32, inf once rounded to bf16.
    x = make_fp32(41, 5, 64)
    proofs = build_proofs(x)
    x[3, 17] = bad
    with pytest.raises(ProofError, match="NaN or inf"):
        build_proofs(x)
    with pytest.raises(ProofError, match="NaN or inf"):
        verify_proofs(x, proofs)
    with pytest.raises(ProofError, match="NaN or inf"):
        build_proofs([row.to(torch.bfloat16) for row in x])


def test_bad_shapes_are_refused():
    with pytest.raises(ProofError, match="tokens, hidden"):
        build_proofs(torch.ones(8))
    with pytest.raises(ProofError, match="tokens, hidden"):
        build_proofs(torch.ones(2, 3, 4))
    with pytest.raises(ProofError, match="at least one token"):
        build_proofs([])
    with pytest.raises(ProofError, match="chunk_size"):
        build_proofs(torch.ones(2, 4), chunk_size=0)


# ---- bad proofs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def honest():
    x = make_bf16(51, 70, 128)  # chunks of 32, 32 and 6 tokens
    return x, build_proofs(x)


def test_wrong_number_of_proofs(honest):
    x, proofs = honest
    for wrong in (proofs[:-1], proofs + proofs[:1], []):
        with pytest.raises(ProofError, match=f"{len(wrong)} proofs for 3 chunks of 32 tokens"):
            verify_proofs(x, wrong)


def test_truncated_and_other_topk_proofs(honest):
    x, proofs = honest
    with pytest.raises(ProofError, match=r"proof 1: a proof is 257 bytes; top-128 proofs are 258 bytes"):
        verify_proofs(x, [proofs[0], proofs[1][:-1], proofs[2]])
    with pytest.raises(ProofError, match="proof 0: a proof is 0 bytes"):
        verify_proofs(x, [b"", proofs[1], proofs[2]])
    top64 = build_proofs(x, topk=64)
    assert [len(p) for p in top64] == [130] * 3
    assert verify_proofs(x, top64, topk=64) == [ChunkResult(0, 0.0, 0.0)] * 3
    with pytest.raises(ProofError, match="a proof is 130 bytes; top-128 proofs are 258 bytes"):
        verify_proofs(x, top64, topk=128)
    with pytest.raises(ProofError, match="a proof is 258 bytes; top-64 proofs are 130 bytes"):
        verify_proofs(x, proofs, topk=64)


def test_null_and_out_of_range_proofs(honest):
    x, proofs = honest
    # What toploc 0.1.4 returns when building failed: ProofPoly.null(128), modulus 0, 128 zeros.
    with pytest.raises(ProofError, match="proof 2: a null proof"):
        verify_proofs(x, [proofs[0], proofs[1], bytes(258)])
    for modulus in (PRIME + 1, 0xFFFF):
        bad = modulus.to_bytes(2, "big") + proofs[0][2:]
        with pytest.raises(ProofError, match=f"proof 0: modulus {modulus} is above 65497"):
            verify_proofs(x, [bad, proofs[1], proofs[2]])
    for coeff in (PRIME, 0xFFFF):
        bad = proofs[1][:100] + coeff.to_bytes(2, "big") + proofs[1][102:]
        with pytest.raises(ProofError, match=f"proof 1: a coefficient is {coeff}, not below 65497"):
            verify_proofs(x, [proofs[0], bad, proofs[2]])
    # The largest allowed values are fine.
    edge = PRIME.to_bytes(2, "big") + (PRIME - 1).to_bytes(2, "big") * 128
    assert len(verify_proofs(x, [edge, proofs[1], proofs[2]])) == 3


def test_garbage_of_the_right_length_verifies_badly(honest):
    x, proofs = honest
    garbage = b"".join(hashlib.sha256(b"garbage %d" % i).digest() for i in range(9))[:258]
    modulus, coeffs = parse(garbage, 128)  # well formed, so not a ProofError
    assert 0 < modulus < PRIME and int(coeffs.max()) < PRIME
    results = verify_proofs(x, [proofs[0], garbage, proofs[2]])
    assert results[0] == results[2] == ChunkResult(0, 0.0, 0.0)
    assert results[1].exp_mismatches >= 120


@pytest.mark.parametrize("text", ["not base64!", "AAA", "AAAAA===", "é", "QUJD\n"])
def test_decode_refuses_non_base64(text):
    ok = base64.b64encode(b"\x01\x02\x03").decode()
    with pytest.raises(ProofError, match="proof 1 is not base64"):
        decode([ok, text])


# ---- chunk smaller than top-k, and many sequences at once ------------------------------------
def test_chunk_smaller_than_topk():
    x = make_bf16(61, 1, 16)
    (proof,) = build_proofs(x)
    assert len(proof) == 2 + 2 * 16
    modulus, coeffs = parse(proof, 16)
    assert modulus == PRIME
    # Every one of the 16 values is committed to.
    assert evaluate(coeffs[None], np.arange(16)[None])[0].tolist() == bits_of(x).tolist()
    assert verify_proofs(x, [proof]) == [ChunkResult(0, 0.0, 0.0)]
    y = x.clone()
    y[0, 5] = -y[0, 5]
    assert verify_proofs(y, [proof])[0].exp_mismatches == 1
    # A last chunk of 3 tokens x 16 = 48 values after a full one.
    z = make_bf16(62, 35, 16)
    assert [len(p) for p in build_proofs(z)] == [258, 2 + 2 * 48]
    assert verify_proofs(z, build_proofs(z)) == [ChunkResult(0, 0.0, 0.0)] * 2


def test_build_proofs_many_equals_one_by_one():
    seqs = [
        make_bf16(71, 5, 128),
        make_bf16(72, 40, 128),  # 2 chunks, the last of 8 tokens
        make_bf16(73, 3, 16),  # 48 values: fewer than top-k
        [row for row in make_bf16(74, 33, 64)],  # a last chunk of 64 values, as a list
        make_fp32(75, 32, 4096),  # indices above 65497
    ]
    many = build_proofs_many(seqs, chunk_size=32, topk=128)
    assert many == [build_proofs(s, chunk_size=32, topk=128) for s in seqs]
    assert [len(p) for p in many] == [1, 2, 1, 2, 1]
    assert len({p for ps in many for p in ps}) == 7
    for s, ps in zip(seqs, many):
        assert all(r.exp_mismatches == 0 for r in verify_proofs(s, ps))


def test_verify_proofs_many_equals_one_by_one_and_isolates_errors():
    a, b, c = make_bf16(81, 40, 128), make_fp32(82, 3, 16), make_bf16(83, 32, 4096)
    pa, pb, pc = build_proofs(a), build_proofs(b), build_proofs(c)
    items = [
        (a, pa),
        (a * 1.01, pa),  # not identical, still verifiable
        (b, pb),  # 48 values: fewer than top-k
        (a, pa[:1]),  # wrong count
        ([row for row in c], pc),
        (-c, pc),
        (b, [bytes(2 + 2 * 48)]),  # null proof
    ]
    out = verify_proofs_many(items)
    assert len(out) == len(items)
    for (acts, proofs), got in zip(items, out):
        if isinstance(got, ProofError):
            with pytest.raises(ProofError, match=re.escape(str(got))):
                verify_proofs(acts, proofs)
        else:
            assert got == verify_proofs(acts, proofs)
    assert [isinstance(o, ProofError) for o in out] == [False, False, False, True, False, False, True]
    assert "1 proofs for 2 chunks" in str(out[3]) and "null proof" in str(out[6])
    assert out[0] == [ChunkResult(0, 0.0, 0.0)] * 2
    assert out[2] == out[4] == [ChunkResult(0, 0.0, 0.0)]
    assert out[5] == [ChunkResult(128, NO_MATCH, NO_MATCH)]
    assert any(r != ChunkResult(0, 0.0, 0.0) for r in out[1])


# ---- known gaps (see the report that came with these tests); strict: a fix makes them fail ---
def test_zero_width_activations_are_a_proof_error():
    with pytest.raises(ProofError):
        build_proofs(torch.zeros(2, 0))
    with pytest.raises(ProofError):
        verify_proofs(torch.zeros(2, 0), [PRIME.to_bytes(2, "big")])


def test_non_positive_topk_is_a_proof_error():
    x = make_bf16(91, 2, 64)
    for topk in (0, -1):
        with pytest.raises(ProofError):
            build_proofs(x, topk=topk)
        with pytest.raises(ProofError):
            verify_proofs(x, [PRIME.to_bytes(2, "big")], topk=topk)
