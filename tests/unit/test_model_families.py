"""The built-in decoder on each model family it claims (`inference/decoder.py`), against transformers.

No Qwen3 checkpoint (nor a Qwen2.5 one) is available here, so each family is a randomly initialised
model with a real checkpoint's layer shapes at 2 layers and a 2048-token vocabulary:

- qwen2: Qwen2.5-0.5B's layer (hidden 896, 14 heads / 2 KV heads, MLP 4864, q/k/v biases), with an
  untied lm_head (as Qwen2.5-7B has) so the separate head is the one used;
- qwen3: Qwen3-0.6B's (hidden 1024, 16 heads / 8 KV heads of head_dim 128, so 2048 != hidden, MLP
  3072, q_norm/k_norm, no biases, tied embeddings);
- llama: SmolLM2-135M's (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, tied embeddings).

HF initialises norm weights to 1 and biases to 0, which would let a decoder that skips a bias or a
norm's weight pass; both are randomised here. Each family is checked two ways: the decoder's
prefill and decode steps against transformers' own forward on the same tokens (logits and
final-layer hidden states), and the "builtin" engine against the generic "hf" one under the seeded
scheme (the same tokens; what a validator replays).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from families import FAMILIES, VOCAB, build_family, check_steps_against_transformers, close_to
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from swarmrl.inference.batch import BatchEngine
from swarmrl.inference.decoder import LINEAR_ENV, SlotDecoder, onednn_linear, supports
from swarmrl.inference.engine import build_engine
from swarmrl.inference.sampler import Sampler


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, build_family(request.param)


def test_the_family_has_the_shape_it_stands_for(family):
    # Guards the test itself: each family must exercise the feature it is here for.
    name, model = family
    assert supports(model) is None
    attn = model.model.layers[0].self_attn
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if name == "qwen2":
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None and not tied
    if name == "qwen3":
        assert attn.q_norm is not None and attn.q_proj.bias is None and tied
        assert model.config.num_attention_heads * model.config.head_dim != model.config.hidden_size
    if name == "llama":
        assert attn.q_proj.bias is None and tied


@pytest.mark.parametrize("linear", ["onednn", "mkl"])
def test_prefill_and_decode_steps_match_transformers_forward(family, linear, monkeypatch):
    # Both libraries a CPU decoder may choose for its products (`choose_linear`) are compared.
    monkeypatch.setenv(LINEAR_ENV, linear)
    name, model = family
    decoder = SlotDecoder(model, slots=2, capacity=16)
    if linear == "onednn" and onednn_linear() is not None and next(model.parameters()).dtype == torch.float32:
        # These shapes are past ONEDNN_MIN_WEIGHT: the comparison below is of oneDNN's products
        # (what a real checkpoint decodes with on an x86 CPU where oneDNN measures faster).
        assert all(layer.dnn for layer in decoder._layers) and decoder._dnn_head is not None, name
    if linear == "mkl":
        assert not any(layer.dnn for layer in decoder._layers) and decoder._dnn_head is None, name
    check_steps_against_transformers(name, model, decoder)


def test_builtin_and_generic_engines_draw_the_same_seeded_tokens(family):
    name, model = family
    never = SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0)  # no row stops early
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 2, 5)]
    prompts[3] = prompts[0]  # a shared prompt: prefilled once, its cache copied
    seeds = [11, 12, 13, 14]
    # 3 slots for 4 rows, so a slot is refilled mid-generation.
    builtin = build_engine(model, never, kind="builtin", max_batch=3)
    assert isinstance(builtin, BatchEngine), f"{name} fell back to the generic engine: {supports(model)}"
    generic = build_engine(model, never, kind="hf")
    assert isinstance(generic, Sampler)
    for temperature in (1.0, 0.7):
        ours = builtin.generate(prompts, seeds, max_new_tokens=8, temperature=temperature, return_hidden=True)
        theirs = generic.generate(prompts, seeds, max_new_tokens=8, temperature=temperature, return_hidden=True)
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, f"{name} at T={temperature}"
            close_to(a.hidden, b.hidden, f"{name} hidden states")
            close_to(torch.tensor(a.logprobs), torch.tensor(b.logprobs), f"{name} logprobs")
        assert ours[0].token_ids != ours[3].token_ids  # same prompt, other seed: another sample


def _tiny(cls, config_cls, **kw):
    shape = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    return cls(config_cls(num_hidden_layers=1, **shape, **kw)).eval()


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: _tiny(LlamaForCausalLM, LlamaConfig, attention_bias=True), "attention output"),
        (lambda: _tiny(LlamaForCausalLM, LlamaConfig, mlp_bias=True), "MLP"),
        (lambda: _tiny(LlamaForCausalLM, LlamaConfig, hidden_act="gelu"), "activation 'gelu'"),
        (
            lambda: _tiny(
                LlamaForCausalLM,
                LlamaConfig,
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            ),
            "rope scaling 'linear'",
        ),
        (lambda: _tiny(Qwen3ForCausalLM, Qwen3Config, use_sliding_window=True, max_window_layers=0), "sliding"),
    ],
)
def test_what_the_decoder_does_not_implement_goes_to_the_generic_engine(build, reason, capsys):
    model = build()
    why = supports(model)
    assert why is not None and reason in why
    with pytest.raises(ValueError, match="kind='hf'"):
        SlotDecoder(model, slots=1, capacity=8)
    tok = SimpleNamespace(eos_token_id=0, pad_token_id=0)
    assert isinstance(build_engine(model, tok), Sampler)  # a fallback, not an error, and said aloud:
    assert reason in capsys.readouterr().err
