"""A real Qwen2 checkpoint (written by transformers, loaded by arlo like any other) whose greedy
reply is a chosen token sequence: the endpoint under test then returns known text, so what it does
with that text (tool calls read in a family's format) can be checked end to end.

How: the weights are a next-token table. Embeddings are one-hot (hidden >= vocabulary), every
layer's output projections are zero (the residual stream stays the current token's one-hot), and
the LM head maps each token to its successor: every token not in the script to the script's first
token (so any prompt starts it), each script token to the next, the last to the end-of-turn token.
A script must not repeat a token; text with a repeated piece is written with an added token per
piece (see `script_tokens`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.support.tool_templates import FAMILIES, write_tool_tokenizer


def script_tokens(path: Path, family: str, pieces: Sequence[str]) -> tuple[list[int], int]:
    """Writes `family`'s tokenizer at `path` with each piece that is not already a special token
    added as a token of its own; returns the pieces' ids (decoded, they are the pieces' text) and
    the vocabulary's size."""
    spec = FAMILIES[family]
    added = [p for p in dict.fromkeys(pieces) if p not in spec["specials"]]
    tok = write_tool_tokenizer(path, family, extra=added)
    ids = [tok.token_to_id(p) for p in pieces]
    assert None not in ids and len(set(ids)) == len(ids), f"a script must not repeat a token: {pieces}"
    return ids, tok.get_vocab_size(with_added_tokens=True)


def write_scripted_checkpoint(path: Path, family: str, pieces: Sequence[str]) -> Path:
    """A checkpoint at `path` with `family`'s tokenizer and chat template whose greedy reply to
    any prompt is `pieces` (then the end-of-turn token)."""
    import torch
    import transformers

    script, vocab_size = script_tokens(path, family, pieces)
    config_file = json.loads((path / "tokenizer_config.json").read_text())
    vocab = -(-vocab_size // 8) * 8
    eos = next(int(i) for i, t in config_file["added_tokens_decoder"].items() if t["content"] == config_file["eos_token"])
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=vocab, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    model = transformers.Qwen2ForCausalLM(config).eval()
    successor = torch.full((vocab,), script[0], dtype=torch.long)
    for a, b in zip(script, [*script[1:], eos], strict=True):
        successor[a] = b
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, vocab)
        head[successor, torch.arange(vocab)] = 1.0
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = [eos]
    model.save_pretrained(path, safe_serialization=True)
    return path
