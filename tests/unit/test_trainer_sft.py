"""SFT data: built-in demonstrations found through package resources, tokenized into batches
whose loss mask covers exactly the assistant's text and its end token."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from arlo.model import get_tokenizer
from services.trainer.sft import BUILTIN, demonstration_batches, load_demonstrations, tokenize_demonstration

TOK = get_tokenizer("byte")


@pytest.mark.parametrize("source", sorted(BUILTIN))
def test_builtin_data_loads_from_the_package(source: str) -> None:
    demos = load_demonstrations(source)
    assert len(demos) >= 8 and all(any(role == "assistant" for role, _ in d) for d in demos)


def test_the_mask_is_the_assistant_text_and_its_end_token() -> None:
    demo = [("user", "2+3?"), ("assistant", "5"), ("user", "and 4+4?"), ("assistant", "8")]
    ex = tokenize_demonstration(demo, TOK)
    assert len(ex.token_ids) == len(ex.loss_mask)
    targets = [t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if m]
    assert targets == [*TOK.encode("5"), TOK.eos_id, *TOK.encode("8"), TOK.eos_id]
    # Context: everything but the targets is the chat template the rollout encodes.
    assert ex.token_ids[:len(TOK.encode_messages(demo[:1], add_generation_prompt=False, add_bos=True))] == \
        TOK.encode_messages(demo[:1], add_generation_prompt=False, add_bos=True)


def test_batches_are_padded_to_a_bucket_and_cut_at_the_context() -> None:
    demos = load_demonstrations("builtin:arith")
    batch = next(demonstration_batches(demos, TOK, 4, max_seq_len=512))
    assert batch.tokens_bt.shape[0] == 4 and batch.tokens_bt.shape == batch.mask_bt.shape
    length = batch.tokens_bt.shape[1]
    assert length & (length - 1) == 0  # a power of two: few compiled steps
    assert batch.tokens_bt.dtype == np.int32 and batch.mask_bt.dtype == np.float32
    assert batch.num_tokens == int(batch.mask_bt.sum()) > 0
    cut = next(demonstration_batches(demos, TOK, 4, max_seq_len=8))
    assert cut.tokens_bt.shape == (4, 8)
    # Endless and reshuffled: more batches than demonstrations.
    assert len(list(itertools.islice(demonstration_batches(demos, TOK, 4, max_seq_len=512), len(demos)))) == len(demos)


def test_missing_data_names_the_source() -> None:
    with pytest.raises(ValueError, match="SFT data not found: 'nope.jsonl'"):
        load_demonstrations("nope.jsonl")
