"""The built-in continuous-batching engine (`inference/batch.py` over `inference/decoder.py`).

The sampling conventions themselves (seeded choice, logprobs, hidden states, finish reasons)
are checked on both engines in test_sampler.py; this file checks what only this engine does:
slots refilled mid-generation, one prefill per distinct prompt, weights changed in place, a
cache that grows, rows at different temperatures, and which models it takes.
"""

from __future__ import annotations

import pytest
import torch

from swarmrl.inference.batch import BatchEngine, Job
from swarmrl.inference.decoder import LINEAR_ENV, SlotDecoder, onednn_linear, supports
from swarmrl.inference.engine import build_engine
from swarmrl.inference.sampler import Sampler
from swarmrl.model.checkpoint import build_tiny_policy


@pytest.fixture(scope="module")
def policy():
    model, tok = build_tiny_policy(seed=0, hidden_size=64, num_layers=2, intermediate_size=128)
    return model.eval(), tok


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _never(model):
    return [model.config.vocab_size]  # a stop id no row can emit: every row runs to its limit


def _engine(model, tok, max_batch=4, **kw):
    return BatchEngine(
        model, stop_token_ids=kw.pop("stop", _never(model)), pad_token_id=tok.pad_token_id, max_batch=max_batch, **kw
    )


def _alone(model, tok, prompt, seed, n, temperature=1.0):
    return (
        Sampler(model, stop_token_ids=_never(model), pad_token_id=tok.pad_token_id)
        .generate([prompt], [seed], max_new_tokens=n, temperature=temperature)[0]
        .token_ids
    )


def test_a_job_submitted_mid_batch_starts_at_once_and_gets_what_it_gets_alone(policy):
    model, tok = policy
    engine = _engine(model, tok, max_batch=4)
    long_prompt, short_prompt = _prompts([7, 12], seed=1)
    long_job = engine.submit(Job(long_prompt, 5, 40))
    for _ in range(6):
        engine.step()
    assert len(long_job.tokens) == 6
    short_job = engine.submit(Job(short_prompt, 9, 5))
    steps = 0
    while short_job.finish_reason is None:
        engine.step()
        steps += 1
    # It took exactly its own 5 tokens' steps, while the long job kept generating beside it.
    assert steps == 5 and long_job.finish_reason is None and len(long_job.tokens) == 11
    while engine.pending():
        engine.step()
    assert long_job.finish_reason == "length" and len(long_job.tokens) == 40
    assert short_job.tokens == _alone(model, tok, short_prompt, 9, 5)
    assert long_job.tokens == _alone(model, tok, long_prompt, 5, 40)


def test_more_prompts_than_slots_refill_as_rows_finish(policy):
    model, tok = policy
    prompts = _prompts([3, 9, 14, 5, 11, 2, 8], seed=2)
    seeds = [11, 12, 13, 14, 15, 16, 17]
    eos = _engine(model, tok, max_batch=2, stop=[tok.eos_token_id, 7, 8, 9])  # rows stop at different steps
    ref = Sampler(model, stop_token_ids=[tok.eos_token_id, 7, 8, 9], pad_token_id=tok.pad_token_id)
    ours = eos.generate(prompts, seeds, max_new_tokens=30, return_hidden=True)
    theirs = ref.generate(prompts, seeds, max_new_tokens=30, return_hidden=True)
    assert len({len(c.token_ids) for c in theirs}) > 1, "test setup: rows should end at different steps"
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(a.hidden, b.hidden, atol=1e-4)
    assert eos.stats["prefills"] > 1  # slots were refilled, not one batch
    assert not eos.active and eos.pending() == 0


def test_one_prefill_per_distinct_prompt(policy):
    model, tok = policy
    engine = _engine(model, tok, max_batch=16)
    prompts = _prompts([6, 13, 4], seed=3)
    rows = [p for p in prompts for _ in range(4)]  # a GRPO group: each prompt 4 times
    seeds = list(range(100, 112))
    ours = engine.generate(rows, seeds, max_new_tokens=10)
    assert engine.stats["prefilled_prompts"] == 3 and engine.stats["shared_prompts"] == 9
    for row, seed, c in zip(rows, seeds, ours):
        assert c.token_ids == _alone(model, tok, row, seed, 10)
    assert len({tuple(c.token_ids) for c in ours}) == 12  # different seeds, different samples


def test_weights_changed_in_place_are_picked_up(policy):
    _, tok = policy
    model, _ = build_tiny_policy(seed=0, hidden_size=64, num_layers=2, intermediate_size=128)
    model.eval()
    other, _ = build_tiny_policy(seed=1, hidden_size=64, num_layers=2, intermediate_size=128)
    engine = _engine(model, tok)
    prompt = _prompts([9], seed=4)[0]
    before = engine.generate([prompt], [3], max_new_tokens=12)[0].token_ids
    with torch.no_grad():  # what a trainer's optimizer step or load_state_dict does
        model.load_state_dict(other.state_dict())
    after = engine.generate([prompt], [3], max_new_tokens=12)[0].token_ids
    assert after == _alone(model, tok, prompt, 3, 12) and after != before


def test_the_cache_grows_for_longer_jobs_while_others_run(policy):
    model, tok = policy
    engine = _engine(model, tok, max_batch=3)
    short = engine.submit(Job(_prompts([4], seed=5)[0], 1, 6))
    engine.step()
    first = engine.decoder.capacity
    long_prompt = _prompts([30], seed=6)[0]
    long = engine.submit(Job(long_prompt, 2, 50))
    while engine.pending():
        engine.step()
    assert engine.decoder.capacity >= 80 > first
    assert short.tokens == _alone(model, tok, short.prompt, 1, 6)
    assert long.tokens == _alone(model, tok, long_prompt, 2, 50)
    with pytest.raises(ValueError, match="cache of 20 tokens"):
        _engine(model, tok, capacity=20).submit(Job(long_prompt, 2, 50))


def test_rows_at_different_temperatures_share_steps(policy):
    model, tok = policy
    engine = _engine(model, tok)
    p1, p2, p3 = _prompts([5, 8, 3], seed=7)
    jobs = [
        engine.submit(Job(p1, 1, 10, temperature=0.0)),
        engine.submit(Job(p2, 2, 10, temperature=1.0)),
        engine.submit(Job(p3, 3, 10, temperature=0.5, top_logprobs=2)),
    ]
    while engine.pending():
        engine.step()
    for job, (p, s, t) in zip(jobs, [(p1, 1, 0.0), (p2, 2, 1.0), (p3, 3, 0.5)]):
        assert job.tokens == _alone(model, tok, p, s, 10, temperature=t)
    assert len(jobs[2].tops) == 10 and all(len(top) == 2 for top in jobs[2].tops)
    assert jobs[0].tops == [] and jobs[1].tops == []


def test_on_token_ends_a_job_early(policy):
    model, tok = policy
    engine = _engine(model, tok)
    seen = []
    job = engine.submit(Job(_prompts([6], seed=8)[0], 4, 30, on_token=lambda t, tok_id: seen.append(t) or t == 3))
    other = engine.submit(Job(_prompts([6], seed=9)[0], 5, 8))
    while engine.pending():
        engine.step()
    assert seen == [0, 1, 2, 3] and len(job.tokens) == 4 and job.finish_reason == "stop"
    assert len(other.tokens) == 8


def test_build_engine_picks_the_engine_the_model_supports(policy):
    model, tok = policy
    assert isinstance(build_engine(model, tok), BatchEngine)
    assert isinstance(build_engine(model, tok, kind="hf"), Sampler)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        build_engine(model, tok, kind="nope")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert "gpt2" in supports(gpt2)
    assert isinstance(build_engine(gpt2, tok), Sampler)  # the generic path, not an error


def test_generate_refuses_batch_wide_hooks_and_a_busy_engine(policy):
    model, tok = policy
    engine = _engine(model, tok)
    with pytest.raises(TypeError, match="on_token"):
        engine.generate([[5, 6]], [1], max_new_tokens=3, on_step=lambda t, toks: None)
    engine.submit(Job([5, 6, 7], 1, 3))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([[5, 6]], [1], max_new_tokens=3)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(Job([], 1, 3))


def _smollm_layer(layers: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_onednn_carries_only_products_large_enough_to_gain(monkeypatch):
    # A 1M-parameter model's products cost more through oneDNN's call than they save (a 64-wide
    # layer: ~40 us against MKL's ~20), so they stay on MKL; SmolLM2-135M's 576-wide layers go
    # through oneDNN when this CPU and torch build have it and it is asked for.
    monkeypatch.setenv(LINEAR_ENV, "onednn")
    tiny, _ = build_tiny_policy(seed=0, hidden_size=64, num_layers=2, intermediate_size=128)
    small = SlotDecoder(tiny, slots=2, capacity=8)
    assert not any(layer.dnn for layer in small._layers) and small._dnn_head is None
    op = onednn_linear()
    if op is None:
        pytest.skip("this torch build or CPU has no oneDNN linear: every product runs on MKL")
    big = SlotDecoder(_smollm_layer(), slots=2, capacity=8)
    assert big.linear == "onednn" and all(layer.dnn for layer in big._layers)
    assert big._layers[0].gate_up_t is None  # oneDNN reads [out, in]: no transposed copies kept
    assert big._dnn_head is None  # 256 x 576 is below the threshold: MKL
    x = torch.randn(5, 576)
    w = big._layers[0].gate_up
    torch.testing.assert_close(op(x, w, None, "none", [], ""), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)


def test_the_products_library_is_measured_or_chosen_and_both_decode_alike(monkeypatch):
    # "auto" times oneDNN and MKL on the model's own weights once and keeps the faster; the
    # setting can force either. Both give the same step to float32 rounding.
    if onednn_linear() is None:
        pytest.skip("this torch build or CPU has no oneDNN linear: nothing to choose")
    model = _smollm_layer(layers=2)
    tokens, lengths = torch.tensor([3, 7]), torch.tensor([4, 2])
    prompts = [[1, 2, 3, 4], [5, 6]]
    out = {}
    for setting in ("mkl", "onednn", "auto"):
        monkeypatch.setenv(LINEAR_ENV, setting)
        dec = SlotDecoder(model, slots=2, capacity=8)
        assert dec.linear in ("mkl", "onednn") and (setting == "auto" or dec.linear == setting)
        assert all(layer.dnn == (dec.linear == "onednn") for layer in dec._layers)
        assert all((layer.gate_up_t is None) == layer.dnn for layer in dec._layers)
        dec.prefill(prompts, torch.arange(2))
        out[setting] = dec.decode(tokens, lengths)
    torch.testing.assert_close(out["mkl"], out["onednn"], rtol=1e-4, atol=1e-4)
    # the measured choice is remembered for the process (a new engine does not time it again)
    monkeypatch.setattr("swarmrl.inference.decoder._time_products", lambda *a, **k: pytest.fail("timed again"))
    SlotDecoder(model, slots=2, capacity=8)
    monkeypatch.setenv(LINEAR_ENV, "fastest")
    with pytest.raises(ValueError, match="SWARMRL_CPU_LINEAR='fastest' is not one of auto, onednn, mkl"):
        SlotDecoder(model, slots=2, capacity=8)


def test_rows_of_different_lengths_attend_in_ranges_and_get_what_they_get_alone(policy, monkeypatch):
    # 32 rows of 2-60 prompt tokens: admitted shortest first, so attention runs over up to four
    # row ranges, each only as far as its longest row; the tokens, logprobs and hidden states
    # must be each row's own, as if it ran alone (the generic engine, one row at a time).
    model, tok = policy
    lengths = [2 + (i * 37) % 59 for i in range(32)]
    prompts = _prompts(lengths, seed=5)
    seeds = list(range(100, 132))
    seen = []
    real = SlotDecoder._row_chunks
    monkeypatch.setattr(SlotDecoder, "_row_chunks", lambda self, *a: seen.append(real(self, *a)) or seen[-1])
    outs = _engine(model, tok, max_batch=32).generate(
        prompts, seeds, max_new_tokens=6, temperature=1.0, return_hidden=True
    )
    assert seen and all(len(c) == 4 for c in seen), seen[:2]
    assert [c[-1] for c in seen[0]] == sorted(c[-1] for c in seen[0])  # shortest rows first
    generic = Sampler(model, stop_token_ids=_never(model), pad_token_id=tok.pad_token_id)
    for i in range(0, 32, 3):
        alone = generic.generate([prompts[i]], [seeds[i]], max_new_tokens=6, temperature=1.0, return_hidden=True)[0]
        assert outs[i].token_ids == alone.token_ids, i
        torch.testing.assert_close(torch.tensor(outs[i].logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-4)
        torch.testing.assert_close(outs[i].hidden, alone.hidden, rtol=1e-4, atol=1e-4)


def test_the_prefill_mlp_by_blocks_of_tokens_gives_what_one_block_gives(policy, monkeypatch):
    # The prefill runs its MLP over blocks of packed tokens (to keep its intermediates small):
    # blocks of 7 tokens across 4 prompts of 3-40 tokens (blocks straddle prompts) must give
    # the hidden states and cached keys/values of one block.
    model, _ = policy
    prompts = _prompts([3, 40, 17, 25], seed=9)
    slots = torch.arange(4)
    whole = SlotDecoder(model, slots=4, capacity=48)
    want = whole.prefill(prompts, slots)
    monkeypatch.setattr(SlotDecoder, "PREFILL_BLOCK", 7)
    blocked = SlotDecoder(model, slots=4, capacity=48)
    got = blocked.prefill(prompts, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for k_want, k_got in zip(whole.k + whole.v, blocked.k + blocked.v, strict=True):
        torch.testing.assert_close(k_got, k_want, rtol=1e-5, atol=1e-5)
    # and it is not a test of nothing: a block that skipped its tokens' MLP would differ
    monkeypatch.setattr(SlotDecoder, "_mlp", lambda self, L, x: torch.zeros_like(x))
    assert not torch.allclose(SlotDecoder(model, slots=4, capacity=48).prefill(prompts, slots), want, atol=1e-3)


def test_malloc_tuning_is_applied_on_glibc_and_can_be_turned_off(monkeypatch):
    import platform

    from swarmrl.inference.malloc import keep_freed_memory

    monkeypatch.setenv("SWARMRL_MALLOC_TUNING", "0")
    assert keep_freed_memory.__wrapped__() is False
    monkeypatch.delenv("SWARMRL_MALLOC_TUNING")
    # mallopt answers 1 for each setting it accepted (the thresholds are within glibc's range)
    assert keep_freed_memory.__wrapped__() is (platform.libc_ver()[0] == "glibc")
