"""Tests for swarmrl.model.tokenizer: byte-level ids, special tokens, and surviving a
save/reload through transformers (which rebuilds a qwen2 folder's tokenizer its own way)."""

from __future__ import annotations

import pytest

from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy
from swarmrl.model.tokenizer import (
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    THINK_CLOSE,
    THINK_OPEN,
    build_char_tokenizer,
)

TEXTS = [
    "Compute 12 + 34.",
    "  leading and  double  spaces, trailing ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "<think>2+4=6\n1+3=4</think>\n\\boxed{46}",
    "unicode: héllo naïve 日本語 ☃ 🙂 – em—dash",
    "Think for 64 tokens before giving a response.",
    "",
    " ",
]
MESSAGES = [{"role": "user", "content": "Compute 12 - 34.  Think for 48 tokens before giving a response."}]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def reloaded(tok, tmp_path_factory):
    model, _ = build_tiny_policy(
        hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, max_positions=64
    )
    path = save_policy(model, tok, tmp_path_factory.mktemp("policy") / "v0")
    _, loaded = load_policy(path)
    return loaded


def test_vocabulary_layout(tok):
    assert len(tok) == 256 + len(SPECIAL_TOKENS) == 261
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert tok.pad_token == PAD and tok.pad_token_id == 0
    assert tok.eos_token == IM_END and tok.eos_token_id == 2


def test_one_token_per_ascii_byte(tok):
    seen = set()
    for b in range(128):
        out = ids(tok, chr(b))
        assert len(out) == 1, (b, out)
        seen.add(out[0])
        assert tok.decode(out) == chr(b)
    assert len(seen) == 128 and not seen & set(range(len(SPECIAL_TOKENS)))
    text = "12 + 34 = 46\n"
    assert len(ids(tok, text)) == len(text)


def test_non_ascii_is_one_token_per_utf8_byte(tok):
    for text in ["é", "日本", "🙂"]:
        assert len(ids(tok, text)) == len(text.encode("utf-8"))


@pytest.mark.parametrize("special", SPECIAL_TOKENS)
def test_special_tokens_are_single_ids(tok, special):
    assert ids(tok, special) == [SPECIAL_TOKENS.index(special)]
    # Also inside text, without spaces around them.
    out = ids(tok, f"a{special}b")
    assert out == [ids(tok, "a")[0], SPECIAL_TOKENS.index(special), ids(tok, "b")[0]]


def test_boxed_is_not_special(tok):
    assert len(ids(tok, "\\boxed{")) == len("\\boxed{")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(ids(tok, text)) == text


def test_chat_template(tok):
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == f"{IM_START}user\n{MESSAGES[0]['content']}{IM_END}\n{IM_START}assistant\n"
    no_gen = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert prompt.startswith(no_gen) and not no_gen.endswith("assistant\n")


@pytest.mark.parametrize("text", TEXTS + [f"{IM_START}user\nhi{IM_END}\n{THINK_OPEN} x {THINK_CLOSE}{PAD}"])
def test_reloaded_tokenizer_encodes_identically(tok, reloaded, text):
    assert ids(reloaded, text) == ids(tok, text)
    assert reloaded.decode(ids(reloaded, text)) == text


def test_reloaded_tokenizer_keeps_vocab_and_specials(tok, reloaded):
    assert len(reloaded) == len(tok)
    assert reloaded.convert_tokens_to_ids(SPECIAL_TOKENS) == tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert reloaded.pad_token_id == tok.pad_token_id
    assert reloaded.eos_token_id == tok.eos_token_id
    # Whatever class transformers picks, it must not add a BOS or anything else by default.
    assert reloaded("12+34")["input_ids"] == tok("12+34")["input_ids"] == ids(tok, "12+34")
    assert reloaded.decode(ids(tok, "a b"), skip_special_tokens=True) == "a b"


def test_reloaded_chat_template_renders_the_same(tok, reloaded):
    for add in (True, False):
        a = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        b = reloaded.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert a == b
        assert ids(reloaded, b) == ids(tok, a)
