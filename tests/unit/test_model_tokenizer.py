"""Byte tokenizer and chat template."""

from __future__ import annotations

import pytest

from arlo.model import get_tokenizer
from arlo.model.tokenizer import ASSISTANT, BOS, EOS, USER
from arlo.proto.v1 import common_pb2

TOK = get_tokenizer("byte")


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld", "数学 = 42", "emoji 🙂\n\ttab"])
def test_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text


def test_decode_skips_specials_and_replaces_bad_utf8() -> None:
    assert TOK.decode([BOS, USER, *TOK.encode("hi"), EOS, 263]) == "hi"
    assert TOK.decode([0xE6, 0x95]) == "\ufffd"  # a truncated multi-byte character


def test_ids_and_vocab() -> None:
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.vocab_size) == (256, 257, 258, 263)
    assert TOK.name == "byte" and TOK.stop_token_ids == [EOS]


def test_template_layout() -> None:
    ids = TOK.encode_messages([("user", "hi")], add_generation_prompt=True, add_bos=True)
    assert ids == [BOS, USER, ord("h"), ord("i"), EOS, ASSISTANT]


def test_incremental_encoding_equals_whole_conversation() -> None:
    """Token-in/token-out rollouts: prompt, model tokens, observation, ... concatenated
    must be exactly the whole conversation's encoding."""
    conversation = [("system", "be brief"), ("user", "2+2?"), ("assistant", "4 ✓"), ("tool", "ok"),
                    ("user", "and 3+3?"), ("assistant", "6")]
    ids = TOK.encode_messages(conversation[:2], add_generation_prompt=True, add_bos=True)
    ids += TOK.encode("4 ✓") + [EOS]  # what the model generates, stop token included
    ids += TOK.encode_messages(conversation[3:5], add_generation_prompt=True, add_bos=False)
    ids += TOK.encode("6") + [EOS]
    whole = TOK.encode_messages(conversation, add_generation_prompt=False, add_bos=True)
    assert ids == whole


def test_accepts_message_objects() -> None:
    messages = [common_pb2.Message(role="user", content="héllo")]
    assert TOK.encode_messages(messages, add_generation_prompt=False, add_bos=False) == \
        TOK.encode_messages([("user", "héllo")], add_generation_prompt=False, add_bos=False)


def test_unknown_role_and_tokenizer() -> None:
    with pytest.raises(ValueError, match=r"messages\[1\].role"):
        TOK.encode_messages([("user", "a"), ("robot", "b")], add_generation_prompt=False, add_bos=True)
    with pytest.raises(ValueError, match="byte"):
        get_tokenizer("sentencepiece")
