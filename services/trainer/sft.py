"""Demonstrations for SFT: JSONL of chat messages -> token batches with the assistant's tokens masked in.

A line is {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}: messages keep
every field the model's chat template reads (an assistant's `tool_calls`, a tool result's
`name` / `tool_call_id`), and the optional `tools` are the OpenAI function schemas the
template lists, as the rollout passes an environment's. Every assistant message is a target
(loss mask 1 on its tokens and its end-of-turn token, not on the role header); everything
else is context. The tokens are built the way the rollout builds a trajectory: the first
prompt, each assistant turn's tokens (tokenizer.assistant_ids) and end token, then the
template's continuation for what follows. So SFT and RL see identical formats, with any
tokenizer (the byte one or a Hugging Face model's template; tests/unit/test_trainer_sft.py
checks the mask against transformers' renderings). A batch holds what the SFT step reads
(tokens and loss mask), nothing of RL's (no sampler logprobs, rewards or groups).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import numpy as np

from arlo.choices import SftTooLong
from arlo.config import ConfigError
from arlo.data import resource
from arlo.jsonfields import loads_bounded
from arlo.model.tokenizer import Tokenizer, message_dict
from arlo.regular_files import read_regular_text
from services.trainer.batching import bucket_length

log = logging.getLogger(__name__)

BUILTIN = {"builtin:arith": "arith_sft.jsonl",
           # The demo's: made by the arith env's own (imperfect) demonstrator, scripts/gen_demos.py.
           "builtin:arith_tool": "arith_tool_sft.jsonl"}

Messages = Sequence[Any]
"""(role, content) pairs or message dicts."""


@dataclass(frozen=True, slots=True)
class Demonstration:
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None


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


def load_demonstrations(source: str) -> list[Demonstration]:
    path: Traversable = resource(BUILTIN[source]) if source in BUILTIN else Path(source)
    if not (path.is_file() if source in BUILTIN else Path(source).exists()):
        raise ValueError(f"SFT data not found: {source!r} (a JSONL path or one of {sorted(BUILTIN)})")
    # A user's path: a regular file only (a named pipe would block the trainer's start).
    text = path.read_text() if source in BUILTIN else read_regular_text(source)
    demos = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            demos.append(_demonstration(loads_bounded(line)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: expected {{\"messages\": [{{role, content}}, ...], "
                             f"\"tools\": [...] (optional)}}: {e}") from e
    if not demos:
        raise ValueError(f"{path}: no demonstrations")
    return demos


def _demonstration(line: Any) -> Demonstration:
    if not isinstance(line, dict) or not isinstance(line.get("messages"), list):
        raise ValueError("a line is a JSON object with a \"messages\" list")
    messages = []
    for i, m in enumerate(line["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: an object with a string \"role\"")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise ValueError(f"messages[{i}].content: a string (null only beside tool_calls)")
        if not isinstance(m.get("tool_calls", []), list):
            raise ValueError(f"messages[{i}].tool_calls: a list")
        messages.append(dict(m))
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message to learn from")
    tools = line.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools: a list of function schemas")
    return Demonstration(messages=tuple(messages), tools=tuple(tools) if tools else None)


def tokenize_demonstration(demo: Demonstration | Messages, tok: Tokenizer) -> Example:
    """Token-aligned like a rollout trajectory: assistant turns (and their end token) are targets,
    the rest is the template's context around them."""
    if isinstance(demo, Demonstration):
        messages, tools = [message_dict(m) for m in demo.messages], demo.tools
    else:
        messages, tools = [message_dict(m) for m in demo], None
    ids: list[int] = []
    mask: list[int] = []
    context: list[dict[str, Any]] = []
    first = True

    def add_context(next_is_assistant: bool) -> None:
        nonlocal first
        piece = tok.encode_messages(context, add_generation_prompt=next_is_assistant, add_bos=first, tools=tools)
        ids.extend(piece)
        mask.extend([0] * len(piece))
        context.clear()
        first = False

    for m in messages:
        if m["role"] != "assistant":
            context.append(m)
            continue
        add_context(True)
        body = tok.assistant_ids(m, tools=tools) + [tok.eos_id]
        ids.extend(body)
        mask.extend([1] * len(body))
    add_context(False)
    return Example(token_ids=ids, loss_mask=mask)


@dataclass(frozen=True, slots=True)
class Fitted:
    """What `fit_examples` did with demonstrations longer than the model's context."""

    examples: list[Example]
    too_long: int
    """Demonstrations longer than max_seq_len tokens."""
    dropped: int
    """Of those, left out: all of them with "drop", those whose kept end holds no assistant token
    with "truncate_left"."""
    longest: int
    """Tokens of the longest demonstration (before any cut)."""


def fit_examples(examples: Sequence[Example], max_seq_len: int, too_long: SftTooLong) -> Fitted:
    """Applies `trainer.sft.too_long` to the demonstrations longer than the context: "error"
    refuses them (a ConfigError), "drop" leaves them out, "truncate_left" keeps their last
    max_seq_len tokens (the later assistant turns; a cut from the right, as before, kept the
    prompt and lost the turns, and a batch of them trained on nothing). Logs a warning when any
    is cut or left out."""
    over = [e for e in examples if len(e.token_ids) > max_seq_len]
    longest = max(len(e.token_ids) for e in examples)
    what = (f"{len(over)} of {len(examples)} demonstrations are longer than model.max_seq_len = {max_seq_len} "
            f"tokens (the longest {longest})")
    if over and too_long == "error":
        raise ConfigError(f"trainer.sft.data: {what}; raise model.max_seq_len, or set trainer.sft.too_long to "
                          "drop or truncate_left")
    kept: list[Example] = []
    for e in examples:
        if len(e.token_ids) > max_seq_len and too_long == "truncate_left":
            e = Example(token_ids=e.token_ids[-max_seq_len:], loss_mask=e.loss_mask[-max_seq_len:])
        if len(e.token_ids) <= max_seq_len and any(e.loss_mask):
            kept.append(e)
    fitted = Fitted(examples=kept, too_long=len(over), dropped=len(examples) - len(kept), longest=longest)
    if over:
        done = (f"{len(over) - fitted.dropped} truncated from the left, {fitted.dropped} left out"
                if too_long == "truncate_left" else "left out")
        log.warning("trainer.sft: %s: %s (trainer.sft.too_long: %s; raise model.max_seq_len to train on them whole)",
                    what, done, too_long, extra={"too_long": fitted.too_long, "dropped": fitted.dropped})
    return fitted


def sft_batch(examples: Sequence[Example], max_seq_len: int, pad_id: int) -> SFTBatch:
    """Right-pads to a power-of-two length (RL batches' rule: few compiled steps); sequences
    longer than the model's context are cut (`fit_examples` decides that first). A batch with
    no assistant token inside the context would train on nothing: a ConfigError."""
    longest = min(max(len(e.token_ids) for e in examples), max_seq_len)
    length = min(bucket_length(longest), max_seq_len)
    tokens = np.full((len(examples), length), pad_id, np.int32)
    mask = np.zeros((len(examples), length), np.float32)
    for row, e in enumerate(examples):
        n = min(len(e.token_ids), length)
        tokens[row, :n] = e.token_ids[:n]
        mask[row, :n] = e.loss_mask[:n]
    if not mask.any():
        raise ConfigError(f"an SFT batch of {len(examples)} demonstrations has 0 loss tokens: every assistant "
                          f"token lies past model.max_seq_len = {max_seq_len}; raise model.max_seq_len")
    return SFTBatch(tokens_bt=tokens, mask_bt=mask, num_tokens=int(mask.sum()))


def demonstration_batches(demos: Sequence[Demonstration | Messages], tok: Tokenizer, batch_size: int, *,
                          max_seq_len: int, seed: int = 0, too_long: SftTooLong = "drop") -> Iterator[SFTBatch]:
    """Endless shuffled batches; each demonstration is tokenized once, then fitted (`fit_examples`)."""
    fitted = fit_examples([tokenize_demonstration(d, tok) for d in demos], max_seq_len, too_long)
    return example_batches(fitted.examples, tok.pad_id, batch_size, max_seq_len=max_seq_len, seed=seed)


def batch_lengths(examples: Sequence[Example], max_seq_len: int) -> list[int]:
    """Every length `sft_batch` can give a batch of these examples: the buckets from the
    shortest example's to the longest's (a batch takes its longest member's bucket)."""
    shortest = min(min(len(e.token_ids) for e in examples), max_seq_len)
    top = min(bucket_length(min(max(len(e.token_ids) for e in examples), max_seq_len)), max_seq_len)
    out, length = [], min(bucket_length(shortest), max_seq_len)
    while length < top:
        out.append(length)
        length = min(length * 2, top)
    return [*out, top]


def example_batches(examples: Sequence[Example], pad_id: int, batch_size: int, *, max_seq_len: int,
                    seed: int = 0) -> Iterator[SFTBatch]:
    """Endless shuffled batches of `batch_size` tokenized examples (whole batches only: one row count)."""
    if len(examples) < batch_size:  # else the loop below would spin forever, yielding nothing
        raise ConfigError(f"trainer.sft.batch_size: {batch_size}, but only {len(examples)} demonstrations")
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield sft_batch([examples[i] for i in order[start:start + batch_size]], max_seq_len, pad_id)
