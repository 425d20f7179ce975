"""Demonstrations for SFT: JSONL of chat messages -> token batches with the assistant's tokens masked in.

A line is {"messages": [{"role": ..., "content": ...}, ...]}; every assistant message is a
target (loss mask 1), everything else is context. Tokens come from the same chat template
the rollout uses, so SFT and RL see identical formats.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from arlo.model.tokenizer import ByteTokenizer
from arlo.proto.v1 import common_pb2

_DATA = Path(__file__).resolve().parents[2] / "arlo" / "data"
BUILTIN = {"builtin:arith": _DATA / "arith_sft.jsonl",
           # The demo's: made by the arith env's own (imperfect) demonstrator, scripts/gen_demos.py.
           "builtin:arith_tool": _DATA / "arith_tool_sft.jsonl"}


def load_demonstrations(source: str) -> list[list[tuple[str, str]]]:
    path = BUILTIN.get(source, Path(source))
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


def demonstration_trajectory(messages: list[tuple[str, str]], tok: ByteTokenizer, idx: int) -> common_pb2.Trajectory:
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
    return common_pb2.Trajectory(id=f"sft-{idx}", group_id=f"sft-{idx}", group_size=1, token_ids=ids,
                                 logprobs=[0.0] * len(ids), loss_mask=mask, policy_versions=[-1] * len(ids))


def demonstration_batches(demos: list[list[tuple[str, str]]], tok: ByteTokenizer, batch_size: int,
                          seed: int = 0) -> Iterator[list[list[common_pb2.Trajectory]]]:
    """Endless shuffled batches, each a list of one-trajectory groups (the batch builder's shape)."""
    rng = random.Random(seed)
    order = list(range(len(demos)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [[demonstration_trajectory(demos[i], tok, i)] for i in order[start:start + batch_size]]
