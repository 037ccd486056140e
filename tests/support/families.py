"""The model families the built-in decoder claims, as randomly initialised models with real
checkpoints' layer shapes (see tests/unit/test_model_families.py for why each), and the check of a
decoder's prefill and decode steps against transformers' own forward. The unit tier runs it on
torch's kernels; tests/integration/test_native_attention.py on the C decode attention."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 2048


class Shape(NamedTuple):
    """A family's layer shapes (two layers of them) and its other settings."""

    model: type
    config: type
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int | None  # None: hidden // heads, the family's own default
    intermediate: int
    tied: bool
    rope_theta: float
    eps: float

    def build(self):
        extra = {} if self.head_dim is None else {"head_dim": self.head_dim}
        return self.model(
            self.config(
                vocab_size=VOCAB,
                hidden_size=self.hidden,
                num_attention_heads=self.heads,
                num_key_value_heads=self.kv_heads,
                **extra,
                intermediate_size=self.intermediate,
                num_hidden_layers=2,
                tie_word_embeddings=self.tied,
                rope_theta=self.rope_theta,
                rms_norm_eps=self.eps,
            )
        )


# The layers of Qwen2.5-0.5B, Qwen3-0.6B and SmolLM2-135M (tests/unit/test_model_families.py says why).
FAMILIES = {
    "qwen2": Shape(Qwen2ForCausalLM, Qwen2Config, 896, 14, 2, None, 4864, False, 1e6, 1e-6).build,
    "qwen3": Shape(Qwen3ForCausalLM, Qwen3Config, 1024, 16, 8, 128, 3072, True, 1e6, 1e-6).build,
    "llama": Shape(LlamaForCausalLM, LlamaConfig, 576, 9, 3, 64, 1536, True, 1e5, 1e-5).build,
}

# Relative to the largest reference value. Both sides compute in float32 (unit roundoff u = 6e-8)
# from the same weights, in different orders: fused q/k/v and gate/up matrices, MKL's blocking for a
# [1, in] decode step vs a [W, in] prefill (it differs between AVX2 and AVX-512 CPUs), and another
# attention kernel. Each reduction of n <= 4864 terms of O(1) inputs (RMSNorm bounds them) then
# differs by about sqrt(n)*u = 4e-6 of its scale, and the ~10 such ops of two layers add up, not
# multiply: 3-8e-6 was measured. 1e-4 leaves >10x for other CPUs, while each mistake this file
# guards against moves values by >1e-1 of scale (measured when written: a Qwen3 head norm without
# its weight 0.27, without the norm 0.52, Qwen2 without its q/k/v biases 1.5).
RTOL_SCALE = 1e-4


def build_family(name: str):
    """The family's model, with norm weights and biases randomised (HF initialises them to 1 and
    0, which would let a decoder that skips a bias or a norm's weight pass)."""
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def close_to(ours, ref, what):
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= RTOL_SCALE * scale, f"{what}: max difference {err:.3g} at scale {scale:.3g}"


def check_steps_against_transformers(name: str, model, decoder) -> None:
    """Prefill two rows of different prompt lengths, decode 8 teacher-forced steps (each row
    masked to its own length), and compare every final hidden state and its logits with
    transformers' forward on the same tokens."""
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (15, 11)]
    prompt_lengths, steps = [7, 3], 8
    hidden = [[h] for h in decoder.prefill([s[:n] for s, n in zip(sequences, prompt_lengths)], torch.tensor([0, 1]))]
    lengths = torch.tensor(prompt_lengths)
    for _ in range(steps):  # teacher-forced: the next token of each sequence, not a sampled one
        tokens = torch.tensor([s[n] for s, n in zip(sequences, lengths.tolist())])
        for row, h in zip(hidden, decoder.decode(tokens, lengths)):
            row.append(h)
        lengths += 1
    for seq, n, row in zip(sequences, prompt_lengths, hidden):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq[: n + steps]]), output_hidden_states=True)
        ours = torch.stack(row)  # the state behind each of the next steps + 1 tokens
        close_to(ours, out.hidden_states[-1][0, n - 1 :], f"{name} final hidden states")
        close_to(decoder.logits(ours), out.logits[0, n - 1 :], f"{name} logits")
