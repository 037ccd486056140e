"""Decoding streams in processes (`inference/streams.py`): the same completions as one engine,
groups kept together, a new policy picked up, errors and dead streams surfaced."""

from __future__ import annotations

import os

import pytest
import torch

from swarmrl.inference.batch import BatchEngine
from swarmrl.inference.engine import build_engine
from swarmrl.inference.streams import StreamedEngine, shard_rows, stream_cores
from swarmrl.model.checkpoint import build_tiny_policy


@pytest.fixture(scope="module")
def policy():
    model, tok = build_tiny_policy(seed=0, hidden_size=64, num_layers=2, intermediate_size=128)
    return model.eval(), tok


@pytest.fixture(scope="module")
def streams(policy):
    model, tok = policy
    engine = StreamedEngine(
        model,
        stop_token_ids=[model.config.vocab_size],
        pad_token_id=tok.pad_token_id,
        streams=3,
        max_batch=24,
        capacity=64,
    )
    yield engine
    engine.close()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _one(model, tok, prompts, seeds, **kw):
    engine = BatchEngine(model, stop_token_ids=[model.config.vocab_size], pad_token_id=tok.pad_token_id, max_batch=4)
    return engine.generate(prompts, seeds, **kw)


def test_shard_rows_keeps_groups_together_and_balances_by_hand():
    prompts = [[1], [2], [1], [3], [2], [4]]
    # groups: [1] -> rows 0, 2; [2] -> 1, 4; [3] -> 3; [4] -> 5; each to the emptiest stream.
    assert shard_rows(prompts, 2) == [[0, 2, 3], [1, 4, 5]]
    assert shard_rows(prompts, 3) == [[0, 2], [1, 4], [3, 5]]
    assert shard_rows([[7]] * 5, 2) == [[0, 1, 2, 3, 4], []]  # one group is never split


def test_streams_give_what_one_engine_gives(policy, streams):
    model, tok = policy
    distinct = _prompts([5, 9, 3, 12, 7], seed=3)
    prompts = distinct + [distinct[1]] * 4 + [distinct[3]] * 3  # two groups sharing prompts
    seeds = list(range(100, 100 + len(prompts)))
    before = dict(streams.stats)
    want = _one(model, tok, prompts, seeds, max_new_tokens=9, return_hidden=True, top_logprobs=2)
    got = streams.generate(prompts, seeds, max_new_tokens=9, return_hidden=True, top_logprobs=2)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(g.hidden, w.hidden, atol=1e-5, rtol=1e-5)
        assert [t for t, _ in sum(g.top_logprobs, [])] == [t for t, _ in sum(w.top_logprobs, [])]
        assert g.finish_reason == w.finish_reason == "length"
    # Each stream prefilled its groups' prompt once: 7 rows shared a prefill.
    done = {k: v - before.get(k, 0) for k, v in streams.stats.items()}
    assert done["shared_prompts"] == 7 and done["prefilled_prompts"] == 5 and done["tokens"] == 9 * len(prompts)
    assert streams.generate([], [], max_new_tokens=3) == []


def test_a_streams_error_is_raised_in_the_caller_and_the_streams_go_on(policy, streams):
    model, tok = policy
    with pytest.raises(ValueError, match="over the engine's cache of 64 tokens"):
        streams.generate(_prompts([4, 60, 5]), [1, 2, 3], max_new_tokens=8)
    with pytest.raises(TypeError, match="on_step"):
        streams.generate(_prompts([4]), [1], max_new_tokens=2, on_step=lambda t, toks: None)
    prompts, seeds = _prompts([4, 6, 8], seed=5), [7, 8, 9]
    got = streams.generate(prompts, seeds, max_new_tokens=5)
    assert [c.token_ids for c in got] == [c.token_ids for c in _one(model, tok, prompts, seeds, max_new_tokens=5)]


def test_a_new_policy_reaches_every_stream(policy):
    model, tok = policy
    other, _ = build_tiny_policy(seed=1, hidden_size=64, num_layers=2, intermediate_size=128)
    engine = build_engine(model, tok, streams=2, stop_token_ids=[model.config.vocab_size])
    try:
        assert isinstance(engine, StreamedEngine)
        # Each stream keeps to its own core when the CPU set has one for each.
        mine = sorted(os.sched_getaffinity(0))
        placed = [sorted(os.sched_getaffinity(p.pid)) for p in engine._procs]
        if len(mine) >= 2:
            assert placed == [[mine[0]], [mine[1]]], placed
        else:
            assert placed == [mine, mine], placed
        prompts, seeds = _prompts([4, 6, 8, 3], seed=9), [1, 2, 3, 4]
        first = [c.token_ids for c in engine.generate(prompts, seeds, max_new_tokens=6)]
        engine.model = other.eval()
        second = [c.token_ids for c in engine.generate(prompts, seeds, max_new_tokens=6)]
        assert second == [c.token_ids for c in _one(other, tok, prompts, seeds, max_new_tokens=6)]
        assert second != first
        # A stream that dies is named, not waited for forever.
        engine._procs[1].kill()
        engine._procs[1].join()
        with pytest.raises(RuntimeError, match="decoding stream 1 died"):
            engine.generate(prompts, seeds, max_new_tokens=6)
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts, seeds, max_new_tokens=6)


def test_streams_go_where_the_os_puts_them_when_not_pinned_or_too_many(policy):
    model, tok = policy
    mine = sorted(os.sched_getaffinity(0))
    assert stream_cores(len(mine) + 1) == [None] * (len(mine) + 1)
    engine = StreamedEngine(model, stop_token_ids=[model.config.vocab_size], pad_token_id=0, streams=2, pin_cores=False)
    try:
        assert [sorted(os.sched_getaffinity(p.pid)) for p in engine._procs] == [mine, mine]
    finally:
        engine.close()


def test_bad_stream_settings_are_refused(policy):
    model, tok = policy
    assert isinstance(build_engine(model, tok, streams=1), BatchEngine)
    with pytest.raises(ValueError, match="streams must be at least 1"):
        build_engine(model, tok, streams=0)
    with pytest.raises(ValueError, match="at least 2"):
        StreamedEngine(model, stop_token_ids=[1], pad_token_id=0, streams=1)
