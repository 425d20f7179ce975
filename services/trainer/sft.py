"""Demonstrations for SFT: JSONL of chat messages -> token batches with the assistant's tokens masked in.

A line is {"messages": [{"role": ..., "content": ...}, ...]}; every assistant message is a
target (loss mask 1), everything else is context. Tokens come from the same chat template
the rollout uses, so SFT and RL see identical formats. A batch holds what the SFT step reads
(tokens and loss mask), nothing of RL's (no sampler logprobs, rewards or groups).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np

from arlo.data import resource
from arlo.model.tokenizer import ByteTokenizer
from services.trainer.batching import bucket_length

BUILTIN = {"builtin:arith": "arith_sft.jsonl",
           # The demo's: made by the arith env's own (imperfect) demonstrator, scripts/gen_demos.py.
           "builtin:arith_tool": "arith_tool_sft.jsonl"}

Messages = list[tuple[str, str]]


@dataclass(frozen=True, kw_only=True, slots=True)
class SFTBatch:
    """A right-padded batch; token t of row b is predicted from tokens < t, and counts where mask is 1."""

    tokens_bt: np.ndarray  # int32
    mask_bt: np.ndarray  # float32, 1 on the demonstrated (assistant) tokens
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized demonstration."""

    token_ids: list[int]
    loss_mask: list[int]


def load_demonstrations(source: str) -> list[Messages]:
    path: Traversable = resource(BUILTIN[source]) if source in BUILTIN else Path(source)
    if not path.is_file():
        raise ValueError(f"SFT data not found: {source!r} (a JSONL path or one of {sorted(BUILTIN)})")
    demos = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = [(m["role"], m["content"]) for m in json.loads(line)["messages"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: expected {{\"messages\": [{{role, content}}, ...]}}: {e}") from e
        if not any(role == "assistant" for role, _ in messages):
            raise ValueError(f"{path}:{lineno}: no assistant message to learn from")
        demos.append(messages)
    if not demos:
        raise ValueError(f"{path}: no demonstrations")
    return demos


def tokenize_demonstration(messages: Messages, tok: ByteTokenizer) -> Example:
    """Token-aligned like a rollout trajectory: assistant turns (and their end token) are targets."""
    ids: list[int] = tok.encode_messages([], add_generation_prompt=False, add_bos=True)
    mask: list[int] = [0] * len(ids)
    for role, content in messages:
        if role == "assistant":
            head = tok.encode_messages([], add_generation_prompt=True, add_bos=False)
            body = tok.encode(content) + [tok.eos_id]
            ids += head + body
            mask += [0] * len(head) + [1] * len(body)
        else:
            piece = tok.encode_messages([(role, content)], add_generation_prompt=False, add_bos=False)
            ids += piece
            mask += [0] * len(piece)
    return Example(token_ids=ids, loss_mask=mask)


def sft_batch(examples: Sequence[Example], max_seq_len: int, pad_id: int) -> SFTBatch:
    """Right-pads to a power-of-two length (RL batches' rule: few compiled steps); longer
    sequences than the model's context are cut."""
    longest = min(max(len(e.token_ids) for e in examples), max_seq_len)
    length = min(bucket_length(longest), max_seq_len)
    tokens = np.full((len(examples), length), pad_id, np.int32)
    mask = np.zeros((len(examples), length), np.float32)
    for row, e in enumerate(examples):
        n = min(len(e.token_ids), length)
        tokens[row, :n] = e.token_ids[:n]
        mask[row, :n] = e.loss_mask[:n]
    return SFTBatch(tokens_bt=tokens, mask_bt=mask, num_tokens=int(mask.sum()))


def demonstration_batches(demos: list[Messages], tok: ByteTokenizer, batch_size: int, *, max_seq_len: int,
                          seed: int = 0) -> Iterator[SFTBatch]:
    """Endless shuffled batches; each demonstration is tokenized once."""
    examples = [tokenize_demonstration(d, tok) for d in demos]
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield sft_batch([examples[i] for i in order[start:start + batch_size]], max_seq_len, tok.pad_id)
