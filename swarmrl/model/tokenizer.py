"""A byte-level tokenizer the project builds itself (no download, ever).

The tiny default model reads and writes arithmetic, so one token per byte keeps the vocabulary
at 261 entries and makes "length in tokens" easy to reason about. It is a byte-level BPE with no
merges: exactly the pipeline of Qwen2's own tokenizer (regex split, byte-level alphabet, BPE),
which matters because transformers 5 rebuilds any `qwen2` checkpoint's tokenizer with that
pipeline. A character-level WordLevel tokenizer silently lost every space after a reload. The reasoning
markers are single tokens so the model never has to spell them. The result is a normal
`PreTrainedTokenizerFast` saved in a Hugging Face folder, with a ChatML chat template, so any
HF tool (and vLLM) can load it.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Added as single tokens; "\boxed{" is kept as characters on purpose so nothing about the
# answer format is special-cased in the vocabulary.
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, THINK_OPEN, THINK_CLOSE]

# ChatML, the format of Qwen2 chat models, so the project's checkpoints behave like theirs.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Special tokens first (ids 0-4), then the 256 byte-level symbols in byte order."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, THINK_OPEN, THINK_CLOSE],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(symbol: str) -> int:
    """The byte a byte-level symbol stands for (GPT-2's printable remapping of 0-255)."""
    cp = ord(symbol)
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if cp in printable:
        return cp
    return [b for b in range(256) if b not in printable][cp - 256]


def decode_completion(tokenizer, token_ids: list[int], stop_token_ids: list[int]) -> str:
    """A completion's text: special tokens kept, the stop token that ended it dropped."""
    if token_ids and token_ids[-1] in stop_token_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)
