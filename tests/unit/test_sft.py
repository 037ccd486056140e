"""The warm start's precision and thread settings, and the cache key they shape."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from swarmrl.config import ConfigError, load_config
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.sft.warmstart import base_cache_key, encode_example, train_sft
from swarmrl.tasks import arithmetic


def test_cache_key_keeps_old_bases_and_separates_new_settings():
    assert base_cache_key(load_config(None, [])) == "d2-pm-s600-b64-lr0.003-n5000-slip0.7-seed0-mb4"
    one_pass = ["--sft.micro_batches", "1"]
    default = base_cache_key(load_config(None, one_pass))
    assert default.endswith("-seed0")  # bases cached before dtype/threads existed stay valid
    assert base_cache_key(load_config(None, [*one_pass, "--sft.dtype", "float64"])) == default + "-float64"
    assert base_cache_key(load_config(None, [*one_pass, "--sft.threads", "1"])) == default + "-t1"
    lc = load_config("configs/length-control.toml", [])
    assert base_cache_key(lc).endswith("-v02-len32-80-match0.3")
    # target_match 0 adds nothing: length-control bases cached before the field existed stay valid.
    assert base_cache_key(load_config("configs/length-control.toml", ["--sft.target_match", "0"])).endswith("-len32-80")


def test_target_match_names_the_nearest_target_for_that_share_of_traces():
    import random

    from swarmrl.sft.warmstart import _sft_target

    _, tokenizer = build_tiny_policy(seed=0)
    rows = arithmetic.generate(
        400, digits=2, ops="+-", split="train", seed=1000, with_trace=True, slip_rate=0.5, verbosity=(0, 2)
    )
    lengths = [len(tokenizer(r["trace"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    nearest = [32 if abs(n - 32) < abs(n - 80) else 80 for n in lengths]

    def targets(match: float) -> list[int]:
        cfg = load_config("configs/length-control.toml", ["--sft.target_match", str(match)])
        rng = random.Random(7)
        return [_sft_target(tokenizer, r["trace"], cfg, rng) for r in rows]

    assert targets(1.0) == nearest  # every prompt names the target its trace meets
    # 0: exactly the draws of the warm start before the field existed (one choice per trace).
    rng = random.Random(7)
    assert targets(0.0) == [rng.choice([32, 80]) for _ in rows]
    agree = sum(t == n for t, n in zip(targets(0.3), nearest)) / len(rows)
    assert 0.55 < agree < 0.75  # 0.3 + 0.7 * 1/2 = 0.65 expected
    assert load_config(None, []).sft.target_match == 0.0
    with pytest.raises(ConfigError, match="sft.target_match"):
        load_config(None, ["--sft.target_match", "1.5"])


def test_bad_verbosity_is_refused_with_the_field_named():
    for bad in ("[3]", "[]", "[1, 1]"):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["--sft.verbosity", bad])
        assert "sft.verbosity" in str(err.value)


def test_length_control_warm_start_puts_targets_in_prompts(tmp_path):
    torch_threads = torch.get_num_threads()
    try:
        cfg = load_config(
            "configs/length-control.toml",
            ["--sft.steps", "2", "--sft.batch_size", "4", "--sft.examples", "60", "--sft.threads", "1"],
        )
        out = train_sft(cfg, tmp_path / "lc", log=lambda msg: None)
        meta = json.loads((out / "swarmrl_sft.json").read_text())
        assert meta["verbosity"] == [0, 2] and meta["length_targets"] == [32, 80] and meta["target_match"] == 0.3
    finally:
        torch.set_num_threads(torch_threads)
    # An example as the warm start encodes it: the instruction in the prompt, only the trace learned.
    _, tokenizer = build_tiny_policy(seed=0)
    rows = arithmetic.generate(
        60, digits=2, ops="+-", split="train", seed=1000, with_trace=True, slip_rate=0.5, verbosity=(0, 1, 2)
    )
    ids, mask = encode_example(tokenizer, rows[0]["prompt"], rows[0]["trace"], 52)
    text = tokenizer.decode(ids)
    assert "Think for 52 tokens before giving a response." in text
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]).startswith(rows[0]["trace"])


def test_float64_warm_start_saves_float32_and_records_how(tmp_path):
    torch_threads = torch.get_num_threads()
    try:
        small = ["--sft.steps", "3", "--sft.batch_size", "4", "--sft.examples", "32", "--sft.threads", "1"]
        runs = {}
        for dtype in ("float32", "float64"):
            cfg = load_config(None, [*small, "--sft.dtype", dtype])
            out = train_sft(cfg, tmp_path / dtype, log=lambda msg: None)
            runs[dtype] = load_file(str(out / "model.safetensors"))
            meta = json.loads((out / "swarmrl_sft.json").read_text())
            assert meta["dtype"] == dtype and meta["threads"] == 1 and meta["cpu_capability"]
        assert all(t.dtype == torch.float32 for t in runs["float64"].values())
        # Same start, same batches: after 3 steps the two precisions agree closely but not exactly.
        diff = max(float((runs["float32"][k] - runs["float64"][k]).abs().max()) for k in runs["float32"])
        assert 0.0 < diff < 1e-3
    finally:
        torch.set_num_threads(torch_threads)


def test_micro_batches_give_the_one_pass_gradient_with_less_padding():
    from swarmrl.sft.warmstart import _accumulate, micro_batches

    model, tokenizer = build_tiny_policy(seed=0)
    rows = arithmetic.generate(24, digits=2, ops="+-", split="train", seed=5, with_trace=True, slip_rate=0.5)
    batch = [encode_example(tokenizer, r["prompt"], r["trace"]) for r in rows]
    parts = micro_batches(batch, 4)
    assert [len(p) for p in parts] == [6, 6, 6, 6]
    lengths = [len(ids) for p in parts for ids, _ in p]
    assert lengths == sorted(len(ids) for ids, _ in batch)  # every trace once, in length order
    assert sum(max(len(ids) for ids, _ in p) * len(p) for p in parts) < max(lengths) * len(batch)
    assert micro_batches(batch, 1) == [batch]

    def gradient(n: int) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = _accumulate(model, batch, n, tokenizer.pad_token_id)
        return float(loss), [p.grad.clone() for p in model.parameters()]

    loss1, g1 = gradient(1)
    loss4, g4 = gradient(4)
    assert abs(loss1 - loss4) < 1e-5 and loss1 > 0.1
    for a, b in zip(g1, g4):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert max(float(a.abs().max()) for a in g1) > 1e-3  # a gradient worth comparing


def test_micro_batches_train_a_base_and_name_it_in_the_cache_key(tmp_path):
    cfg = load_config(
        None,
        [
            "--sft.steps",
            "2",
            "--sft.batch_size",
            "8",
            "--sft.examples",
            "64",
            "--sft.micro_batches",
            "2",
            "--sft.threads",
            "1",
        ],
    )
    seen = []
    out = train_sft(
        cfg,
        tmp_path / "base",
        log=lambda *_: None,
        on_step=lambda step, model, loss: seen.append((step, model.training, float(loss))),
    )
    assert [(step, training) for step, training, _ in seen] == [(1, True), (2, True)]
    assert all(loss > 0 for _, _, loss in seen)
    meta = json.loads((out / "swarmrl_sft.json").read_text())
    assert meta["micro_batches"] == 2 and meta["sft_steps"] == 2
    assert base_cache_key(cfg).endswith("-t1-mb2")
    with pytest.raises(ConfigError, match="sft.micro_batches"):
        load_config(None, ["--sft.micro_batches", "0"])
