"""Training precision and memory switches of the GRPO trainer: `trainer.precision` (fp32, mixed
with float32 master weights, pure bf16), `trainer.activation_checkpointing`, `trainer.cpu_offload`.

Real training steps on the tiny random Qwen2 of tests/support/tiny_trainer.py (bf16 matmuls are ~100x
slower on these CPUs, so everything bf16 here is a few sequences of a 2-layer model). Validation
tolerances of bf16 work are tests/integration/test_precision.py, a different subject. Mixed
precision on FSDP2 against one process: tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from swarmrl.config import ConfigError, load_config
from swarmrl.inference.engine import build_engine
from swarmrl.model.checkpoint import load_policy, save_policy
from swarmrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from swarmrl.trainer.grpo import GRPOTrainer, decoder_layers

from tiny_trainer import make_cfg, make_model, prepare, seq_logprobs, weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _output_dtype(out) -> torch.dtype:
    return (out[0] if isinstance(out, tuple) else out).dtype


def _decoder_proj_weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights(model).items() if "layers" in k and k.endswith("proj.weight")}


# ---------------------------------------------------------------------------- config


def test_precision_config_rules():
    # Today's default run is unchanged: float32 everywhere.
    cfg = load_config(None, [])
    assert (cfg.trainer.precision, cfg.model.dtype) == ("fp32", "float32")
    assert not cfg.trainer.activation_checkpointing and not cfg.trainer.cpu_offload
    # bf16 compute means mixed precision unless pure bf16 is asked for; either field sets the other.
    assert load_config(None, ["--model.dtype", "bfloat16"]).trainer.precision == "mixed"
    assert load_config(None, ["--trainer.precision", "mixed"]).model.dtype == "bfloat16"
    assert load_config(None, ["--trainer.precision", "bf16"]).model.dtype == "bfloat16"
    # The resolved value is written out, and a reload agrees.
    again = load_config(None, ["--trainer.precision", "mixed"])
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"precision-{os.getpid()}.toml"
    path.write_text(again.to_toml())
    try:
        reloaded = load_config(path)
    finally:
        path.unlink()
    assert (reloaded.trainer.precision, reloaded.model.dtype) == ("mixed", "bfloat16")
    # Both set and incoherent: refused at load, naming both fields and what would fit.
    with pytest.raises(ConfigError, match=r'trainer.precision = "mixed".*model.dtype = "float32".*"fp32"'):
        load_config(None, ["--trainer.precision", "mixed", "--model.dtype", "float32"])
    with pytest.raises(ConfigError, match=r'trainer.precision = "fp32".*model.dtype = "bfloat16".*"mixed" or "bf16"'):
        load_config(None, ["--trainer.precision", "fp32", "--model.dtype", "bfloat16"])
    with pytest.raises(ConfigError, match="trainer.precision"):
        load_config(None, ["--trainer.precision", "fp16"])
    # CPU offload is FSDP2's: one rank on an accelerator cannot have it; on CPU it is a no-op.
    with pytest.raises(ConfigError, match="trainer.cpu_offload.*trainer.nproc"):
        load_config(None, ["--trainer.cpu_offload", "true", "--model.device", "cuda"])
    assert load_config(None, ["--trainer.cpu_offload", "true"]).trainer.cpu_offload


# ---------------------------------------------------------------------------- mixed precision


def test_mixed_keeps_fp32_masters_and_computes_in_bf16(tmp_path):
    cfg, model, tok, groups, batch = prepare("--trainer.precision", "mixed")
    before = _decoder_proj_weights(model)
    before_lp = seq_logprobs(model, groups)
    trainer = GRPOTrainer(model, cfg)
    assert trainer.model is model and trainer.compute_model is not model
    seen, master_forwards = [], []
    decoder_layers(trainer.compute_model)[0].register_forward_hook(lambda m, a, out: seen.append(_output_dtype(out)))
    decoder_layers(trainer.model)[0].register_forward_hook(lambda *a: master_forwards.append(1))
    metrics = trainer.train_step(batch)

    # Every training forward (old logprobs and the update) ran in bf16, none on the masters.
    assert seen and set(seen) == {torch.bfloat16}
    assert not master_forwards
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad and metrics["grad_norm"] > 0
    # The recomputed old logprobs are bf16's: off the float32 inference logprobs by bf16 rounding
    # (float32 agrees to < 1e-4, tests/test_trainer.py), and not by more.
    assert 1e-3 < metrics["off_policy/logprob_abs_diff_max"] < 0.2, metrics["off_policy/logprob_abs_diff_max"]

    # Master weights and AdamW state stay float32, and the masters moved.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    states = list(trainer.optimizer.state.values())
    assert len(states) == len(list(model.parameters()))
    for st in states:
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    for name, w in _decoder_proj_weights(model).items():
        assert (w - before[name]).abs().max() > 1e-4, name
    # The compute copy is the masters rounded to bf16, holds no gradient, and its buffers (the
    # rotary inv_freq) stay float32 as FSDP2 leaves them.
    for (name, low), master in zip(trainer.compute_model.named_parameters(), model.parameters(), strict=True):
        assert low.dtype == torch.bfloat16 and low.grad is None, name
        assert torch.equal(low, master.detach().to(torch.bfloat16)), name
    assert all(b.dtype == torch.float32 for b in trainer.compute_model.buffers() if b.is_floating_point())

    # The update goes the right way, seen through the float32 masters.
    delta = seq_logprobs(model, groups) - before_lp
    assert (delta[batch.advantages > 0] > 0).all() and (delta[batch.advantages < 0] < 0).all(), delta

    # Published: the declared inference precision. Checkpointed: the float32 masters.
    published = trainer.full_state_dict(torch.bfloat16)
    masters = trainer.full_state_dict()
    assert published.keys() == masters.keys() == model.state_dict().keys()
    assert {v.dtype for v in published.values()} == {torch.bfloat16}
    assert {v.dtype for v in masters.values()} == {torch.float32}
    folder = save_policy(model, tok, tmp_path / "v1", state_dict=published)
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, _ = load_policy(folder, dtype=torch.float32)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, masters[k].to(torch.bfloat16).float(), rtol=0, atol=0)
    path = save_checkpoint(trainer, tmp_path / "ckpt", 1, {})
    state = torch.load(path / "trainer.pt", weights_only=False)
    assert {v.dtype for v in state["model"].values()} == {torch.float32}
    assert all(s["exp_avg"].dtype == torch.float32 for s in state["optimizer"]["state"].values())


def test_mixed_gradient_tracks_fp32():
    """Same batch, same weights: mixed precision's gradient norm is float32's within bf16 noise
    (a wrong cast, a dropped micro-batch or a gradient left in bf16 accumulation is far off)."""
    out = {}
    for precision in ("fp32", "mixed"):
        cfg, model, _, _, batch = prepare("--trainer.precision", precision)
        out[precision] = GRPOTrainer(model, cfg).train_step(batch)
    assert out["mixed"]["grad_norm"] == pytest.approx(out["fp32"]["grad_norm"], rel=0.03)
    assert out["mixed"]["loss/policy"] == pytest.approx(out["fp32"]["loss/policy"], abs=0.02)


def test_masters_keep_updates_that_pure_bf16_loses():
    """What fp32 masters are for: at lr 1e-6 an Adam step (~lr per weight) is below bf16's
    resolution (~0.4% of a weight), so pure bf16 weights stay where they were; masters move."""
    changed = {}
    for precision in ("bf16", "mixed"):
        cfg, model, _, _, batch = prepare("--trainer.precision", precision, "--trainer.lr", "1e-6")
        trainer = GRPOTrainer(model, cfg)
        before = _decoder_proj_weights(model)
        trainer.train_step(batch)
        after = _decoder_proj_weights(model)
        moved = sum(int((after[k] != before[k]).sum()) for k in before)
        changed[precision] = moved / sum(v.numel() for v in before.values())
        dtypes = {st["exp_avg"].dtype for st in trainer.optimizer.state.values()}
        assert dtypes == {torch.bfloat16 if precision == "bf16" else torch.float32}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16 if precision == "bf16" else torch.float32}
    assert changed["mixed"] > 0.95, changed
    assert changed["bf16"] < 0.1, changed


def test_mixed_reference_and_sampling_from_the_trainer(tmp_path):
    """kl_coef > 0: the frozen reference computes in bf16 like the policy, so KL starts at 0; the
    trainer's model (the float32 masters, activation checkpointing on) still samples through the
    project's engine, as held-out evaluation does, with the tokens of a plain float32 copy."""
    cfg, model, tok, _, batch = prepare(
        "--trainer.precision",
        "mixed",
        "--algorithm.kl_coef",
        "0.1",
        "--trainer.activation_checkpointing",
        "true",
        "--trainer.optimizer_steps",
        "1",
    )
    trainer = GRPOTrainer(model, cfg)
    assert {p.dtype for p in trainer.reference.parameters()} == {torch.bfloat16}
    m1 = trainer.train_step(batch)
    assert m1["loss/kl"] == 0.0  # one optimizer step: policy == reference while it is computed
    m2 = trainer.train_step(batch)
    assert m2["loss/kl"] > 0

    plain, _ = make_model()
    plain.load_state_dict(trainer.full_state_dict())
    prompts = [[1, 10, 20, 30], [1, 40, 50]]
    engine = build_engine(trainer.model.eval(), tok)
    assert type(engine).__name__ == "BatchEngine"  # the fast decoder reads through the wrapper
    got = engine.generate(prompts, [7, 8], max_new_tokens=6)
    want = build_engine(plain.eval(), tok).generate(prompts, [7, 8], max_new_tokens=6)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    # The trainer loop's publish path with the wrapped model: plain HF names, bf16 on disk.
    folder = save_policy(trainer.model, tok, tmp_path / "v2", state_dict=trainer.full_state_dict(torch.bfloat16))
    loaded, _ = load_policy(folder, dtype=torch.float32)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, plain.state_dict()[k].to(torch.bfloat16).float(), rtol=0, atol=0)


# ---------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_activation_checkpointing_same_gradients(precision, tmp_path):
    runs = {}
    for ac in (False, True):
        cfg, model, _, _, batch = prepare(
            "--trainer.precision",
            precision,
            "--trainer.activation_checkpointing",
            str(ac).lower(),
            "--trainer.shared_prompts",
            "false",  # one forward per micro-batch on both sides (checkpointing turns sharing off)
        )
        trainer = GRPOTrainer(model, cfg)
        layer = decoder_layers(trainer.compute_model)[0]
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        assert (inner is not layer) == ac
        calls = []
        # A pre-hook: a recompute stops as soon as backward has what it needs, before forward hooks.
        inner.register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))
        metrics = trainer.train_step(batch)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        runs[ac] = dict(metrics=metrics, calls=len(calls), grads=grads, sd=trainer.full_state_dict(), trainer=trainer)
    plain, ckpt = runs[False], runs[True]
    # Really on: each training micro-batch's layer forward runs again in backward.
    training_micro_batches = 4  # 8 sequences, micro-batches of 2
    assert ckpt["calls"] == plain["calls"] + training_micro_batches
    # Same gradients (of the last mini-batch), same update, same names (no wrapper prefix).
    assert [n.replace("_checkpoint_wrapped_module.", "") for n in ckpt["grads"]] == list(plain["grads"])
    # fp32: the recomputed forward is the same arithmetic. bf16 (mixed): oneDNN may block a
    # recomputed product differently (a CI run differed from a local one), so bf16's own rounding
    # (2**-8 relative) bounds the agreement; a missing or doubled recompute would be far off.
    g_tol = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=2e-2, atol=1e-5)
    for (name, g), g0 in zip(ckpt["grads"].items(), plain["grads"].values()):
        torch.testing.assert_close(g, g0, **g_tol, msg=lambda m, name=name: f"{name}: {m}")
    assert ckpt["sd"].keys() == plain["sd"].keys()
    for k in plain["sd"]:
        torch.testing.assert_close(ckpt["sd"][k], plain["sd"][k], rtol=0, atol=1e-6 if precision == "fp32" else 2e-5)
    assert ckpt["metrics"]["grad_norm"] == pytest.approx(
        plain["metrics"]["grad_norm"], rel=1e-5 if precision == "fp32" else 1e-2
    )
    # A checkpoint written with it loads without it (and Adam's state lines up by name).
    save_checkpoint(ckpt["trainer"], tmp_path, 1, {})
    cfg = make_cfg("--trainer.precision", precision)
    fresh = GRPOTrainer(make_model(seed=5)[0], cfg)
    load_checkpoint(fresh, tmp_path)
    for k, v in fresh.full_state_dict().items():
        torch.testing.assert_close(v, ckpt["sd"][k], rtol=0, atol=0)
    assert len(fresh.optimizer.state) == len(ckpt["trainer"].optimizer.state)
