"""Hand-computed checks that pin the GRPO advantage and loss formulas."""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.algorithm.advantages import group_advantages, is_informative
from swarmrl.algorithm.loss import (
    LossInputs,
    grpo_loss,
    loss_normalizer,
    token_entropy,
    token_logprobs,
)

# ---------------------------------------------------------------- advantages

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # [G=2, N=4]


def test_group_advantages_with_std():
    # Group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6). Group 1: 0 / eps = 0.
    a = 0.5 / (0.5 + 1e-6)
    expected = torch.tensor([[a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(REWARDS), expected)


def test_group_advantages_without_std():
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(REWARDS, normalize_std=False), expected)


def test_group_advantages_population_std():
    # [0, 0, 0, 1]: mean 1/4, population std sqrt(3)/4 (the unbiased one would be 1/2).
    adv = group_advantages(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), eps=0.0)
    s = math.sqrt(3) / 4
    torch.testing.assert_close(adv, torch.tensor([[-0.25 / s, -0.25 / s, -0.25 / s, 0.75 / s]]))


def test_group_of_one_is_finite():
    adv = group_advantages(torch.tensor([[3.0], [0.0]]))
    torch.testing.assert_close(adv, torch.zeros(2, 1))


def test_is_informative():
    assert is_informative(REWARDS).tolist() == [True, False]
    assert is_informative(torch.tensor([[0.5, 0.5 + 1e-12], [0.0, 0.3]])).tolist() == [False, True]


# ---------------------------------------------------------------- grpo_loss

EPS, DELTA = 0.2, 4.0
# Row 0 has A = +1, row 1 has A = -1; ratios chosen to hit every branch.
# A>0: inside | above 1+eps (clipped to 1.2) | below 1-eps (unclipped) | masked
# A<0: below 1-eps (clipped to 0.8) | inside | 1+eps < r < delta (unclipped) | above delta (-> 4)
RATIOS = torch.tensor([[1.1, 1.5, 0.5, 1.0], [0.5, 1.1, 2.0, 5.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, True, True]])
ADV = torch.tensor([1.0, -1.0])
# Hand values of max(-min(r, delta) A, -clip(r, 0.8, 1.2) A):
TOKEN_LOSS = torch.tensor([[-1.1, -1.2, -0.5, 0.0], [0.8, 1.1, 2.0, 4.0]])
# d loss / d logp = d loss / d r * r; zero wherever a clip or delta binds.
TOKEN_GRAD = torch.tensor([[-1.1, 0.0, -0.5, 0.0], [0.0, 1.1, 2.0, 0.0]])


def make_inputs(**overrides) -> LossInputs:
    old = torch.full((2, 4), -2.0)  # [B, T]
    logprobs = (old + RATIOS.log()).requires_grad_()  # [B, T]
    fields = dict(logprobs=logprobs, old_logprobs=old, advantages=ADV, loss_mask=MASK)
    return LossInputs(**{**fields, **overrides})


def test_grpo_loss_values_and_gradients():
    x = make_inputs()
    loss, metrics = grpo_loss(x, normalizer=7.0, delta=DELTA, eps_low=EPS, eps_high=EPS)
    torch.testing.assert_close(loss, TOKEN_LOSS.sum() / 7)  # 5.1 / 7
    loss.backward()
    torch.testing.assert_close(x.logprobs.grad, TOKEN_GRAD / 7)
    clipped = torch.tensor([[False, True, False, True], [True, False, False, True]])
    assert (x.logprobs.grad[clipped] == 0).all()  # exactly zero, not merely small
    assert (x.logprobs.grad[~clipped] != 0).all()

    assert metrics["tokens"] == 7.0
    assert metrics["loss/policy"] == pytest.approx(5.1 / 7, abs=1e-6)
    assert metrics["clip/low_frac"] == pytest.approx(1 / 7)
    assert metrics["clip/high_frac"] == pytest.approx(1 / 7)
    assert metrics["clip/delta_frac"] == pytest.approx(1 / 7)
    assert metrics["ratio/mean"] == pytest.approx(11.7 / 7, abs=1e-5)
    assert metrics["ratio/max"] == pytest.approx(5.0, abs=1e-5)
    assert "loss/entropy" not in metrics and "loss/kl" not in metrics
    assert all(type(v) is float for v in metrics.values())


def test_asymmetric_eps():
    # Clip-higher (DAPO): eps_high = 0.6 lets the A>0 token at r = 1.5 through unclipped.
    loss, metrics = grpo_loss(make_inputs(), normalizer=1.0, eps_low=EPS, eps_high=0.6)
    torch.testing.assert_close(loss, TOKEN_LOSS.sum() - 0.3)  # -1.2 -> -1.5
    assert metrics["clip/high_frac"] == 0.0


def test_loss_defaults_are_the_configs():
    import inspect

    from swarmrl.config import AlgorithmConfig

    alg = AlgorithmConfig()
    params = inspect.signature(grpo_loss).parameters
    for name in ("delta", "eps_low", "eps_high", "entropy_coef", "kl_coef"):
        assert params[name].default == getattr(alg, name), name
    x = make_inputs()
    a, _ = grpo_loss(x, normalizer=7.0, delta=alg.delta, eps_low=alg.eps_low, eps_high=alg.eps_high)
    b, _ = grpo_loss(x, normalizer=7.0)
    torch.testing.assert_close(a, b)


def test_delta_must_exceed_upper_clip():
    with pytest.raises(ValueError, match="delta"):
        grpo_loss(make_inputs(), normalizer=1.0, delta=1.1, eps_high=0.2)


def test_masked_tokens_contribute_nothing():
    x = make_inputs()
    base, _ = grpo_loss(x, normalizer=7.0)
    base.backward()
    # Garbage (even inf/NaN) in masked positions must change neither loss nor gradients.
    logprobs = x.logprobs.detach().clone()
    logprobs[0, 3] = float("nan")
    old = x.old_logprobs.clone()
    old[0, 3] = -float("inf")
    y = make_inputs(
        logprobs=logprobs.requires_grad_(),
        old_logprobs=old,
        importance_weights=torch.tensor([[1.0, 1.0, 1.0, float("nan")], [1.0] * 4]),
        entropy=torch.tensor([[0.0, 0.0, 0.0, float("inf")], [0.0] * 4]),
        ref_logprobs=torch.where(MASK, logprobs.detach(), 100.0),
    )
    loss, metrics = grpo_loss(y, normalizer=7.0, entropy_coef=0.1, kl_coef=0.1)
    torch.testing.assert_close(loss, base)
    loss.backward()
    torch.testing.assert_close(y.logprobs.grad, x.logprobs.grad)
    assert metrics["ratio/max"] == pytest.approx(5.0, abs=1e-5)


def test_importance_weights_scale_policy_loss():
    w = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 2.0, 0.5, 0.5]])
    x = make_inputs(importance_weights=w)
    loss, metrics = grpo_loss(x, normalizer=7.0)
    torch.testing.assert_close(loss, (TOKEN_LOSS * w).sum() / 7)  # (5.1/2 + 1.1*1.5) / 7
    loss.backward()
    torch.testing.assert_close(x.logprobs.grad, TOKEN_GRAD * w / 7)
    assert metrics["loss/policy"] == pytest.approx(float((TOKEN_LOSS * w).sum()) / 7, abs=1e-6)


def test_entropy_bonus():
    entropy = torch.tensor([[1.0, 2.0, 3.0, 50.0], [0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    x = make_inputs(advantages=torch.zeros(2), entropy=entropy)  # A = 0: no policy term
    loss, metrics = grpo_loss(x, normalizer=7.0, entropy_coef=0.1)
    # Masked sum of entropy = 1 + 2 + 3 + 4 * 0.5 = 8 (the 50 is masked).
    torch.testing.assert_close(loss, torch.tensor(-0.1 * 8 / 7))
    assert metrics["loss/entropy"] == pytest.approx(8 / 7)
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.1 * MASK.float() / 7)


def test_kl_penalty_k3():
    x = make_inputs(advantages=torch.zeros(2))
    ln2 = math.log(2)
    d = torch.tensor([[ln2, 0.0, -ln2, 9.0], [0.0, 0.0, 0.0, 0.0]])  # ref - logp
    x.ref_logprobs = x.logprobs.detach() + d
    loss, metrics = grpo_loss(x, normalizer=7.0, kl_coef=0.5)
    # k3(d) = e^d - d - 1: k3(ln 2) = 1 - ln 2, k3(-ln 2) = ln 2 - 1/2, k3(0) = 0.
    kl_sum = (1 - ln2) + (ln2 - 0.5)  # = 0.5
    torch.testing.assert_close(loss, torch.tensor(0.5 * kl_sum / 7))
    assert metrics["loss/kl"] == pytest.approx(kl_sum / 7, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - e^d: -1 at d = ln 2, +1/2 at d = -ln 2.
    expected = torch.zeros(2, 4)
    expected[0, 0], expected[0, 2] = -1.0, 0.5
    torch.testing.assert_close(x.logprobs.grad, 0.5 * expected / 7)


def test_all_masked_gives_zero():
    x = make_inputs(loss_mask=torch.zeros(2, 4, dtype=torch.bool))
    norm = loss_normalizer("token", num_tokens=0, num_sequences=2, max_tokens=4)
    loss, metrics = grpo_loss(x, normalizer=norm)
    assert loss.item() == 0.0 and metrics["tokens"] == 0.0 and metrics["ratio/max"] == 0.0


def test_micro_batches_sum_to_full_batch():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    logprobs = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logprobs.detach() + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    w = torch.rand(B, T, generator=g) + 0.5
    kw = dict(entropy_coef=0.0, kl_coef=0.1)
    for mode in ("token", "constant", "sequence"):
        norm = loss_normalizer(mode, num_tokens=int(mask.sum()), num_sequences=B, max_tokens=T)

        def loss_of(s: slice, norm: float = norm, mode: str = mode) -> torch.Tensor:  # old_logprobs: also the ref
            inputs = LossInputs(logprobs[s], old[s], adv[s], mask[s], w[s], ref_logprobs=old[s])
            return grpo_loss(inputs, normalizer=norm, per_sequence=mode == "sequence", **kw)[0]

        full = loss_of(slice(None))
        parts = [loss_of(slice(0, 2)), loss_of(slice(2, B))]
        torch.testing.assert_close(sum(parts), full)
        (full_grad,) = torch.autograd.grad(full, logprobs)
        (parts_grad,) = torch.autograd.grad(sum(parts), logprobs)
        torch.testing.assert_close(parts_grad, full_grad)


# ---------------------------------------------------------------- normalizer


def test_loss_normalizer_modes():
    assert loss_normalizer("token", num_tokens=37, num_sequences=4, max_tokens=16) == 37.0
    assert loss_normalizer("constant", num_tokens=37, num_sequences=4, max_tokens=16) == 64.0
    assert loss_normalizer("token", num_tokens=0, num_sequences=4, max_tokens=16) == 1.0
    assert loss_normalizer("constant", num_tokens=0, num_sequences=0, max_tokens=16) == 1.0
    assert loss_normalizer("sequence", num_tokens=37, num_sequences=4, max_tokens=16) == 4.0
    with pytest.raises(ValueError, match="token.*constant.*sequence"):
        loss_normalizer("sample", num_tokens=1, num_sequences=1, max_tokens=1)


def test_per_sequence_loss_is_the_mean_of_sequence_means():
    # Row 0: 3 tokens summing to -2.8; row 1: 4 tokens summing to 7.9 (TOKEN_LOSS).
    x = make_inputs()
    norm = loss_normalizer("sequence", num_tokens=7, num_sequences=2, max_tokens=4)
    loss, _ = grpo_loss(x, normalizer=norm, per_sequence=True)
    torch.testing.assert_close(loss, torch.tensor((-2.8 / 3 + 7.9 / 4) / 2))
    loss.backward()
    # Each token's gradient is its sequence's share: 1 / (length x sequences).
    torch.testing.assert_close(x.logprobs.grad, TOKEN_GRAD / torch.tensor([[3.0], [4.0]]) / 2)
    # An all-masked row adds nothing (and no division by zero).
    y = make_inputs(loss_mask=torch.tensor([[False] * 4, [True] * 4]))
    loss, _ = grpo_loss(y, normalizer=2.0, per_sequence=True)
    torch.testing.assert_close(loss, torch.tensor(7.9 / 4 / 2))


# ---------------------------------------------------------------- token log-probs / entropy


def test_token_logprobs_hand_values_and_temperature():
    ln3 = math.log(3)
    logits = torch.tensor([[[0.0, ln3], [0.0, ln3]]])  # [B=1, T=2, V=2]: probs 1/4, 3/4
    targets = torch.tensor([[1, 0]])
    out = token_logprobs(logits, targets)
    torch.testing.assert_close(out, torch.tensor([[math.log(3 / 4), math.log(1 / 4)]]))
    # T = 2 halves the logits: probs 1 / (1 + sqrt 3), sqrt 3 / (1 + sqrt 3).
    s = math.sqrt(3)
    out = token_logprobs(logits, targets, temperature=2.0)
    torch.testing.assert_close(out, torch.tensor([[math.log(s / (1 + s)), math.log(1 / (1 + s))]]))


def test_token_logprobs_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    targets = torch.randint(0, 11, (3, 5), generator=g)
    for temp in (1.0, 0.7):
        ref = (logits / temp).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        torch.testing.assert_close(token_logprobs(logits, targets, temp), ref)
    assert not torch.allclose(token_logprobs(logits, targets, 0.7), token_logprobs(logits, targets))
    out = token_logprobs(logits.bfloat16(), targets)  # half inputs are upcast
    assert out.dtype == torch.float32
    assert token_logprobs(logits.double(), targets).dtype == torch.float64


def test_token_logprobs_has_gradient():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))
    token_logprobs(logits, targets).sum().backward()
    # d/dz log softmax(z)_y = onehot(y) - softmax(z)
    expected = torch.nn.functional.one_hot(targets, 7).float() - logits.detach().softmax(-1)
    torch.testing.assert_close(logits.grad, expected)


def test_token_entropy():
    ln3 = math.log(3)
    uniform = torch.zeros(1, 1, 4)  # uniform over 4 -> ln 4
    torch.testing.assert_close(token_entropy(uniform), torch.tensor([[math.log(4)]]))
    logits2 = torch.tensor([[[0.0, ln3]]])  # 1/4, 3/4
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(token_entropy(logits2), torch.tensor([[expected]]))
    # Temperature flattens the distribution: entropy goes up, toward ln 2.
    assert token_entropy(logits2, 4.0).item() > expected
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 9, generator=g)
    p = (z / 1.3).softmax(-1)
    torch.testing.assert_close(token_entropy(z, 1.3), -(p * p.log()).sum(-1))


# ---------------------------------------------------------------- off-policy corrections

from swarmrl.algorithm.offpolicy import behaviour_weights  # noqa: E402

LN2 = math.log(2.0)
# Two sequences of three positions; the last position of row 1 is padding.
OP_MASK = torch.tensor([[True, True, True], [True, True, False]])
# Proximal minus behaviour log-probabilities: row 0 ratios 2, 1/2, 8; row 1 ratios 1, 4.
PROX = torch.tensor([[LN2, -LN2, 3 * LN2], [0.0, 2 * LN2, 99.0]])
BEHAV = torch.zeros(2, 3)


def test_behaviour_weights_token_truncated():
    w, m = behaviour_weights(PROX, BEHAV, OP_MASK, cap=3.0)
    # min(ratio, 3) per token; padding gets 0 whatever its garbage says.
    expected = torch.tensor([[2.0, 0.5, 3.0], [1.0, 3.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert m["off_policy/is_weight_mean"] == pytest.approx((2 + 0.5 + 3 + 1 + 3) / 5)
    assert m["off_policy/is_truncated_frac"] == pytest.approx(2 / 5)  # the 8 and the 4
    assert m["off_policy/is_masked_frac"] == 0.0


def test_behaviour_weights_sequence_geometric_mean():
    w, _ = behaviour_weights(PROX, BEHAV, OP_MASK, cap=10.0, level="sequence")
    # Row 0: exp((ln2 - ln2 + 3 ln2) / 3) = 2. Row 1: exp((0 + 2 ln2) / 2) = 2 (padding not counted).
    expected = torch.tensor([[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]])
    torch.testing.assert_close(w, expected)
    w_cap, _ = behaviour_weights(PROX, BEHAV, OP_MASK, cap=1.5, level="sequence")
    torch.testing.assert_close(w_cap, torch.tensor([[1.5, 1.5, 1.5], [1.5, 1.5, 0.0]]))


def test_behaviour_weights_mask_band():
    w, m = behaviour_weights(PROX, BEHAV, OP_MASK, cap=3.0, mask_band=2.5)
    # Band [0.4, 2.5]: 2, 1/2 and 1 stay (2 and 1/2 untruncated), 8 and 4 are dropped.
    expected = torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert m["off_policy/is_masked_frac"] == pytest.approx(2 / 5)
    # At sequence level a whole row leaves the band together: both rows have ratio 2.
    w_seq, _ = behaviour_weights(PROX, BEHAV, OP_MASK, cap=3.0, level="sequence", mask_band=1.5)
    assert float(w_seq.abs().sum()) == 0.0


def test_behaviour_weights_on_policy_is_identity():
    lp = torch.randn(4, 5)
    mask = torch.rand(4, 5) > 0.3
    for level in ("token", "sequence"):
        w, _ = behaviour_weights(lp, lp.clone(), mask, cap=2.0, level=level, mask_band=1.2)
        torch.testing.assert_close(w, mask.float())


def test_behaviour_weights_scale_the_loss():
    # The weights multiply each token's clipped term: halving a token's weight halves its loss.
    lp = torch.zeros(1, 2, requires_grad=True)
    x = LossInputs(
        logprobs=lp,
        old_logprobs=torch.zeros(1, 2),
        advantages=torch.tensor([1.0]),
        loss_mask=torch.tensor([[True, True]]),
    )
    base, _ = grpo_loss(x, normalizer=2.0)
    w, _ = behaviour_weights(torch.tensor([[0.0, -LN2]]), torch.zeros(1, 2), x.loss_mask, cap=2.0)
    weighted, _ = grpo_loss(LossInputs(**{**x.__dict__, "importance_weights": w}), normalizer=2.0)
    # Each token's loss is -r * A = -1; unweighted mean -1, weighted (-1 - 0.5) / 2 = -0.75.
    assert float(base.detach()) == pytest.approx(-1.0)
    assert float(weighted.detach()) == pytest.approx(-0.75)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cap": 0.0}, "cap must be > 0"),
        ({"cap": -1.0}, "cap must be > 0"),
        ({"cap": 2.0, "level": "group"}, "unknown importance-weight level"),
        ({"cap": 2.0, "mask_band": 1.0}, "mask_band must be > 1"),
    ],
)
def test_behaviour_weights_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        behaviour_weights(PROX, BEHAV, OP_MASK, **kwargs)
