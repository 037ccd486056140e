"""A lean forward pass of Qwen2, Qwen3 and Llama decoders over a pre-allocated, per-slot KV cache.

Why not the Hugging Face module: at the sizes this project trains on a CPU, a decoding step is
dominated by per-call overhead (module dispatch, mask construction, a `DynamicCache` that grows
by concatenation, so every step copies the whole cache) rather than by arithmetic. This runs the
same layers as `Qwen2Model` (and its siblings below) with the model's own parameters, and keeps
keys and values in fixed tensors, one slot per row, written in place:

    k[layer]: [slots, kv_heads, capacity, head_dim]   (v the same)

A slot holds one sequence from position 0 (no padding), so a row's cache never moves while it
decodes, rows of different lengths share a step (a per-slot length masks the rest), and a
finished row's slot is refilled by a new prompt without touching the others.

Numerics follow the Hugging Face implementation op for op where the order matters (RMSNorm in
float32, rotary tables in float32 cast to the model dtype, softmax in float32), so a prefill by
`model(...)` (what validators do) agrees with these decode steps to rounding; the validator's
tolerances cover the rest, and `tests/unit/test_engine.py` checks the agreement.

Supported (`supports(model)`), the families users fine-tune today, which differ only in details
of one layer:
- Qwen2 / Qwen2.5 (`model_type` "qwen2"): biases on the q/k/v projections, untied or tied heads.
- Qwen3 dense ("qwen3"): no biases, an RMSNorm over each query and key head before the rotary
  embedding (q_norm, k_norm), and an explicit head_dim that may differ from hidden / heads.
- Llama, SmolLM/SmolLM2 ("llama"): no biases, usually tied embeddings.
Each is checked against transformers' own forward (logits and hidden states) and against the
generic engine (the same seeded tokens) in `tests/unit/test_model_families.py`, on random
weights with real checkpoints' shapes at reduced depth. Refused, so they use the generic sampler
(`inference/sampler.py`): other architectures (Mistral, Gemma, Phi, mixtures of experts), sliding
windows, rope scaling (Llama 3.1's "llama3" included), activations other than silu, biases on the
attention output or the MLP (Llama's attention_bias / mlp_bias), FSDP-sharded parameters.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch import Tensor

from swarmrl.inference import native

# By config.model_type: Qwen2.5 checkpoints say "qwen2"; SmolLM/SmolLM2 and Llama 2 say "llama"
# (Llama 3.1+ too, but their "llama3" rope scaling is refused below). Each family is checked
# against transformers' own forward in tests/unit/test_model_families.py.
log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama")
FAMILIES = "Qwen2/Qwen2.5, Qwen3 (dense) and Llama/SmolLM"


def _rope_type(cfg) -> str:
    # transformers 5 keeps rotary settings in `rope_parameters` (`rope_scaling` is an alias);
    # older configs only have `rope_scaling`.
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, name, None)
        if isinstance(params, dict):
            return params.get("rope_type", params.get("type")) or "default"
    return "default"


def _unsupported_layer(layer) -> str | None:
    """Why this decoder cannot run one decoder layer's modules, or None."""
    a, m = layer.self_attn, layer.mlp
    if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "an attention block without separate q/k/v/o projections"
    if not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "an MLP without gate/up/down projections"
    qkv_bias = [getattr(a, n).bias is not None for n in ("q_proj", "k_proj", "v_proj")]
    if any(qkv_bias) and not all(qkv_bias):
        return "biases on some of the q/k/v projections but not all"
    # Checked on the modules, not only on config flags (attention_bias, mlp_bias), so a model
    # built or edited another way is refused too rather than decoded without its biases.
    if a.o_proj.bias is not None:
        return "a bias on the attention output projection (attention_bias=True)"
    if any(getattr(m, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return "biases on the MLP projections (mlp_bias=True)"
    if (getattr(a, "q_norm", None) is None) != (getattr(a, "k_norm", None) is None):
        return "a norm on the query heads or on the key heads, not both"
    return None


def supports(model) -> str | None:
    """None when this decoder can run ``model``; otherwise why not (for a log line or an error)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} is not one it implements ({FAMILIES}: {', '.join(SUPPORTED_TYPES)})"
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return "sliding-window attention"
    if _rope_type(cfg) != "default":
        return f"rope scaling {_rope_type(cfg)!r} (only plain rotary embeddings)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (only silu)"
    for layer in model.base_model.layers:
        why = _unsupported_layer(layer)
        if why is not None:
            return why
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        # Sharded (FSDP2) parameters are gathered by the modules' forward hooks, which this
        # decoder does not call.
        return "sharded (FSDP) parameters"
    return None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:  # one fused kernel; the same values as the three-op form
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _head_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3's RMSNorm over each head's ``head_dim`` values; ``weight`` is [heads, head_dim]
    (the q_norm or k_norm weight repeated per head, so queries and keys go through one call)."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps) * weight
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


#: Weights with at least this many elements go through oneDNN's linear (below); smaller ones
#: through MKL, whose call costs ~20 us less (a 1M-parameter model's 64 x 192 projections run
#: at half speed through oneDNN, a 135M model's at 1.2-2.2x the speed).
ONEDNN_MIN_WEIGHT = 1 << 18


def _onednn_linear():
    """oneDNN's float32 linear (`torch.ops.mkldnn._linear_pointwise`, what torch's own compiler
    emits for CPU linears), or None where this torch build or CPU lacks it.

    Why: on the products a decode step makes (32-64 rows against weights far larger than the
    caches), MKL's sgemm reached 40-60 GFLOP/s on one Zen 4 core and oneDNN's kernels 67-77
    (two cores: 41-101 against 108-142; docs/engines.md), from the weight as the model stores it
    ([out, in], no copy). It is a private op: anything unexpected here falls back to MKL, and
    the result is checked against `F.linear` once, so a build whose op misbehaves is never used."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return None
    try:
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(8, 64, generator=gen)
            w = torch.randn(48, 64, generator=gen)
            b = torch.randn(48, generator=gen)
            got = op(x, w, b, "none", [], "")
            want = torch.nn.functional.linear(x, w, b)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
            return None
    except Exception:  # not built with oneDNN, an unsupported CPU, a changed signature
        return None
    return op


@functools.cache
def onednn_linear():
    """`_onednn_linear`, probed once per process."""
    return _onednn_linear()


#: Which kernels multiply a CPU float32 decoder's large weights: "auto" (time both on the model's
#: own weights when the decoder is built and keep the faster), "onednn" or "mkl".
LINEAR_ENV = "SWARMRL_CPU_LINEAR"
LINEAR_CHOICES = ("auto", "onednn", "mkl")

# Neither library wins everywhere. A decode step's products (64 rows, SmolLM2-135M's layers, 2
# threads): oneDNN 1.3-2.2x MKL's rate on an AMD EPYC (Zen 4), MKL 1.17x oneDNN's on an Intel
# Xeon with AMX (69 against 81 ms a step). So a decoder measures, once per process and model shape.
_LINEAR_CHOICE: dict[tuple, str] = {}


def linear_setting() -> str:
    """The `LINEAR_ENV` setting, checked."""
    value = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if value not in LINEAR_CHOICES:
        raise ValueError(
            f"{LINEAR_ENV}={value!r} is not one of {', '.join(LINEAR_CHOICES)}; unset it to let the decoder choose"
        )
    return value


def _time_products(layers: list, run, rows: int, reps: int = 2) -> float:
    """The best of ``reps`` passes over every layer's four products with ``rows`` random rows."""
    gen = torch.Generator().manual_seed(0)
    L0 = layers[0]
    x = torch.randn(rows, L0.qkv_w.shape[1], generator=gen)
    att = torch.randn(rows, L0.o_w.shape[1], generator=gen)
    inner = torch.randn(rows, L0.down.shape[1], generator=gen)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for L in layers:
            run(L, x, att, inner)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def choose_linear(layers: list, dnn, rows: int) -> str:
    """Returns "onednn" or "mkl" for these layers: whichever ran a decode step's products faster here
    (alternating, best of two each; oneDNN on a tie within 3 %). ``layers`` carry both the
    [out, in] weights oneDNN reads and the [in, out] copies MKL streams."""
    L0 = layers[0]
    key = (
        len(layers),
        tuple(L0.qkv_w.shape),
        tuple(L0.gate_up.shape),
        tuple(L0.down.shape),
        rows,
        torch.get_num_threads(),
    )
    if key in _LINEAR_CHOICE:
        return _LINEAR_CHOICE[key]

    def with_dnn(L, x, att, inner):
        dnn(x, L.qkv_w, L.qkv_b, "none", [], "")
        dnn(att, L.o_w, None, "none", [], "")
        dnn(x, L.gate_up, None, "none", [], "")
        dnn(inner, L.down, None, "none", [], "")

    def with_mkl(L, x, att, inner):
        torch.mm(x, L.qkv_t)
        torch.mm(att, L.o_t)
        torch.mm(x, L.gate_up_t)
        torch.mm(inner, L.down_t)

    t_dnn = t_mkl = float("inf")
    for _ in range(2):
        t_dnn = min(t_dnn, _time_products(layers, with_dnn, rows, reps=1))
        t_mkl = min(t_mkl, _time_products(layers, with_mkl, rows, reps=1))
    choice = "mkl" if t_mkl < 0.97 * t_dnn else "onednn"
    log.info(
        "CPU float32 products of %d rows: oneDNN %.1f ms, MKL %.1f ms a pass: %s",
        rows,
        t_dnn * 1e3,
        t_mkl * 1e3,
        choice,
    )
    _LINEAR_CHOICE[key] = choice
    return choice


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer:
    __slots__ = (
        "ln1",
        "qkv_w",
        "qkv_b",
        "qk_norm",
        "o_w",
        "ln2",
        "gate_up",
        "down",
        "qkv_t",
        "o_t",
        "gate_up_t",
        "down_t",
        "dnn",
    )


class SlotDecoder:
    """Prefill and single-token decode steps for a batch of cache slots.

    ``capacity`` is the longest sequence (prompt + completion) a slot holds; ``slots`` how many
    sequences are cached at once. The caller assigns slots and tracks lengths (`inference/batch.py`).
    """

    def __init__(self, model, *, slots: int, capacity: int):
        why = supports(model)
        if why is not None:
            raise ValueError(
                f"the built-in decoder cannot run this model: {why}; the generic engine "
                "(build_engine(..., kind='hf'), inference/sampler.py) runs any causal LM through its own forward"
            )
        cfg = model.config
        self.model = model
        self.base = model.base_model
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        base = getattr(cfg, "rope_theta", None)
        if base is None:  # transformers 5 keeps it under rope_parameters
            base = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        dim = self.head_dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=self.device) / dim))
        self.slots, self.capacity = slots, capacity
        # Rotary tables for every position a slot can hold, computed as Hugging Face does.
        self.cos, self.sin = self._rope(torch.arange(capacity, device=self.device))  # [capacity, D]
        self._rows = torch.arange(slots, device=self.device)
        self._positions = torch.arange(capacity, device=self.device)
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        n = cfg.num_hidden_layers
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)]
        self._stamp = None
        self._layers: list[_Layer] = []
        #: How the layers' products run once the weights are fused: "onednn" or "mkl"
        #: (`choose_linear`; `LINEAR_ENV` overrides). The head runs on oneDNN wherever it exists
        #: (faster on both machine kinds measured) unless `LINEAR_ENV` says "mkl".
        self._linear_setting = linear_setting()
        self.linear = self._linear_setting
        # A float32 CPU decode step's attention in C, one pass over each row's own keys and
        # values (`inference/native.py`), where it builds here; torch's kernels otherwise.
        group_ok = self.heads % self.kv_heads == 0 and native.supported(self.heads // self.kv_heads, self.head_dim)
        fp32_cpu = self.dtype == torch.float32 and self.device.type == "cpu"
        self._native = native.decode_attention_lib() if fp32_cpu and group_ok else None
        self._fuse()

    # -- weights -----------------------------------------------------------------------------

    def _weights_stamp(self) -> tuple:
        # Tensor._version counts in-place writes (load_state_dict copies in place), so fused
        # copies are rebuilt when the policy's weights change under the same module.
        return tuple((id(t), t._version) for t in self.model.parameters())

    def _fuse(self) -> None:
        """Per layer, the q/k/v and gate/up projections as single matrices (one matmul each)."""
        stamp = self._weights_stamp()
        if stamp == self._stamp:
            return
        # oneDNN or MKL for the large float32 products on a CPU (`choose_linear`); MKL otherwise.
        fp32_cpu = self.dtype == torch.float32 and self.device.type == "cpu"
        dnn = onednn_linear() if fp32_cpu and self._linear_setting != "mkl" else None
        layers = []
        for layer in self.base.layers:
            a, m = layer.self_attn, layer.mlp
            L = _Layer()
            L.ln1, L.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            L.o_w = a.o_proj.weight.detach()
            L.qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach()
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            L.qkv_b = torch.cat(biases, 0).detach() if all(b is not None for b in biases) else None
            L.qk_norm = None
            if getattr(a, "q_norm", None) is not None:  # Qwen3: [heads + kv_heads, head_dim], queries first
                q_n = a.q_norm.weight.detach().expand(self.heads, self.head_dim)
                k_n = a.k_norm.weight.detach().expand(self.kv_heads, self.head_dim)
                L.qk_norm = torch.cat([q_n, k_n], 0)
            L.gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).detach()
            L.down = m.down_proj.weight.detach()
            L.dnn = dnn is not None and L.o_w.numel() >= ONEDNN_MIN_WEIGHT
            if fp32_cpu and (not L.dnn or self.linear != "onednn"):
                # Decode steps multiply [B, in] by [in, out]: with the weight stored that way
                # round (contiguous), MKL streams it ~15% faster than through a transposed view
                # once the weights no longer fit the CPU's caches (a 30M model's decode step).
                L.qkv_t, L.gate_up_t = L.qkv_w.t().contiguous(), L.gate_up.t().contiguous()
                L.o_t, L.down_t = L.o_w.detach().t().contiguous(), L.down.detach().t().contiguous()
            elif L.dnn:  # oneDNN reads the [out, in] weights as they are: no transposed copies
                L.qkv_t = L.gate_up_t = L.o_t = L.down_t = None
            else:
                L.qkv_t, L.gate_up_t, L.o_t, L.down_t = L.qkv_w.t(), L.gate_up.t(), L.o_w.t(), L.down.t()
            layers.append(L)
        big = [L for L in layers if L.dnn]
        if self.linear == "auto":  # decided once; later versions of the weights keep the choice
            self.linear = choose_linear(big, dnn, min(self.slots, 64)) if big else "mkl"
        for L in layers:
            if self.linear == "mkl":
                L.dnn = False
            elif L.dnn:
                L.qkv_t = L.gate_up_t = L.o_t = L.down_t = None  # the probe's copies, not needed
        self._layers = layers
        self._embed = self.base.embed_tokens.weight
        self._norm = self.base.norm.weight
        head = self.model.get_output_embeddings()
        self._head, self._head_bias = head.weight.detach(), getattr(head, "bias", None)
        self._dnn_head = dnn if dnn is not None and self._head.numel() >= ONEDNN_MIN_WEIGHT else None
        self._dnn = dnn
        self._stamp = stamp

    def refresh(self) -> None:
        """Pick up weights changed in place since the last call (cheap when nothing changed)."""
        self._fuse()

    # -- pieces ------------------------------------------------------------------------------

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].to(torch.float32) * self.inv_freq  # [..., dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _linear(self, L: _Layer, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        if L.dnn:
            return self._dnn(x, w, b, "none", [], "")
        return torch.nn.functional.linear(x, w, b)

    def _qkv(self, L: _Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv = self._linear(L, x, L.qkv_w, L.qkv_b)
        hq, hk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return qkv[..., :hq], qkv[..., hq : hq + hk], qkv[..., hq + hk :]

    def _mlp(self, L: _Layer, x: Tensor) -> Tensor:
        gate_up = self._linear(L, x, L.gate_up)
        if self._native is not None:  # one pass instead of silu, then a product (native.py)
            return self._linear(L, native.silu_mul(self._native, gate_up), L.down)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._linear(L, torch.nn.functional.silu(gate) * up, L.down)

    def _norm_rows(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm of rows of hidden states: the C kernel where it is loaded (one pass over the
        rows where torch's fused form makes several), `_rms_norm` otherwise."""
        if self._native is not None:
            return native.rms_norm(self._native, x, weight, self.eps)
        return _rms_norm(x, weight, self.eps)

    def logits(self, hidden: Tensor) -> Tensor:
        if self._dnn_head is not None:
            return self._dnn_head(hidden.contiguous(), self._head, self._head_bias, "none", [], "")
        return torch.nn.functional.linear(hidden, self._head, self._head_bias)

    # -- prefill -----------------------------------------------------------------------------

    #: Tokens per block of the prefill's MLP (see `prefill`).
    PREFILL_BLOCK = 1024

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: Tensor) -> Tensor:
        """Run ``prompts`` from position 0, write their keys/values into ``slots`` (one slot per
        prompt, [N] long), and return the final-norm hidden state at each prompt's last token
        [N, hidden].

        The prompts are packed end to end, not padded to the longest: every projection and MLP
        runs on exactly the prompts' tokens (GSM8K questions under a chat template range from 68
        to 170 tokens, so padding made a batch's prefill 1.6x the work), and only attention, a
        small share of a prefill, runs prompt by prompt."""
        self._fuse()
        lengths = [len(p) for p in prompts]
        if max(lengths) > self.capacity:
            raise ValueError(f"a prompt of {max(lengths)} tokens does not fit a cache of {self.capacity}")
        total = sum(lengths)
        F = torch.nn.functional
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions = torch.cat([self._positions[:m] for m in lengths])
        if self._native is None:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]
        starts = [0]
        for m in lengths[:-1]:
            starts.append(starts[-1] + m)
        spans = list(zip(slots.tolist(), starts, lengths))
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self._embed)  # [T, H]
        att = torch.empty((total, heads * dim), dtype=self.dtype, device=self.device)
        for li, L in enumerate(self._layers):
            h = self._norm_rows(x, L.ln1)
            q, k, v = self._qkv(L, h)
            q, k = q.view(total, heads, dim), k.view(total, kv, dim)
            if L.qk_norm is not None:  # Qwen3 normalises each head before the rotary embedding
                q = _head_norm(q, L.qk_norm[:heads], self.eps)
                k = _head_norm(k, L.qk_norm[heads:], self.eps)
            if self._native is not None:  # one pass per tensor (native.py) where torch makes five
                q = native.rope(self._native, q, positions, self.cos, self.sin).transpose(0, 1)  # [heads, T, D]
                k = native.rope(self._native, k, positions, self.cos, self.sin).transpose(0, 1)  # [kv, T, D]
            else:
                q = _rotate(q, cos, sin).transpose(0, 1)  # [heads, T, D]
                k = _rotate(k, cos, sin).transpose(0, 1)  # [kv, T, D]
            v = v.reshape(total, kv, dim).transpose(0, 1)
            kc, vc = self.k[li], self.v[li]
            out = att.view(total, heads, dim).transpose(0, 1)  # [heads, T, D], a view of att
            for slot, a, m in spans:
                kc[slot, :, :m] = k[:, a : a + m]
                vc[slot, :, :m] = v[:, a : a + m]
                out[:, a : a + m] = F.scaled_dot_product_attention(
                    q[None, :, a : a + m],
                    k[None, :, a : a + m],
                    v[None, :, a : a + m],
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=heads != kv,
                )[0]
            x = x + self._linear(L, att, L.o_w)
            # The MLP's intermediates by blocks of tokens: 6,568 packed tokens of a 1,536-wide
            # MLP made an 80 MB gate/up product per layer, which malloc maps afresh (and the
            # kernel faults in page by page) at every layer; a block's stay under the threshold
            # below which freed memory is kept (`inference/malloc.py`).
            for a in range(0, total, self.PREFILL_BLOCK):
                x[a : a + self.PREFILL_BLOCK] += self._mlp(L, self._norm_rows(x[a : a + self.PREFILL_BLOCK], L.ln2))
        last = torch.tensor([a + m - 1 for _, a, m in spans], device=self.device)
        return self._norm_rows(x[last], self._norm)

    def grow(self, capacity: int) -> None:
        """Make room for sequences of ``capacity`` tokens, keeping what is cached."""
        if capacity <= self.capacity:
            return
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                new = torch.zeros(
                    (self.slots, self.kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device
                )
                new[:, :, : self.capacity] = old
                cache[i] = new
        self.capacity = capacity
        self.cos, self.sin = self._rope(torch.arange(capacity, device=self.device))
        self._positions = torch.arange(capacity, device=self.device)

    def copy_slots(self, src: Tensor, dst: Tensor, length: int) -> None:
        """Copy the first ``length`` cached positions of slots ``src`` into slots ``dst``."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    # -- decode ------------------------------------------------------------------------------

    #: Rows per attention range at least (below it one range: each range costs three more small
    #: kernels per layer), and at most this many ranges.
    CHUNK_ROWS, MAX_CHUNKS = 8, 4

    def _row_chunks(self, lengths: Tensor, b: int, span: int) -> list[tuple[int, int, int]]:
        """(first row, end row, span) of the ranges attention runs over: up to MAX_CHUNKS
        contiguous ranges of at least CHUNK_ROWS rows, each as long as its longest row."""
        n = min(self.MAX_CHUNKS, b // self.CHUNK_ROWS)
        if n <= 1:
            return [(0, b, span)]
        lens = lengths.tolist()
        bounds = [round(i * b / n) for i in range(n + 1)]
        chunks = [(r0, r1, max(lens[r0:r1]) + 1) for r0, r1 in zip(bounds, bounds[1:])]
        if sum((r1 - r0) * sp for r0, r1, sp in chunks) > 0.9 * b * span:
            return [(0, b, span)]  # lengths alike: the extra kernels would cost more than they save
        return chunks

    @torch.inference_mode()
    def decode(self, tokens: Tensor, lengths: Tensor, span: int | None = None) -> Tensor:
        """One step for slots 0..B-1: ``tokens`` [B] sit at positions ``lengths`` [B] (the
        tokens already cached per slot). Writes their keys/values and returns the final-norm
        hidden state [B, hidden] (the next token's logits come from it). ``span``, max(lengths)
        + 1, saves a device sync when the caller knows it."""
        b = tokens.shape[0]
        span = int(lengths.max()) + 1 if span is None else span
        if span > self.capacity:
            raise ValueError(f"a sequence of {span} tokens does not fit a cache of {self.capacity}")
        if self._native is not None and self.dtype == torch.float32:
            return self._decode_native(tokens, lengths)
        # At the sizes a CPU run decodes, a step costs kernel launches and Python more than
        # arithmetic: locals instead of attribute lookups, fused ops where torch has them.
        F = torch.nn.functional
        heads, kv, dim, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        group, fp32 = heads // kv, self.dtype == torch.float32
        rows = self._rows[:b]
        cos, sin = self.cos[lengths].unsqueeze(1), self.sin[lengths].unsqueeze(1)  # [B, 1, D]: all heads
        # Keys at positions <= length are real for each slot; later ones are stale or empty.
        future = self._positions[:span] > lengths[:, None]  # [B, S]
        if fp32:
            # Attention reads every cached key up to the span, and at a decode step that read is
            # most of attention's time. One span for the whole batch makes a short row read as
            # far as the longest (GSM8K prompts of 68-170 tokens: ~1.4x the keys). Contiguous
            # row ranges with their own spans cut that where lengths differ; BatchEngine admits
            # rows sorted by prompt length, so neighbours are alike.
            parts = []
            for r0, r1, sp in self._row_chunks(lengths, b, span):
                bias = torch.zeros(((r1 - r0) * kv, 1, sp), dtype=torch.float32, device=self.device)
                bias.masked_fill_(future[r0:r1, :sp].repeat_interleave(kv, 0).unsqueeze(1), float("-inf"))
                parts.append((r0 * kv, r1 * kv, r0, r1, sp, bias))
        elif not fp32:
            keep = ~future[:, None, None, :]  # [B, 1, 1, S]
        x = F.embedding(tokens, self._embed)  # [B, H]
        width = (heads + kv) * dim
        dnn = self._dnn
        for L, kc, vc in zip(self._layers, self.k, self.v):
            if fp32 and L.dnn:
                h = F.rms_norm(x, (x.shape[-1],), L.ln1, eps)
                qkv = dnn(h, L.qkv_w, L.qkv_b, "none", [], "")
            elif fp32:
                h = F.rms_norm(x, (x.shape[-1],), L.ln1, eps)
                qkv = torch.mm(h, L.qkv_t) if L.qkv_b is None else torch.addmm(L.qkv_b, h, L.qkv_t)
            else:
                qkv = F.linear(_rms_norm(x, L.ln1, eps), L.qkv_w, L.qkv_b)
            qk = qkv[:, :width].view(b, heads + kv, dim)
            if L.qk_norm is not None:  # Qwen3: each query and key head normalised, then rotated
                qk = _head_norm(qk, L.qk_norm, eps)
            half = dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin  # rotary, queries and keys at once
            kc[rows, :, lengths] = qk[:, heads:]
            vc[rows, :, lengths] = qkv[:, width:].view(b, kv, dim)
            if fp32:
                # Grouped-query attention without repeating keys: the `group` query heads sharing
                # a key head are the rows of one small matmul, [B*KV, G, D] x [B*KV, D, S]; the
                # residual adds ride on the matrix products (addmm). float32 rounding makes these
                # reorderings invisible to the validator (docs/validation.md).
                q = qk[:, :heads].reshape(b * kv, group, dim)
                att = torch.empty((b * kv, group, dim), dtype=x.dtype, device=self.device)
                for q0, q1, r0, r1, sp, bias in parts:
                    keys = kc[r0:r1, :, :sp].reshape(q1 - q0, sp, dim)
                    probs = torch.baddbmm(bias, q[q0:q1], keys.transpose(1, 2), alpha=self.scale).softmax(-1)
                    torch.bmm(probs, vc[r0:r1, :, :sp].reshape(q1 - q0, sp, dim), out=att[q0:q1])
                att = att.view(b, heads * dim)
            if fp32:
                if L.dnn:
                    x = x + dnn(att, L.o_w, None, "none", [], "")
                    h = F.rms_norm(x, (x.shape[-1],), L.ln2, eps)
                    gate, up = dnn(h, L.gate_up, None, "none", [], "").chunk(2, dim=-1)
                    x = x + dnn(F.silu(gate) * up, L.down, None, "none", [], "")
                else:
                    x = torch.addmm(x, att, L.o_t)
                    h = F.rms_norm(x, (x.shape[-1],), L.ln2, eps)
                    gate, up = torch.mm(h, L.gate_up_t).chunk(2, dim=-1)
                    x = torch.addmm(x, F.silu(gate) * up, L.down_t)
            else:
                # Lower precisions round after every op, so the order is Hugging Face's exactly
                # (the same attention kernel as the validator's prefill, separate residual adds):
                # fusing them moved honest bf16 work past the validator's bf16 group threshold.
                att = F.scaled_dot_product_attention(
                    qk[:, :heads].unsqueeze(2),
                    kc[:b, :, :span],
                    vc[:b, :, :span],
                    attn_mask=keep,
                    scale=self.scale,
                    enable_gqa=heads != kv,
                )
                x = x + F.linear(att.reshape(b, heads * dim), L.o_w)
                h = _rms_norm(x, L.ln2, eps)
                gate, up = F.linear(h, L.gate_up).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, L.down)
        return _rms_norm(x, self._norm, self.eps)

    def _decode_native(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """`decode` for a float32 CPU model with the C kernels (`inference/native.py`): per layer
        the norms, the rotary embedding with the cache writes and attention, and the MLP's
        activation are one C call each, the products torch's (oneDNN or MKL, `choose_linear`). At
        64 rows a torch op costs ~10-30 us of dispatch and threading whatever its size, and the
        torch path runs ~20 of them per layer besides the products. Each row reads only its own
        cached positions, so no mask is built. The same arithmetic as the torch path to float32
        rounding (tests/integration/test_native_attention.py)."""
        F = torch.nn.functional
        lib, eps, dnn = self._native, self.eps, self._dnn
        b, heads, kv, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        width = (heads + kv) * dim
        lengths = lengths.to(torch.int64).contiguous()
        x = F.embedding(tokens, self._embed)  # [B, H]
        att = torch.empty((b, heads * dim), dtype=x.dtype, device=self.device)
        for L, kc, vc in zip(self._layers, self.k, self.v):
            h = native.rms_norm(lib, x, L.ln1, eps)
            if L.dnn:
                qkv = dnn(h, L.qkv_w, L.qkv_b, "none", [], "")
            else:
                qkv = torch.mm(h, L.qkv_t) if L.qkv_b is None else torch.addmm(L.qkv_b, h, L.qkv_t)
            qk = qkv[:, :width].view(b, heads + kv, dim)
            if L.qk_norm is not None:  # Qwen3: each query and key head normalised before rotation
                qk = _head_norm(qk, L.qk_norm, eps).contiguous()
            v_new = qkv[:, width:].view(b, kv, dim)
            native.decode_rope_attention(lib, qk, v_new, self.cos, self.sin, kc, vc, lengths, att, self.scale)
            if L.dnn:
                x = x + dnn(att, L.o_w, None, "none", [], "")
                gate_up = dnn(native.rms_norm(lib, x, L.ln2, eps), L.gate_up, None, "none", [], "")
                x = x + dnn(native.silu_mul(lib, gate_up), L.down, None, "none", [], "")
            else:
                x = torch.addmm(x, att, L.o_t)
                gate_up = torch.mm(native.rms_norm(lib, x, L.ln2, eps), L.gate_up_t)
                x = torch.addmm(x, native.silu_mul(lib, gate_up), L.down_t)
        return native.rms_norm(lib, x, self._norm, eps)
