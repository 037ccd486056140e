"""The C kernels (inference/native.py, csrc/decode_attention.c), built with the machine's compiler
(a subprocess, so not in the unit tier): the decode attention against float64 attention and, inside
the decoder, against transformers' forward; the seeded choice against the torch sampler's tokens."""

from __future__ import annotations

import shutil

import pytest
import torch
from families import FAMILIES, build_family, check_steps_against_transformers, close_to

from swarmrl.inference import native, seeded
from swarmrl.inference.decoder import SlotDecoder
from swarmrl.inference.seeded import seeded_choice
from swarmrl.validator.checks import sampling_margins, seeded_rows, token_logprobs

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: the decoder uses torch's attention"
)


def _kernel(tmp_path):
    lib = native.load(native._build(native.SOURCE, tmp_path))
    assert lib.threaded, "more than one OpenMP runtime is mapped: the kernels would not use torch's threads"
    return lib


def _attend(fn, q, k, v, lengths, out, scale):
    """The decode kernel as attention alone: identity rotary tables (cos 1, sin 0), and each row's
    new key and value the ones already cached at its position, so the writes change nothing."""
    rows, kv, group, dim = q.shape
    rows_i = torch.arange(rows)
    qk = torch.cat([q.reshape(rows, kv * group, dim), k[rows_i, :, lengths]], 1)
    v_new = v[rows_i, :, lengths].contiguous()
    ones, zeros = torch.ones(k.shape[2], dim), torch.zeros(k.shape[2], dim)
    native.decode_rope_attention(fn, qk, v_new, ones, zeros, k, v, lengths, out.view(rows, kv * group, dim), scale)


def _reference(q, k, v, lengths, scale):
    """Masked softmax attention in float64: row i over positions 0..lengths[i]."""
    b, kv, group, dim = q.shape
    out = torch.empty(b, kv, group, dim, dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i]) + 1
        keys, values = k[i, :, :n].double(), v[i, :, :n].double()  # [kv, n, dim]
        scores = torch.einsum("hgd,hnd->hgn", q[i].double(), keys) * scale
        out[i] = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize(
    "rows,kv,group,dim,capacity",
    [(5, 3, 3, 64, 40), (3, 2, 1, 128, 33), (4, 1, 4, 24, 17), (7, 3, 2, 8, 9)],
)
def test_kernel_matches_masked_softmax_attention(tmp_path, rows, kv, group, dim, capacity):
    fn = _kernel(tmp_path)
    g = torch.Generator().manual_seed(rows * dim)
    slots = rows + 2  # the cache has more slots than the step's rows
    q = torch.randn(rows, kv, group, dim, generator=g)
    k = torch.randn(slots, kv, capacity, dim, generator=g)
    v = torch.randn(slots, kv, capacity, dim, generator=g)
    # one position only, a row up to the last position, and lengths around the 8-key blocks
    lengths = torch.tensor([min(n, capacity - 1) for n in [0, capacity - 1, 7, 8, 9, 15, 3][:rows]], dtype=torch.int64)
    want = _reference(q, k, v, lengths, dim**-0.5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):  # on torch's OpenMP threads, as many as torch has
            torch.set_num_threads(threads)
            out = torch.full((rows, kv, group, dim), float("nan"))
            _attend(fn, q, k, v, lengths, out, dim**-0.5)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
    finally:
        torch.set_num_threads(before)
    # keys past a row's length are never read: garbage there changes nothing
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        k2[i, :, n + 1 :] = 1e30
        v2[i, :, n + 1 :] = float("nan")
    again = torch.empty_like(out)
    _attend(fn, q, k2, v2, lengths, again, dim**-0.5)
    assert torch.equal(again, out)


def _rotate64(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("rows,kv,group,dim,capacity,qk_norm", [(5, 3, 3, 64, 40, False), (3, 2, 2, 128, 21, True)])
def test_rope_attention_rotates_writes_the_cache_and_attends(tmp_path, rows, kv, group, dim, capacity, qk_norm):
    # The fused step (rotary, cache writes, attention) against float64 done op by op: queries and
    # keys rotated at each row's position, the key and value written there and nowhere else, then
    # attention over positions 0..length. The queries and keys are a strided view of one q/k/v
    # product, as the decoder hands them over; with a per-head norm (Qwen3) a contiguous copy.
    fn = _kernel(tmp_path)
    g = torch.Generator().manual_seed(rows * dim)
    heads, slots = kv * group, rows + 1
    qkv = torch.randn(rows, (heads + 2 * kv) * dim, generator=g)
    qk = qkv[:, : (heads + kv) * dim].view(rows, heads + kv, dim)
    if qk_norm:
        qk = qk.contiguous() * 0.5
    v_new = qkv[:, (heads + kv) * dim :].view(rows, kv, dim)
    angles = torch.rand(capacity, dim // 2, generator=g) * 6.3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    k = torch.randn(slots, kv, capacity, dim, generator=g)
    v = torch.randn(slots, kv, capacity, dim, generator=g)
    lengths = torch.tensor([min(n, capacity - 1) for n in [0, capacity - 1, 7, 8, 16][:rows]], dtype=torch.int64)
    want_k, want_v = k.double().clone(), v.double().clone()
    q = torch.empty(rows, heads, dim, dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        c, s = cos[n].double(), sin[n].double()
        q[i] = _rotate64(qk[i, :heads].double(), c, s)
        want_k[i, :, n] = _rotate64(qk[i, heads:].double(), c, s)
        want_v[i, :, n] = v_new[i].double()
    want = _reference(q.view(rows, kv, group, dim), want_k, want_v, lengths, dim**-0.5)
    out = torch.full((rows, heads, dim), float("nan"))
    native.decode_rope_attention(fn, qk, v_new, cos, sin, k, v, lengths, out, dim**-0.5)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v.double(), want_v, rtol=0, atol=0)  # copied, every other entry kept
    torch.testing.assert_close(out.double().view(rows, kv, group, dim), want, rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="contiguous"):  # a row's heads must be contiguous
        native.decode_rope_attention(fn, qk.transpose(1, 2), v_new, cos, sin, k, v, lengths, out, 0.1)
    with pytest.raises(RuntimeError, match="refused its arguments"):  # a position past the cache
        native.decode_rope_attention(fn, qk, v_new, cos, sin, k, v, lengths + capacity, out, 0.1)


def test_rope_rotates_a_prefills_tokens_at_their_positions(tmp_path):
    # The prefill's rotary pass: a strided view of a q/k/v product (as the decoder passes it), each
    # token at its own position, against float64 op by op; a position past the tables is refused.
    fn = _kernel(tmp_path)
    g = torch.Generator().manual_seed(9)
    tokens, heads, dim, table = 11, 3, 16, 20
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=g)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.rand(table, dim // 2, generator=g) * 6.3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 19, 5, 6, 7, 8])
    want = _rotate64(x.double(), cos[positions].double()[:, None], sin[positions].double()[:, None])
    torch.testing.assert_close(native.rope(fn, x, positions, cos, sin).double(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        native.rope(fn, x, positions + 1, cos, sin)


def test_rms_norm_and_silu_mul_match_float64(tmp_path):
    fn = _kernel(tmp_path)
    g = torch.Generator().manual_seed(5)
    for rows, n in ((64, 576), (3, 8), (1, 1)):
        x, w = torch.randn(rows, n, generator=g) * 3, torch.randn(n, generator=g)
        xd = x.double()
        want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        torch.testing.assert_close(native.rms_norm(fn, x, w, 1e-5).double(), want, rtol=1e-5, atol=1e-6)
        gate_up = torch.randn(rows, 2 * n, generator=g) * 6
        gate_up[0, 0], gate_up[-1, n - 1] = -200.0, 90.0  # exp(-g) overflows, and underflows
        gd, ud = gate_up.double()[:, :n], gate_up.double()[:, n:]
        want = gd * torch.sigmoid(gd) * ud
        torch.testing.assert_close(native.silu_mul(fn, gate_up).double(), want, rtol=1e-5, atol=1e-6)
        by_torch = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
        torch.testing.assert_close(native.silu_mul(fn, gate_up), by_torch)


def test_kernel_refuses_shapes_and_lengths_it_cannot_take(tmp_path):
    fn = _kernel(tmp_path)
    q = torch.randn(2, 1, 2, 12)  # dim 12: not a multiple of 8
    k = v = torch.randn(2, 1, 8, 12)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        _attend(fn, q, k, v, torch.tensor([1, 2]), torch.empty_like(q), 0.3)
    qk, k = torch.randn(2, 3, 16), torch.randn(2, 1, 8, 16)
    table = torch.ones(8, 16)
    with pytest.raises(RuntimeError, match="refused its arguments"):  # position 8 of a cache of 8
        native.decode_rope_attention(fn, qk, qk[:, 2:], table, table, k, k, torch.tensor([1, 8]), qk[:, :2] * 0, 0.3)
    assert not native.supported(2, 12) and not native.supported(17, 64) and native.supported(3, 64)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_decoder_with_the_kernel_matches_transformers_and_torchs_kernels(name):
    # Each family's shapes (head_dim 64 and 128, groups of 7, 2 and 3 query heads per key head):
    # the decoder's steps with the C kernel against transformers' forward, as the unit tier checks
    # them with torch's kernels, and against those kernels step by step.
    assert native.decode_attention_lib() is not None, "the kernel did not build with this machine's compiler"
    model = build_family(name)
    with_c = SlotDecoder(model, slots=2, capacity=16)
    assert with_c._native is not None
    check_steps_against_transformers(name, model, with_c)
    with_torch = SlotDecoder(model, slots=2, capacity=16)
    with_torch._native = None
    prompts, lengths = [[3, 9, 4, 1, 7], [8, 2]], torch.tensor([5, 2])
    with_c.prefill(prompts, torch.arange(2))
    with_torch.prefill(prompts, torch.arange(2))
    for step in range(4):
        tokens = torch.tensor([10 + step, 20 + step])
        close_to(with_c.decode(tokens, lengths), with_torch.decode(tokens, lengths), f"{name} step {step}")
        lengths = lengths + 1


@pytest.mark.parametrize("rows,vocab,temperature", [(64, 5000, 1.0), (7, 49152, 0.7), (3, 1, 1.0), (5, 513, 1.3)])
def test_seeded_argmax_draws_the_seeded_samplers_tokens(tmp_path, rows, vocab, temperature):
    # The one-pass C choice against seeded_choice (torch): the same tokens. Its logf may differ
    # from torch's in the last bit, so they could part only at a tie within ~1e-7, which random
    # logits do not produce.
    lib = _kernel(tmp_path)
    g = torch.Generator().manual_seed(rows + vocab)
    seeds, steps = torch.randint(0, 2**62, (rows,), generator=g), torch.randint(0, 5000, (rows,), generator=g)
    term = seeded.vocab_term_u32(vocab)
    for scale in (0.5, 3.0, 20.0):  # flat and peaked distributions
        logits = torch.randn(rows, vocab, generator=g) * scale
        want = seeded.seeded_choice(logits, seeds, steps, temperature)
        got, lse = native.seeded_argmax(lib, logits, seeded.stream_keys(seeds, steps), term, temperature, with_lse=True)
        assert torch.equal(got, want), (scale, (got != want).sum())
        # the log-sum-exp of the scaled row from the same pass (the chosen token's logprob is
        # its scaled logit minus it), against float64
        want_lse = torch.logsumexp(logits.double() / temperature, -1)
        torch.testing.assert_close(lse.double(), want_lse, rtol=2e-6, atol=2e-6)
    # the first maximal index on an exact tie of logits and noise: a row of equal entries whose
    # noise is then the only difference, and a row where one logit dominates
    flat = torch.zeros(rows, vocab)
    flat[:, vocab // 2] = 1e4
    got = native.seeded_argmax(lib, flat, seeded.stream_keys(seeds, steps), term, temperature)
    assert got.tolist() == [vocab // 2] * rows
    with pytest.raises(RuntimeError, match="refused its arguments"):
        native.seeded_argmax(lib, flat, seeded.stream_keys(seeds, steps), term, 0.0)


def test_the_engine_draws_the_same_completions_with_and_without_the_kernels():
    from swarmrl.inference.batch import BatchEngine

    assert native.decode_attention_lib() is not None
    model = build_family("llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (9, 4, 13, 4)]
    outs = {}
    for name in ("c", "torch"):
        engine = BatchEngine(model, stop_token_ids=[2048], pad_token_id=0, max_batch=3)
        if name == "torch":
            engine._kernels = None
            engine.generate(prompts[:1], [0], max_new_tokens=1)  # builds the decoder
            engine.decoder._native = None
        else:
            assert engine._kernels is not None
        outs[name] = engine.generate(prompts, [11, 12, 13, 14], max_new_tokens=12, temperature=1.0)
    for a, b in zip(outs["c"], outs["torch"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_the_validators_kernel_pass_gives_the_torch_checks_margins_and_logprobs(tmp_path, temp):
    """`seeded_rows` (the validator's path where the engine's C kernels build) against the torch
    forms on a real vocabulary's size: the seeded choice has margin exactly 0, every other token
    the same margin and every token the same logprob to float32 rounding."""
    lib = _kernel(tmp_path)
    gen = torch.Generator().manual_seed(3)
    vocab, lengths, seeds = 49_152, [7, 1, 12, 5], [11, 2**40 + 5, 0, 987654321]
    logits = [torch.randn(n, vocab, generator=gen) * 3 for n in lengths]
    tokens = []
    for lg, seed in zip(logits, seeds):
        steps = torch.arange(lg.shape[0])
        chosen = seeded_choice(lg, torch.full_like(steps, seed), steps, temp)
        other = torch.randint(0, vocab, chosen.shape, generator=gen)
        tokens.append(torch.where(steps % 2 == 0, chosen, other))  # honest and edited tokens mixed
    margins, logps = seeded_rows(lib, logits, tokens, seeds, [temp] * len(lengths))
    flat_tok = torch.cat(tokens)
    flat_seed = torch.cat([torch.full((n,), s) for n, s in zip(lengths, seeds)])
    flat_step = torch.cat([torch.arange(n) for n in lengths])
    temps = torch.full((sum(lengths), 1), temp)
    want_m = sampling_margins(torch.cat(logits), flat_tok, flat_seed, flat_step, temps)
    want_lp = token_logprobs(torch.cat(logits), flat_tok, temps)
    honest = flat_step % 2 == 0
    assert torch.equal(margins[honest], torch.zeros(int(honest.sum())))
    assert (margins[~honest] > 0).all()
    # Bounded by the arithmetic, not by this CPU: scores reach ~40 here (float32 spacing ~4e-6), a
    # tie the two logf's break differently moves a margin by a few spacings, and the log-sum-exp
    # of 49,152 terms summed in another order (vector width differs between AVX2 and AVX-512)
    # by ~sqrt(V) roundings of the sum; 1e-4 is still 50x under the tightest logprob tolerance.
    assert torch.allclose(margins, want_m, atol=1e-4, rtol=0)
    assert torch.allclose(logps, want_lp, atol=1e-4, rtol=0)


@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump to read the built library")
def test_forced_avx2_kernels_build_ours_for_avx2_too(tmp_path, monkeypatch):
    """With torch's kernels forced to AVX2, ours are built for the x86-64-v3 level: no AVX-512
    (zmm) instruction in the library, and a separate cache entry from the native build."""
    import platform
    import subprocess

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 only")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "-march=x86-64-v3" in native.compile_flags() and "-march=native" not in native.compile_flags()
    forced = native._build(native.SOURCE, tmp_path)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert native.compile_flags() == native.COMPILE_FLAGS
    own = native._build(native.SOURCE, tmp_path)
    assert forced != own
    listing = subprocess.run(["objdump", "-d", str(forced)], capture_output=True, text=True, check=True).stdout
    assert "zmm" not in listing
    assert native.load(forced).threaded  # and it loads and runs on torch's threads like the native one
