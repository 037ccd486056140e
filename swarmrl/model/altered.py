"""Altered copies of a model: the cheaper or other models a cheating worker would run instead of
the policy (the adversaries, `swarmrl calibrate`'s cheat catalogue and the precision tests use them)."""

from __future__ import annotations

import copy

import torch


def quantised(model, bits: int, group: int | None = 32):
    """A copy of `model` whose decoder linear weights are rounded to `bits`-bit integers
    (symmetric, one scale per `group` consecutive inputs of an output row; None: one per output
    row, i.e. per channel) and stored back in the model's dtype: what a weight-only int8 / int4
    (GPTQ, AWQ-style) checkpoint computes. Embeddings and the output head stay exact, as those
    tools leave them."""
    out = copy.deepcopy(model)
    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for layer in out.model.layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    w = m.weight.float()  # [out, in]
                    g = w.reshape(w.shape[0], -1, group or w.shape[1])  # [out, in / group, group]
                    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
                    m.weight.copy_(((g / scale).round().clamp(-levels, levels) * scale).reshape_as(w))
    return out.eval()


def stepped(model, lr: float, seed: int = 7):
    """A copy of `model` one optimizer step away: every weight moved by `lr` with a random sign,
    the size of Adam's first step (its update is about lr * sign(gradient)). What a worker that
    samples with the previous version and claims the current one runs, one trainer step behind."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
            p.add_(sign, alpha=lr)
    return out.eval()


def reinitialised(model):
    """A copy of `model` with every layer's weights drawn afresh (a fixed seed): another model of
    the same architecture and vocabulary."""
    out = copy.deepcopy(model)
    torch.manual_seed(12345)
    for module in out.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return out.eval()
