"""The GRPO trainer on a synthetic but real batch: a tiny random Qwen2, made-up token ids, logprobs
from an actual forward pass (so the inference and recomputed logprobs agree) and hand-set rewards.

Covers: train_step metrics and the direction of the update, the alignment of TrainBatch, FSDP2
(2 gloo processes under torchrun) against one process, checkpoint round trips, and the KL /
entropy / old-logprob / TIS options.

The batch and model are tests/support/tiny_trainer.py's; FSDP2 against one process is
tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.algorithm.advantages import group_advantages
from swarmrl.trainer.checkpoint import checkpoint_dirs, load_checkpoint, save_checkpoint
from swarmrl.trainer.grpo import GRPOTrainer
from swarmrl.trainer.prompts import SharedPrompts

from tiny_trainer import (
    COMPLETION_LENS,
    EXPECTED_KEYS,
    PROMPT_LENS,
    REWARDS,
    make_batch,
    make_cfg,
    make_groups,
    make_model,
    prepare,
    seq_logprobs,
    weights,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------- train_step


def test_train_step_metrics_params_and_direction():
    cfg, model, _, groups, batch = prepare()
    before_w = weights(model)
    before_lp = seq_logprobs(model, groups)
    trainer = GRPOTrainer(model, cfg)
    metrics = trainer.train_step(batch)

    missing = EXPECTED_KEYS - metrics.keys()
    assert not missing, f"missing metric keys {missing}; got {sorted(metrics)}"
    assert "off_policy/logprob_abs_diff" in metrics and "off_policy/logprob_abs_diff_max" in metrics
    assert "tokens" not in metrics  # the per-micro-batch count is not averaged into the metrics
    bad = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isfinite(v))}
    assert not bad, f"non-finite or non-float metrics: {bad}"
    # old (recomputed, padded batch) == inference (unpadded single forwards) before any update.
    assert metrics["off_policy/logprob_abs_diff_max"] < 1e-4
    assert metrics["lr"] == pytest.approx(1e-3)
    assert metrics["train/tokens"] == sum(map(sum, COMPLETION_LENS))
    assert metrics["grad_norm"] > 0
    assert 0.0 <= metrics["clip/low_frac"] <= 1.0 and 0.0 <= metrics["clip/high_frac"] <= 1.0
    assert metrics["entropy/mean"] > 0

    # Every decoder weight moved by far more than weight decay alone (lr * wd * |w| ~ 1e-7).
    after_w = weights(model)
    for name in before_w:
        if "layers" in name and name.endswith("proj.weight"):
            assert (after_w[name] - before_w[name]).abs().max() > 1e-4, name

    # Direction: reinforced samples become likelier, penalised ones less likely.
    delta = seq_logprobs(model, groups) - before_lp  # [N]
    adv = batch.advantages
    assert (adv != 0).all()
    assert (delta[adv > 0] > 0).all(), (delta, adv)
    assert (delta[adv < 0] < 0).all(), (delta, adv)


def test_zero_advantage_batch_only_decays():
    """All-equal rewards: zero advantage, so the only change is AdamW's weight decay."""
    cfg = make_cfg("--algorithm.old_logprobs", "inference")
    model, tok = make_model()
    groups = make_groups(model, rewards=[[1.0] * 4, [0.0] * 4])
    batch = make_batch(groups, cfg, tok)
    assert (batch.advantages == 0).all()
    before = weights(model)
    metrics = GRPOTrainer(model, cfg).train_step(batch)
    assert metrics["grad_norm"] == 0.0
    decay = (1 - cfg.trainer.lr * cfg.trainer.weight_decay) ** cfg.trainer.optimizer_steps
    for name, w in weights(model).items():
        torch.testing.assert_close(w, before[name] * decay, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------- TrainBatch


def test_train_batch_alignment():
    cfg, model, tok, groups, batch = prepare()
    n = sum(len(g.samples) for g in groups)
    width = max(p + c for p, cs in zip(PROMPT_LENS, COMPLETION_LENS) for c in cs)
    assert batch.input_ids.shape == (n, width) and batch.attention_mask.shape == (n, width)
    assert batch.loss_mask.shape == (n, width - 1) and batch.inference_logprobs.shape == (n, width - 1)
    assert batch.loss_mask.dtype == torch.bool and len(batch) == n

    rows = [(g, s) for g in groups for s in g.samples]
    for i, (g, s) in enumerate(rows):
        p, c = len(g.prompt_ids), len(s.token_ids)
        assert batch.input_ids[i, : p + c].tolist() == g.prompt_ids + s.token_ids
        assert (batch.input_ids[i, p + c :] == tok.pad_token_id).all()
        assert batch.attention_mask[i].tolist() == [1] * (p + c) + [0] * (width - p - c)
        # Position t predicts token t + 1: the completion's c tokens are predicted at p-1 .. p+c-2.
        assert batch.loss_mask[i].nonzero().flatten().tolist() == list(range(p - 1, p - 1 + c))
        assert batch.input_ids[i, 1:][batch.loss_mask[i]].tolist() == s.token_ids
        torch.testing.assert_close(batch.inference_logprobs[i, batch.loss_mask[i]], torch.tensor(s.logprobs))
        assert (batch.inference_logprobs[i, ~batch.loss_mask[i]] == 0).all()
        assert int(batch.policy_versions[i]) == g.policy_version

    # Advantages in groups x samples order, signs following the rewards.
    expected = group_advantages(torch.tensor(REWARDS), normalize_std=True, eps=cfg.algorithm.adv_eps).flatten()
    torch.testing.assert_close(batch.advantages, expected)
    flat_r = torch.tensor(REWARDS).flatten()
    assert ((batch.advantages > 0) == (flat_r > torch.tensor(REWARDS).mean(1).repeat_interleave(4))).all()

    # The loss convention: logits[:, :-1] against input_ids[:, 1:] reproduce the inference
    # logprobs exactly at the masked positions of the padded batch.
    from swarmrl.algorithm.loss import token_logprobs

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    lp = token_logprobs(logits, batch.input_ids[:, 1:])
    torch.testing.assert_close(lp[batch.loss_mask], batch.inference_logprobs[batch.loss_mask], atol=1e-5, rtol=0)

    # trimmed() keeps exactly the columns the slice uses, and slice() keeps rows aligned.
    short = batch.slice(torch.tensor([1, 5])).trimmed()  # lengths 5+6=11 and 7+2=9
    assert short.input_ids.shape[1] == 11 and short.loss_mask.shape[1] == 10
    assert short.loss_mask.sum().item() == 6 + 2
    torch.testing.assert_close(short.advantages, batch.advantages[[1, 5]])


# ---------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip(tmp_path):
    root = tmp_path / "ckpt"
    cfg, model, _, _, batch = prepare()
    trainer = GRPOTrainer(model, cfg)
    trainer.train_step(batch)
    path = save_checkpoint(trainer, root, 1, {"accuracy_before": 0.25})
    assert path == root / "step_000001" and (path / "trainer.pt").is_file()
    assert [p.name for p in root.iterdir()] == ["step_000001"]  # no temporary folder left behind
    m2 = trainer.train_step(batch)
    expected = weights(trainer.model)

    # A fresh trainer from the *initial* weights, restored from the checkpoint.
    model_b, _ = make_model(seed=0)
    fresh = GRPOTrainer(model_b, cfg)
    state = load_checkpoint(fresh, root)
    assert state is not None and state["step"] == 1 and state["extra"] == {"accuracy_before": 0.25}
    assert fresh.scheduler.last_epoch == trainer.scheduler.last_epoch - cfg.trainer.optimizer_steps
    m2b = fresh.train_step(batch)
    got = weights(fresh.model)
    assert got.keys() == expected.keys()
    for k in expected:  # same process, same thread count, same inputs: bitwise equal
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert m2b == m2


def test_checkpoint_restores_optimizer_state(tmp_path):
    """Loading must overwrite Adam's moments, not just the weights (a fresh Adam step differs)."""
    cfg, model, _, _, batch = prepare()
    trainer = GRPOTrainer(model, cfg)
    trainer.train_step(batch)
    save_checkpoint(trainer, tmp_path, 1, {})
    fresh = GRPOTrainer(make_model(seed=0)[0], cfg)
    load_checkpoint(fresh, tmp_path)
    a = trainer.optimizer.state_dict()["state"]
    b = fresh.optimizer.state_dict()["state"]
    assert len(a) == len(b) == len(list(model.parameters()))
    for i in a:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b[i][key], a[i][key], rtol=0, atol=0)


def test_checkpoint_keep_prunes_and_atomic(tmp_path):
    cfg = make_cfg()
    trainer = GRPOTrainer(make_model()[0], cfg)
    for step in (1, 2, 3):
        save_checkpoint(trainer, tmp_path, step, {"s": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    save_checkpoint(trainer, tmp_path, 3, {"s": "again"}, keep=2)  # re-saving a step replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    # A stray temporary folder (a save killed mid-write) is never taken for a checkpoint.
    (tmp_path / ".step_000009.tmp-deadbeef").mkdir()
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2, 3]
    state = load_checkpoint(trainer, tmp_path)
    assert state["step"] == 3 and state["extra"] == {"s": "again"}


def test_load_checkpoint_empty(tmp_path):
    trainer = GRPOTrainer(make_model()[0], make_cfg())
    assert load_checkpoint(trainer, tmp_path) is None
    assert load_checkpoint(trainer, tmp_path / "missing") is None


# ---------------------------------------------------------------------------- options


def _count_logprob_passes(trainer) -> list:
    calls = []
    inner = trainer._logprobs

    def counted(model, batch, rows=None):
        calls.append(model is trainer.reference)
        return inner(model, batch, rows)

    trainer._logprobs = counted
    return calls


def test_kl_keeps_frozen_reference():
    cfg, model, _, _, batch = prepare("--algorithm.kl_coef", "0.1")
    initial = weights(model)
    trainer = GRPOTrainer(model, cfg)
    assert trainer.reference is not None and trainer.reference is not trainer.model
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    calls = _count_logprob_passes(trainer)
    m1 = trainer.train_step(batch)
    m2 = trainer.train_step(batch)
    assert calls == [False, True, False, True]  # old logprobs, then reference, each step
    for m in (m1, m2):
        assert "loss/kl" in m and math.isfinite(m["loss/kl"]) and m["loss/kl"] >= 0
    assert m2["loss/kl"] > 0  # the policy has moved away from the reference
    for k, v in trainer.reference.state_dict().items():
        torch.testing.assert_close(v, initial[k], rtol=0, atol=0)
    # Without kl_coef there is no reference and no KL term.
    cfg0 = make_cfg()
    plain = GRPOTrainer(make_model()[0], cfg0)
    assert plain.reference is None and "loss/kl" not in plain.train_step(batch)


def assert_same_update(a: GRPOTrainer, b: GRPOTrainer, cfg) -> None:
    """Two trainers' weights after the same step agree, bounded by the arithmetic: AdamW's first
    steps are ~lr * g / |g| per coordinate, so gradients equal to float32 rounding give weights
    equal to ~1e-7 * lr, except where a coordinate's gradient is ~0 next to its rounding (a key
    bias, whose exact gradient is 0, or a near-cancelling sum): there Adam's step can take any
    value in [-lr, lr]. So every coordinate is within a step per optimizer step and side, and all
    but a few within 1e-5; a wrong proximal policy, mask or cache row moves most of them by ~lr.
    (The gradient itself is compared through grad_norm by the callers.)"""
    lr, steps = cfg.trainer.lr, cfg.trainer.optimizer_steps
    wa, wb = weights(a.model), weights(b.model)
    far, total = 0, 0
    for k in wa:
        diff = (wa[k] - wb[k]).abs()
        assert float(diff.max()) <= 2 * lr * steps, k
        far += int((diff > 1e-5).sum())
        total += diff.numel()
    assert far <= total // 1000, f"{far} of {total} weights differ by more than 1e-5"


def test_the_first_mini_batch_takes_its_proximal_logprobs_from_its_own_forward():
    # Issue 30: before the first optimizer step the policy is the proximal one, so only the later
    # mini-batches get a no-grad pass; the update must be the one a separate pass gives.
    cfg, model, _, _, batch = prepare("--algorithm.tis_level", "sequence")
    n, per_opt = len(batch), len(batch) // cfg.trainer.optimizer_steps
    fast, slow = GRPOTrainer(model, cfg), GRPOTrainer(make_model()[0], cfg)
    seen = []
    inner = fast._logprobs
    fast._logprobs = lambda m, b, rows=None: seen.append(rows.tolist()) or inner(m, b, rows)
    slow.proximal_in_forward = False  # a separate pass over every row, as several ranks do
    m_fast, m_slow = fast.train_step(batch), slow.train_step(batch)
    assert seen == [list(range(per_opt, n))]
    for key in ("off_policy/logprob_abs_diff_max", "off_policy/is_weight_mean", "loss/policy", "grad_norm"):
        assert m_fast[key] == pytest.approx(m_slow[key], rel=1e-4, abs=1e-6), key
    # A wrong proximal policy moves the loss, the clip fractions and every weight.
    assert_same_update(fast, slow, cfg)


def test_micro_batches_go_shortest_first_and_each_is_trimmed_to_its_own_longest():
    cfg, model, _, _, batch = prepare("--trainer.shared_prompts", "false")  # the plain padded path
    trainer = GRPOTrainer(model, cfg)
    lengths = batch.attention_mask.sum(1)
    rows = torch.arange(len(batch))
    micro = trainer._micro_batches(batch, rows)
    order = torch.cat([r for r, _, _ in micro])
    assert sorted(order.tolist()) == rows.tolist()  # every row once
    assert lengths[order].tolist() == sorted(lengths.tolist())
    for r, mb, _ in micro:
        assert mb.input_ids.shape[1] == int(lengths[r].max())
        torch.testing.assert_close(mb.advantages, batch.advantages[r])


def test_shared_prompts_give_the_padded_paths_logprobs_and_update():
    # Issue 30: each prompt runs once and its completions attend to its cached keys and values;
    # autograd sums the prompt's gradient over them, as the padded path does.
    cfg, model, _, _, batch = prepare()
    plain_cfg = make_cfg("--trainer.shared_prompts", "false")
    shared, plain = GRPOTrainer(model, cfg), GRPOTrainer(make_model()[0], plain_cfg)
    micro = shared._micro_batches(batch, torch.arange(len(batch)))
    assert all(isinstance(layout, SharedPrompts) for _, _, layout in micro)
    assert max(len(layout.prompt_ids) for _, _, layout in micro) < max(len(r) for r, _, _ in micro)  # shared
    mask = batch.loss_mask
    a = shared._logprobs(shared.compute_model, batch)
    b = plain._logprobs(plain.compute_model, batch)
    # float32 rounding of the same sums in another order: ~1e-6 here; a wrong mask, position or
    # cache row moves a logprob by ~1.
    torch.testing.assert_close(a[mask], b[mask], rtol=0, atol=1e-4)
    assert not a[~mask].any()  # nothing computed off the completions
    m_shared, m_plain = shared.train_step(batch), plain.train_step(batch)
    for key in ("loss/policy", "grad_norm", "entropy/mean", "ratio/mean", "off_policy/logprob_abs_diff_max"):
        assert m_shared[key] == pytest.approx(m_plain[key], rel=1e-4, abs=1e-6), key
    assert_same_update(shared, plain, cfg)


def test_entropy_bonus():
    cfg, model, _, _, batch = prepare("--algorithm.entropy_coef", "0.01")
    m = GRPOTrainer(model, cfg).train_step(batch)
    assert "loss/entropy" in m and m["loss/entropy"] > 0 and math.isfinite(m["loss/policy"])
    assert m["entropy/mean"] == pytest.approx(m["loss/entropy"], rel=1e-5)


def test_inference_old_logprobs_skip_recompute():
    cfg, model, _, _, batch = prepare("--algorithm.old_logprobs", "inference")
    trainer = GRPOTrainer(model, cfg)
    calls = _count_logprob_passes(trainer)
    m = trainer.train_step(batch)
    assert calls == []
    assert "off_policy/logprob_abs_diff" not in m and "off_policy/logprob_abs_diff_max" not in m
    assert all(math.isfinite(v) for v in m.values())


def test_tis_cap():
    cfg, model, _, _, batch = prepare("--algorithm.tis_cap", "2.0")
    m = GRPOTrainer(model, cfg).train_step(batch)
    assert all(math.isfinite(v) for v in m.values())
    plain = GRPOTrainer(make_model()[0], make_cfg()).train_step(batch)
    # old == inference here, so every TIS weight is 1 up to float rounding: the same loss and
    # gradient as without the correction. (Metrics, not weights: Adam's division by sqrt(v)
    # can amplify a 1e-7 weight difference on a near-zero gradient coordinate to ~1e-5.)
    assert m["loss/policy"] == pytest.approx(plain["loss/policy"], rel=1e-4, abs=1e-6)
    assert m["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    # A sampler less confident than the trainer by 1 nat per token makes every weight
    # e^1 = 2.72, capped at 2: the per-token loss and the gradient are exactly doubled. Both
    # runs clip to the same grad norm (> 1), so both take the same Adam steps and the second
    # optimizer step sees the same weights too.
    skewed = batch.slice(slice(None))
    skewed.inference_logprobs = torch.where(batch.loss_mask, batch.inference_logprobs - 1.0, 0.0)
    m2 = GRPOTrainer(make_model()[0], cfg).train_step(skewed)
    assert all(math.isfinite(v) for v in m2.values())
    assert m2["off_policy/logprob_abs_diff"] == pytest.approx(1.0, abs=1e-4)
    assert plain["grad_norm"] > 2 * cfg.trainer.grad_clip
    assert m2["loss/policy"] == pytest.approx(2 * plain["loss/policy"], rel=1e-3, abs=1e-6)
    assert m2["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-3)


def test_decoupled_ppo_masks_and_sequence_weights():
    # A sampler 1 nat per token less confident than the trainer: every ratio p_old / p_inf is e.
    cfg, model, _, _, batch = prepare(
        "--algorithm.tis_cap", "2.0", "--algorithm.tis_mask_band", "2.0", "--trainer.weight_decay", "0"
    )  # so a zero gradient moves nothing
    skewed = batch.slice(slice(None))
    skewed.inference_logprobs = torch.where(batch.loss_mask, batch.inference_logprobs - 1.0, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    m = GRPOTrainer(model, cfg).train_step(skewed)
    # e > 2 is outside the band [1/2, 2]: every token is masked, so nothing is learned.
    assert m["off_policy/is_masked_frac"] == pytest.approx(1.0)
    assert m["off_policy/is_weight_mean"] == 0.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    # Sequence level, no band: the geometric mean of e per token is e, capped at 2: the
    # same doubling as token-level truncation.
    seq_cfg, *_ = prepare("--algorithm.tis_cap", "2.0", "--algorithm.tis_level", "sequence")
    m_seq = GRPOTrainer(make_model()[0], seq_cfg).train_step(skewed)
    plain = GRPOTrainer(make_model()[0], make_cfg()).train_step(batch)
    assert m_seq["off_policy/is_weight_mean"] == pytest.approx(2.0, rel=1e-4)
    assert m_seq["loss/policy"] == pytest.approx(2 * plain["loss/policy"], rel=1e-3, abs=1e-6)
