"""The byte tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json), for export.

A policy trained with the byte-level presets leaves arlo as an ordinary HF directory:
`transformers.AutoTokenizer.from_pretrained` encodes text to the same ids as
`ByteTokenizer.encode` (ids 0..255 are the UTF-8 bytes, a BPE model with no merges over
GPT-2's byte-to-unicode alphabet), and `apply_chat_template` renders the same ids as
`ByteTokenizer.encode_messages` (the role and end-of-message ids are special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from arlo.model.tokenizer import ASSISTANT, BOS, EOS, PAD, SYSTEM, TOOL, USER

SPECIAL_TOKENS = {PAD: "<|pad|>", BOS: "<|bos|>", EOS: "<|eos|>", SYSTEM: "<|system|>", USER: "<|user|>",
                  ASSISTANT: "<|assistant|>", TOOL: "<|tool|>"}
# ByteTokenizer.encode_messages: [BOS] (ROLE content EOS)* [ASSISTANT].
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """A `tokenizers` Tokenizer with ByteTokenizer's ids."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    by_byte = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(by_byte.values())
    vocab = {by_byte[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    for token_id in sorted(SPECIAL_TOKENS):
        added = tok.add_special_tokens([AddedToken(SPECIAL_TOKENS[token_id], special=True, normalized=False)])
        assert added == 1 and tok.token_to_id(SPECIAL_TOKENS[token_id]) == token_id
    return tok


def write_byte_tokenizer(out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) into `out`."""
    byte_tokenizer().save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS], "eos_token": SPECIAL_TOKENS[EOS], "pad_token": SPECIAL_TOKENS[PAD],
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character table, the alphabet of ByteLevel.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
