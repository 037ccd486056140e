"""Sequence packing (`trainer.max_tokens_per_micro_batch`, swarmrl/trainer/packing.py).

Hand-checked bin packing and index maps; attention isolation inside a pack on a real tiny Qwen2;
the packed trainer against the padded one on random ragged batches (same old logprobs, loss,
metrics and gradients to float32 rounding); and the budget checks at config load, at launch and
at runtime. FSDP2 with 2 gloo ranks whose shares need different numbers of packs:
tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmrl.algorithm.loss import token_logprobs
from swarmrl.config import ConfigError, load_config
from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.trainer.grpo import GRPOTrainer
from swarmrl.trainer.packing import first_fit_decreasing, pack_sequences

from packed_batches import (
    FSDP_BUDGET,
    FSDP_COMPLETIONS,
    make_batch,
    make_cfg,
    random_groups,
)

SHAPE = dict(hidden_size=64, num_layers=2, intermediate_size=128)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------- pure functions


def test_first_fit_decreasing_by_hand():
    # Longest first: 9 -> bin 0 (1 left), 7 -> bin 1 (3 left), 5 -> bin 2 (5 left),
    # 4 -> bin 2 (1 left), 3 -> bin 1 (0 left), 2 fits nowhere -> bin 3.
    assert first_fit_decreasing([5, 9, 3, 7, 2, 4], 10) == [[1], [2, 3], [0, 5], [4]]
    # Ties go in row order, so every rank packing the same rows gets the same packs.
    assert first_fit_decreasing([3, 3, 3], 6) == [[0, 1], [2]]
    assert first_fit_decreasing([4], 4) == [[0]]  # exactly the budget fits
    assert first_fit_decreasing([], 8) == []


def test_a_sequence_over_budget_names_the_field_and_the_size_needed():
    with pytest.raises(ValueError) as e:
        first_fit_decreasing([5, 12, 3], 10)
    assert "trainer.max_tokens_per_micro_batch=10" in str(e.value) and "at least 12" in str(e.value)


def test_pack_layout_and_index_maps_by_hand():
    pad = 0
    input_ids = torch.tensor(
        [
            [11, 12, 13, pad, pad],  # A: 3 tokens
            [21, 22, 23, 24, 25],  # B: 5 tokens
            [31, 32, pad, pad, pad],  # C: 2 tokens
        ]
    )
    packs = pack_sequences(input_ids, torch.tensor([3, 5, 2]), budget=8)
    # B (5) opens pack 0, A (3) fills it exactly, C (2) opens pack 1.
    assert [p.rows.tolist() for p in packs] == [[0, 1], [2]]
    p = packs[0]
    assert p.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24, 25]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # restart at each sequence
    # Packed column c predicts packed token c+1. A predicts its tokens 1..2 from columns 0..1,
    # B its tokens 1..4 from columns 3..6; column 2 would predict B's first token (21) from A's
    # last (13) and is mapped nowhere.
    assert p.src.tolist() == [0, 1, 3, 4, 5, 6]
    assert p.dst_row.tolist() == [0, 0, 1, 1, 1, 1]
    assert p.dst_col.tolist() == [0, 1, 0, 1, 2, 3]
    assert p.width == 4  # the longest member (B, 5 tokens) has 4 predicted columns
    q = packs[1]
    assert q.input_ids.tolist() == [[31, 32]] and q.position_ids.tolist() == [[0, 1]]
    assert (q.src.tolist(), q.dst_row.tolist(), q.dst_col.tolist(), q.width) == ([0], [0], [0], 1)

    values = torch.tensor([[10.0, 11.0, 99.0, 13.0, 14.0, 15.0, 16.0]], requires_grad=True)  # [1, T-1]
    out = p.unpack(values)  # [2, 4] in batch.py's layout
    assert out.tolist() == [[10.0, 11.0, 0.0, 0.0], [13.0, 14.0, 15.0, 16.0]]
    out.sum().backward()  # gradient reaches exactly the mapped columns
    assert values.grad.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]]


# ---------------------------------------------------------------------------- a real model


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@torch.no_grad()
def test_packed_forward_keeps_attention_within_each_sequence(attention):
    """Through the trainer's own forward: each sequence's logprobs in a pack equal those of the
    sequence run alone, and rewriting one member changes no other member's logprobs. (Checked by
    hand with transformers 5.24: the same forward without use_cache=False attends across the
    sequences, 0.55 off in logits, in train and eval mode alike.)"""
    model, _ = build_tiny_policy(0, **SHAPE)
    model.set_attn_implementation(attention)
    model.eval()
    cfg = make_cfg("--trainer.max_tokens_per_micro_batch", "200")
    trainer = GRPOTrainer(model, cfg)
    gen = torch.Generator().manual_seed(3)
    lengths = [9, 17, 5, 30]
    ids = torch.zeros((4, 30), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 261, (n,), generator=gen)
    (pack,) = pack_sequences(ids, torch.tensor(lengths), budget=200)  # all four in one row

    def packed_logprobs(input_ids):
        logits, targets = trainer._logits(model, None, dataclasses.replace(pack, input_ids=input_ids))
        return pack.unpack(token_logprobs(logits, targets))  # [4, 29]

    lp = packed_logprobs(pack.input_ids)
    for r, i in enumerate(pack.rows.tolist()):
        n = lengths[i]
        alone = model(input_ids=ids[i : i + 1, :n]).logits[0, :-1].log_softmax(-1)  # [n-1, V]
        expected = alone.gather(-1, ids[i, 1:n, None]).squeeze(-1)  # [n-1]
        torch.testing.assert_close(lp[r, : n - 1], expected, rtol=0, atol=1e-5)
        assert (lp[r, n - 1 :] == 0).all()  # columns beyond the sequence are mapped nowhere

    # Rewrite the first member in the row: every later member must be untouched.
    first = pack.rows[0].item()
    changed = pack.input_ids.clone()
    changed[0, : lengths[first]] = torch.randint(5, 261, (lengths[first],), generator=gen)
    lp2 = packed_logprobs(changed)
    torch.testing.assert_close(lp2[1:], lp[1:], rtol=0, atol=1e-6)
    assert not torch.allclose(lp2[0], lp[0])


VARIANTS = {
    "default": [],  # recomputed old logprobs, TIS on, no entropy, no KL, temperature 1
    "entropy_kl_temperature": [
        "--algorithm.entropy_coef",
        "0.01",
        "--algorithm.kl_coef",
        "0.05",
        "--sampling.temperature",
        "0.8",
    ],
    "constant_normalizer": ["--algorithm.normalization", "constant"],
    "sequence_normalizer": ["--algorithm.normalization", "sequence"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_step_equals_padded_step(variant):
    """The same random ragged batch through padded micro-batches (3 sequences each) and through
    packs of <= 96 tokens: same old logprobs, same metrics (the loss among them) and the same
    gradient, to float32 rounding. One optimizer step, no clipping, so `.grad` after train_step
    is the whole step's gradient from identical weights."""
    common = ["--trainer.optimizer_steps", "1", "--trainer.grad_clip", "1e9", *VARIANTS[variant]]
    padded_cfg = make_cfg(*common, "--trainer.shared_prompts", "false")  # the plain padded path
    packed_cfg = make_cfg(*common, "--trainer.max_tokens_per_micro_batch", "96")
    model, _ = build_tiny_policy(0, **SHAPE)
    groups = random_groups(
        model,
        prompts=4,
        group_size=4,
        prompt_lens=(3, 12),
        completion_lens=(1, 40),
        seed=7,
        temperature=padded_cfg.sampling.temperature,
    )
    batch = make_batch(groups, padded_cfg)
    lengths = batch.attention_mask.sum(1)
    assert lengths.min() < 20 and lengths.max() > 35  # ragged enough that padding matters

    runs = {}
    for name, cfg in (("padded", padded_cfg), ("packed", packed_cfg)):
        m, _ = build_tiny_policy(0, **SHAPE)
        trainer = GRPOTrainer(m, cfg)
        old = trainer._logprobs(trainer.model, batch)  # [N, L-1]
        metrics = trainer.train_step(batch)
        grads = {k: p.grad.detach().clone() for k, p in m.named_parameters()}
        runs[name] = (old, metrics, grads, trainer._micro_batches(batch, torch.arange(len(batch))))
    (old_a, met_a, g_a, micro_a), (old_b, met_b, g_b, micro_b) = runs["padded"], runs["packed"]
    assert all(pack is None for *_, pack in micro_a)
    assert max(len(pack.rows) for *_, pack in micro_b) >= 3  # sequences really share a forward

    # Old logprobs: equal wherever a sequence has a token (padding columns are garbage when padded).
    real = torch.arange(batch.loss_mask.shape[1])[None] < (lengths - 1)[:, None]  # [N, L-1]
    torch.testing.assert_close(old_b[real], old_a[real], rtol=0, atol=1e-5)
    assert (old_b[~real] == 0).all()

    # ratio/max is a token-weighted mean of each micro-batch's maximum: it depends on how the
    # batch is cut, not only on the numbers, so it is the one metric that may differ.
    assert met_a.keys() == met_b.keys()
    for key in met_a.keys() - {"ratio/max"}:
        assert met_b[key] == pytest.approx(met_a[key], rel=1e-5, abs=1e-7), key
    assert met_a["loss/policy"] != 0 and met_a["grad_norm"] > 0

    worst = 0.0
    for k in g_a:
        scale = float(g_a[k].norm())
        err = float((g_b[k] - g_a[k]).norm())
        worst = max(worst, err / max(scale, 1e-12))
        assert err <= 1e-5 * scale + 1e-9, f"{k}: |packed - padded| = {err:.3g}, |padded| = {scale:.3g}"
    print(f"{variant}: worst relative gradient difference {worst:.2g}")


def test_sequence_normalization_weighs_each_completion_the_same():
    """A step with normalization "sequence" is, exactly, a "token" step whose advantages were each
    scaled by (tokens in the step) / (sequences x that sequence's length): the clipped objective is
    linear in a positive advantage scale. Same gradient, from identical weights."""
    common = ["--trainer.optimizer_steps", "1", "--trainer.grad_clip", "1e9"]
    model, _ = build_tiny_policy(0, **SHAPE)
    seq_cfg = make_cfg(*common, "--algorithm.normalization", "sequence")
    groups = random_groups(
        model, prompts=4, group_size=4, prompt_lens=(3, 12), completion_lens=(1, 40), seed=11, temperature=1.0
    )
    batch = make_batch(groups, seq_cfg)
    lengths = batch.loss_mask.sum(1).float()  # [N]
    assert lengths.min() < 10 and lengths.max() > 30
    scaled = dataclasses.replace(batch, advantages=batch.advantages * lengths.sum() / (len(batch) * lengths))
    grads = []
    for cfg, b in ((seq_cfg, batch), (make_cfg(*common), scaled)):
        m, _ = build_tiny_policy(0, **SHAPE)
        GRPOTrainer(m, cfg).train_step(b)
        grads.append({k: p.grad.detach().clone() for k, p in m.named_parameters()})
    for k in grads[0]:
        scale = float(grads[1][k].norm())
        assert float((grads[0][k] - grads[1][k]).norm()) <= 1e-5 * scale + 1e-9, k
    # And it is not the "token" step itself: the lengths differ, so the weights do.
    m, _ = build_tiny_policy(0, **SHAPE)
    GRPOTrainer(m, make_cfg(*common)).train_step(batch)
    plain = {k: p.grad for k, p in m.named_parameters()}
    assert any(float((plain[k] - grads[0][k]).norm()) > 1e-3 * float(plain[k].norm()) for k in plain)


def test_budget_is_validated_at_config_load():
    # Default max_new_tokens is 64: a 64-token pack cannot hold a prompt and a full completion.
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--trainer.max_tokens_per_micro_batch", "64"])
    msg = str(e.value)
    assert "trainer.max_tokens_per_micro_batch=64" in msg and "sampling.max_new_tokens=64" in msg
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_config(None, ["--trainer.max_tokens_per_micro_batch", "0"])
    assert load_config(None, ["--trainer.max_tokens_per_micro_batch", "65"]).trainer.max_tokens_per_micro_batch == 65
    assert load_config(None, []).trainer.max_tokens_per_micro_batch is None  # default: padded


def test_budget_is_checked_against_the_longest_prompt_before_any_process_starts(tmp_path):
    """`swarmrl rl` tokenizes the run's prompts as the orchestrator will and refuses a budget that
    cannot hold the longest one plus a full completion, before starting anything."""
    from swarmrl.launch.launcher import run_rl
    from swarmrl.tasks.source import model_input, task_rows

    model, tokenizer = build_tiny_policy(0, **SHAPE)
    base = save_policy(model, tokenizer, tmp_path / "base")
    overrides = [
        "--model.path",
        str(base),
        "--tasks.train_size",
        "50",
        "--tasks.eval_size",
        "5",
        "--sampling.max_new_tokens",
        "16",
        "--logging.progress",
        "false",
    ]
    cfg = load_config(None, overrides)
    train, _ = task_rows(cfg, log=lambda *_: None)
    longest = max(len(model_input(tokenizer, r["prompt"], None)[1]) for r in train)
    need = longest + 16

    small = load_config(
        None,
        [*overrides, "--trainer.max_tokens_per_micro_batch", str(need - 1), "--run_dir", str(tmp_path / "run-small")],
    )
    with pytest.raises(ValueError) as e:
        run_rl(small, prepare_only=True, log=lambda *_: None)
    msg = str(e.value)
    assert f"max_tokens_per_micro_batch={need - 1}" in msg and f"at least {need}" in msg
    assert f"longest prompt is {longest} tokens" in msg
    assert not (tmp_path / "run-small" / "policies" / "v000000").exists()  # nothing was set up to run

    fits = load_config(
        None, [*overrides, "--trainer.max_tokens_per_micro_batch", str(need), "--run_dir", str(tmp_path / "run-fits")]
    )
    run_rl(fits, prepare_only=True, log=lambda *_: None)
    assert (tmp_path / "run-fits" / "policies" / "v000000" / "config.json").exists()


def test_a_batch_sequence_over_budget_fails_at_runtime_naming_the_field():
    """A prompt longer than the launch check saw (e.g. roles started by hand) still fails
    clearly in the trainer rather than truncating or mixing sequences."""
    cfg = make_cfg("--trainer.max_tokens_per_micro_batch", "41")
    model, _ = build_tiny_policy(0, **SHAPE)
    groups = random_groups(model, prompts=4, group_size=4, prompt_lens=(10, 12), completion_lens=(35, 40))
    batch = make_batch(groups, cfg)
    with pytest.raises(ValueError) as e:
        GRPOTrainer(model, cfg).train_step(batch)
    longest = int(batch.attention_mask.sum(1).max())
    assert "trainer.max_tokens_per_micro_batch=41" in str(e.value) and f"at least {longest}" in str(e.value)


# ---------------------------------------------------------------------------- FSDP2
# (the run itself: tests/integration/test_fsdp.py)


def test_fsdp_shares_need_different_pack_counts():
    """The premise of the FSDP2 test below: the ranks' shares pack into different counts."""
    lengths = [6 + c for g in FSDP_COMPLETIONS for c in g]
    counts = [len(first_fit_decreasing(lengths[i : i + 4], FSDP_BUDGET)) for i in range(0, 16, 4)]
    assert counts == [4, 1, 2, 3]
