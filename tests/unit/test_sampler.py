"""Seeded Gumbel-max noise and the project's KV-cache sampler.

Everything runs on a tiny random Qwen2 (fixed torch seed) on CPU; the whole file is a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.inference.batch import BatchEngine
from swarmrl.inference.sampler import Sampler
from swarmrl.inference.seeded import gumbel_noise, seeded_choice, stream_keys, uniform_noise
from swarmrl.model.checkpoint import build_tiny_policy

M32 = 0xFFFFFFFF


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# An independent pure-Python reference of the hash (Python ints never overflow), so the int64
# tensor arithmetic with split multiplications is checked against exact integer math.


def _ref_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _ref_key(seed: int, step: int) -> int:
    key = _ref_fmix32((seed & M32) ^ 0x9E3779B9)
    key = _ref_fmix32(key ^ ((seed >> 32) & M32))
    return _ref_fmix32(key ^ (((step & M32) * 0x27D4EB2F) & M32))


def _ref_bits(seed: int, step: int, v: int) -> int:
    """The 24-bit integer behind uniform_noise(seed, step)[v]."""
    h = _ref_fmix32(_ref_key(seed, step) ^ ((v * 0x165667B1) & M32))
    return _ref_fmix32(h ^ 0x5BD1E995) >> 8


def _ref_uniform(seed: int, step: int, v: int) -> float:
    # float32 rounding of (k + 0.5) / 2**24, as the module does it, top value kept below 1.
    u = (torch.tensor(float(_ref_bits(seed, step, v)), dtype=torch.float32) + 0.5) * (1.0 / 2**24)
    return min(float(u), 1.0 - 2**-24)


# --------------------------------------------------------------------------------------------
# Seeded noise


def test_noise_is_deterministic_bit_for_bit():
    seeds, steps = _t([0, 1, 7, 123456789]), _t([0, 3, 3, 99])
    a = uniform_noise(seeds, steps, 300)
    b = uniform_noise(seeds.clone(), steps.clone(), 300)
    assert torch.equal(a, b)
    assert torch.equal(gumbel_noise(seeds, steps, 300), gumbel_noise(seeds, steps, 300))
    # Each row depends only on its own (seed, step): computing a row alone gives the same bits.
    for i in range(len(seeds)):
        assert torch.equal(uniform_noise(seeds[i : i + 1], steps[i : i + 1], 300)[0], a[i])
    # Asking for a larger vocabulary extends the row without changing its prefix.
    assert torch.equal(uniform_noise(seeds, steps, 1000)[:, :300], a)


def test_noise_differs_across_seeds_and_steps():
    V = 256
    base = uniform_noise(_t([5]), _t([0]), V)[0]
    for seed, step in [(6, 0), (5, 1), (4, 0), (5 + 2**32, 0), (0, 5)]:
        other = uniform_noise(_t([seed]), _t([step]), V)[0]
        # Unrelated streams: essentially no coordinate coincides.
        assert (other == base).sum() <= 2, (seed, step)
    # Keys over a grid of (seed, step) are all distinct.
    seeds = torch.arange(64).repeat_interleave(64)
    steps = torch.arange(64).repeat(64)
    assert stream_keys(seeds, steps).unique().numel() == 64 * 64


def test_noise_matches_exact_integer_reference():
    cases = [(0, 0), (1, 0), (2, 17), (2**31 - 1, 2**31), (2**32 + 5, 3), (2**62 + 12345, 1000)]
    V = 40
    for seed, step in cases:
        assert int(stream_keys(_t([seed]), _t([step]))[0]) == _ref_key(seed, step)
        got = uniform_noise(_t([seed]), _t([step]), V)[0].tolist()
        assert got == [_ref_uniform(seed, step, v) for v in range(V)], (seed, step)


def test_cpu_numpy_hash_equals_the_tensor_hash_cuda_runs():
    # On a CPU the hash runs in numpy uint32 (fast); on other devices in int64 tensor ops. A
    # validator on one and a worker on the other must draw the same noise, bit for bit.
    from swarmrl.inference import seeded

    g = torch.Generator().manual_seed(3)
    seeds = torch.cat([torch.randint(0, 2**62, (200,), generator=g), _t([0, 2**32 - 1, 2**32, 2**63 - 1])])
    steps = torch.cat([torch.randint(0, 2**40, (200,), generator=g), _t([0, 2**32 - 1, 2**32, 7])])
    keys = seeded.stream_keys(seeds, steps)
    assert torch.equal(keys, seeded._stream_keys_torch(seeds, steps))
    for V in (1, 261, 4099):
        assert torch.equal(seeded._hash24(keys, V), seeded._hash24_torch(keys.clone(), V))
        # the CPU path also finishes the uniform values in numpy, block by block: the same bits
        assert torch.equal(seeded._uniform(keys, V), seeded._to_uniform(seeded._hash24_torch(keys.clone(), V)))


def test_cpu_hash_split_over_threads_and_blocks_is_the_same_hash(monkeypatch):
    # The CPU hash runs by blocks of rows, split over torch's threads: any split (uneven parts,
    # a last block shorter than the others, one row) gives the same integers as one pass.
    from swarmrl.inference import seeded

    g = torch.Generator().manual_seed(5)
    monkeypatch.setattr(seeded, "HASH_PARALLEL_MIN", 0)
    threads = torch.get_num_threads()
    try:
        for rows, workers, block in [(13, 3, 4), (9, 2, 4), (1, 2, 4), (30, 4, 7), (8, 1, 3)]:
            monkeypatch.setattr(seeded, "HASH_BLOCK_ROWS", block)
            torch.set_num_threads(workers)
            keys = seeded.stream_keys(torch.randint(0, 2**62, (rows,), generator=g), _t(list(range(rows))))
            assert torch.equal(seeded._hash24(keys, 1000), seeded._hash24_torch(keys.clone(), 1000)), (rows, workers)
            want = seeded._to_uniform(seeded._hash24_torch(keys.clone(), 1000))
            assert torch.equal(seeded._uniform(keys, 1000), want), (rows, workers)
    finally:
        torch.set_num_threads(threads)


def test_uniform_in_open_interval_with_mean_half():
    seeds = torch.arange(2000)
    steps = torch.arange(2000) % 97
    u = uniform_noise(seeds, steps, 512).double()  # ~1M values
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 2e-3
    # Flat histogram: 32 bins, chi-square with 31 dof (99.99% quantile is ~66).
    counts = torch.histc(u, bins=32, min=0.0, max=1.0)
    expected = u.numel() / 32
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 66, chi2


def test_uniform_top_value_stays_below_one():
    # Regression: (2**24 - 1 + 0.5) / 2**24 rounds to exactly 1.0 in float32, whose Gumbel noise is
    # +inf, so the token at that index would be chosen whatever its logit (even -inf). (seed=341,
    # step=0, v=2602) hits that bit pattern.
    assert _ref_bits(341, 0, 2602) == 2**24 - 1
    u = uniform_noise(_t([341]), _t([0]), 4096)
    assert u.max() < 1.0
    g = gumbel_noise(_t([341]), _t([0]), 4096)
    assert torch.isfinite(g).all()
    logits = torch.zeros(1, 4096)
    logits[0, 0] = 50.0
    logits[0, 2602] = -float("inf")
    assert seeded_choice(logits, _t([341]), _t([0]), 1.0).item() == 0


def test_no_int64_overflow_for_huge_seeds():
    big = [2**63 - 1, 2**63 - 2, 2**63 - 2**32, 2**62, 2**32 - 1]
    keys = stream_keys(_t(big), _t([0, 2**32 - 1, 5, 2**40, 1]))
    assert ((keys >= 0) & (keys <= M32)).all()
    u = uniform_noise(_t(big), _t([0] * len(big)), 64)
    assert torch.isfinite(u).all() and (u > 0).all() and (u < 1).all()
    for i, seed in enumerate(big):
        assert u[i].tolist() == [_ref_uniform(seed, 0, v) for v in range(64)]
    # The high 32 bits of the seed matter: seeds sharing their low 32 bits give different noise.
    lo = 0x12345678
    a = uniform_noise(_t([lo]), _t([0]), 64)
    b = uniform_noise(_t([lo | (0x7FFFFFFF << 32)]), _t([0]), 64)
    assert not torch.equal(a, b)


def test_pinned_known_answer():
    # DO NOT update these numbers casually. They are the noise for (seed=1, step=0), computed when
    # the hash was written. Validators replay old rollouts by recomputing this noise: if the hash
    # (constants, mixing order, bit selection, float conversion) changes, every stored rollout
    # stops verifying. A change here must be a deliberate, versioned protocol change.
    assert stream_keys(_t([1]), _t([0])).tolist() == [3584742034]
    expected = [
        0.848901629447937,
        0.43267104029655457,
        0.418244868516922,
        0.3046261966228485,
        0.10249379277229309,
        0.588315486907959,
        0.42713645100593567,
        0.3776303231716156,
    ]
    got = uniform_noise(_t([1]), _t([0]), 8)[0]
    assert torch.equal(got, torch.tensor(expected, dtype=torch.float32)), got.tolist()


def _chi2_choice(logits: torch.Tensor, temperature: float, n: int, against_temperature: float | None = None) -> float:
    """Chi-square of n seeded draws at `temperature` against softmax(logits / against_temperature)."""
    V = logits.numel()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 3
    steps = torch.arange(n, dtype=torch.int64) % 13
    choice = seeded_choice(logits.expand(n, V), seeds, steps, temperature)
    counts = torch.bincount(choice, minlength=V).double()
    expected = torch.softmax(logits.double() / (against_temperature or temperature), -1) * n
    return (((counts - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gumbel_max_frequencies_match_softmax(temperature):
    # 8 categories -> 7 dof; the 99.99% chi-square quantile is ~29.9. Noise is a fixed hash, so
    # this is deterministic: it either always passes or exposes a real bias.
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.25, 0.75, -0.25])
    chi2 = _chi2_choice(logits, temperature, 20_000)
    assert chi2 < 29.9, chi2
    # Sanity check that the test has power: the frequencies do not match a wrong temperature.
    wrong = _chi2_choice(logits, temperature, 20_000, against_temperature=2 * temperature)
    assert wrong > 100, wrong


def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 300, generator=g)
    seeds, steps = torch.arange(50), torch.zeros(50, dtype=torch.int64)
    assert torch.equal(seeded_choice(logits, seeds, steps, 0.0), logits.argmax(-1))
    # A very low temperature converges to argmax too (for well-separated logits).
    assert torch.equal(seeded_choice(logits, seeds, steps, 1e-4), logits.argmax(-1))


# --------------------------------------------------------------------------------------------
# Sampler

HIDDEN = 64


def _tiny_model():
    model, tok = build_tiny_policy(seed=0, hidden_size=HIDDEN, num_layers=2, intermediate_size=128)
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return _tiny_model()


@pytest.fixture(scope="module")
def eos_policy():
    """The tiny model with an untied lm_head whose eos logit gets +3 (a plain Linear bias).

    A random model almost never emits eos on its own; the bias is part of the model, so the full
    forward used as the reference sees exactly the same logits as the sampler.
    """
    model, tok = _tiny_model()
    head = torch.nn.Linear(HIDDEN, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 3.0
    model.lm_head = head
    return model, tok


@pytest.fixture(params=["hf", "builtin"])
def kind(request):
    """Every sampling test runs on both engines: the generic one over the model's own forward
    and the built-in continuous-batching one (`inference/batch.py`), here with 3 slots so that
    most calls refill slots mid-generation."""
    return request.param


def _sampler(kind, model, tok, stop=None):
    stop = stop or [tok.eos_token_id]
    if kind == "builtin":
        return BatchEngine(model, stop_token_ids=stop, pad_token_id=tok.pad_token_id, max_batch=3)
    return Sampler(model, stop_token_ids=stop, pad_token_id=tok.pad_token_id)


def _prompts(lengths, seed=0, vocab=261):
    g = torch.Generator().manual_seed(seed)
    # Avoid the special ids 0..2 (pad, bos-ish, eos) inside prompts.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _reference(model, prompt, completion, temperature):
    """Full-sequence forward (no cache, no padding): logprobs and hidden states per token."""
    ids = torch.tensor([prompt + completion])
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    logits = model(ids).logits[0].float()[pos]
    scaled = logits / temperature if temperature > 0 else logits
    logp = scaled.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    hidden = model.model(ids).last_hidden_state[0][pos]
    return logp, hidden


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batch_composition_does_not_change_completion(kind, policy, temperature):
    model, tok = policy
    s = _sampler(kind, model, tok)
    target = _prompts([9], seed=1)[0]
    others = _prompts([3, 25, 1, 14], seed=2)
    kw = dict(max_new_tokens=12, temperature=temperature, return_hidden=True)
    alone = s.generate([target], [42], **kw)[0]
    first = s.generate([target] + others, [42, 1, 2, 3, 4], **kw)[0]
    mid = s.generate(others[:2] + [target] + others[2:], [1, 2, 42, 3, 4], **kw)[2]
    last = s.generate(others + [target], [1, 2, 3, 4, 42], **kw)[4]
    for c in (first, mid, last):
        assert c.token_ids == alone.token_ids
        assert c.finish_reason == alone.finish_reason
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), atol=1e-4)
        assert torch.allclose(c.hidden, alone.hidden, atol=1e-4)
    # Two rows with the same prompt and seed in one batch agree; a different seed differs.
    pair = s.generate([target, target, target], [42, 42, 43], **kw)
    assert pair[0].token_ids == pair[1].token_ids == alone.token_ids
    assert pair[2].token_ids != alone.token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_hidden_match_full_forward(kind, eos_policy, temperature):
    model, tok = eos_policy
    s = _sampler(kind, model, tok)
    prompts = _prompts([4, 19, 1, 11, 30], seed=3)
    seeds = [10, 11, 12, 13, 14]
    outs = s.generate(prompts, seeds, max_new_tokens=16, temperature=temperature, return_hidden=True)
    for p, seed, c in zip(prompts, seeds, outs, strict=True):
        assert len(c.logprobs) == len(c.token_ids) == c.hidden.shape[0] > 0
        assert c.hidden.shape[1] == HIDDEN
        ref_logp, ref_hidden = _reference(model, p, c.token_ids, temperature)
        assert torch.allclose(torch.tensor(c.logprobs), ref_logp, atol=1e-4), (c.logprobs, ref_logp)
        assert torch.allclose(c.hidden.float(), ref_hidden, atol=1e-4)
        # Replaying the seeded choice on the reference logits gives back every token
        # (what a validator does).
        with torch.no_grad():
            ids = torch.tensor([p + c.token_ids])
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(c.token_ids))
            logits = model(ids).logits[0][pos]
        n = len(c.token_ids)
        replay = seeded_choice(logits, torch.full((n,), seed), torch.arange(n), temperature)
        assert replay.tolist() == c.token_ids


def test_finish_reasons(kind, eos_policy):
    model, tok = eos_policy
    eos = tok.eos_token_id
    s = _sampler(kind, model, tok)
    prompts = _prompts([5, 12, 1, 20, 8, 3, 16, 7], seed=4)
    seeds = list(range(100, 108))
    max_new = 10
    outs = s.generate(prompts, seeds, max_new_tokens=max_new, temperature=1.0, return_hidden=True)
    reasons = {c.finish_reason for c in outs}
    assert reasons == {"stop", "length"}, "test setup: the eos bias should give both outcomes"
    for p, seed, c in zip(prompts, seeds, outs, strict=True):
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos
            assert eos not in c.token_ids[:-1]
            assert 1 <= len(c.token_ids) <= max_new
        else:
            assert len(c.token_ids) == max_new
            assert eos not in c.token_ids
        assert len(c.logprobs) == len(c.token_ids) == c.hidden.shape[0]
        # A row that stopped early in a batch equals the same row generated alone.
        alone = s.generate([p], [seed], max_new_tokens=max_new, temperature=1.0)[0]
        assert alone.token_ids == c.token_ids and alone.finish_reason == c.finish_reason


def test_eos_as_last_allowed_token_is_stop(kind, eos_policy):
    # A completion whose eos lands exactly on the last allowed token is "stop", not "length".
    model, tok = eos_policy
    s = _sampler(kind, model, tok)
    prompts = _prompts([6] * 16, seed=5)
    outs = s.generate(prompts, list(range(16)), max_new_tokens=30, temperature=1.0)
    stopped = [(p, i, c) for i, (p, c) in enumerate(zip(prompts, outs)) if c.finish_reason == "stop"]
    assert stopped
    p, i, c = max(stopped, key=lambda x: len(x[2].token_ids))
    assert len(c.token_ids) > 1
    again = s.generate([p], [i], max_new_tokens=len(c.token_ids), temperature=1.0)[0]
    assert again.token_ids == c.token_ids and again.finish_reason == "stop"
    cut = s.generate([p], [i], max_new_tokens=len(c.token_ids) - 1, temperature=1.0)[0]
    assert cut.finish_reason == "length" and cut.token_ids == c.token_ids[:-1]


def test_extra_stop_token(kind, policy):
    model, tok = policy
    prompt = _prompts([8], seed=6)[0]
    free = _sampler(kind, model, tok).generate([prompt], [7], max_new_tokens=12)[0]
    assert free.finish_reason == "length"
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    s = _sampler(kind, model, tok, stop=[tok.eos_token_id, stop_at])
    c = s.generate([prompt], [7], max_new_tokens=12)[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: first + 1]


@torch.no_grad()
def test_temperature_zero_equals_greedy_loop_without_cache(kind, policy):
    model, tok = policy
    s = _sampler(kind, model, tok)
    prompts = _prompts([7, 2, 15], seed=7)
    n = 10
    outs = s.generate(prompts, [1, 2, 3], max_new_tokens=n, temperature=0.0)
    for p, c in zip(prompts, outs, strict=True):
        ids = list(p)
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
        assert c.token_ids == ids[len(p) :]
        # At temperature 0 logprobs are taken under the unscaled softmax.
        ref_logp, _ = _reference(model, p, c.token_ids, 0.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref_logp, atol=1e-4)
    # Seeds are irrelevant at temperature 0.
    other = s.generate(prompts, [99, 98, 97], max_new_tokens=n, temperature=0.0)
    assert [c.token_ids for c in other] == [c.token_ids for c in outs]


def test_hidden_is_none_unless_requested(kind, policy):
    model, tok = policy
    c = _sampler(kind, model, tok).generate(_prompts([5]), [0], max_new_tokens=3)[0]
    assert c.hidden is None and len(c.token_ids) == 3 and c.finish_reason == "length"


def test_input_errors(kind, policy):
    model, tok = policy
    s = _sampler(kind, model, tok)
    with pytest.raises(ValueError, match="seed"):
        s.generate([[5, 6], [7]], [1], max_new_tokens=4)
    with pytest.raises(ValueError, match="seed"):
        s.generate([[5, 6]], [1, 2], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        s.generate([[5, 6], []], [1, 2], max_new_tokens=4)
    with pytest.raises(ValueError, match="stop token"):
        Sampler(model, stop_token_ids=[], pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="stop token"):
        BatchEngine(model, stop_token_ids=[], pad_token_id=tok.pad_token_id)
    assert s.generate([], [], max_new_tokens=4) == []


def test_logprobs_are_valid_probabilities(kind, policy):
    model, tok = policy
    outs = _sampler(kind, model, tok).generate(_prompts([3, 9]), [5, 6], max_new_tokens=8, temperature=1.3)
    for c in outs:
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
