"""Greedy decoding through the model's KV cache, written plainly: a reference for tests.

The service generates with `services/inference` (continuous batching, buffered decode
chunks); this is the simplest use of `Transformer.prefill` / `decode_step`, for comparing the
model's cached path against another implementation (Hugging Face's `generate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from arlo.model import Transformer, init_cache


def greedy_decode(model: Transformer, prompt: Sequence[int], steps: int) -> list[int]:
    """The `steps` argmax tokens after `prompt`, one decode step per token."""
    cache = init_cache(model.cfg, batch=1, length=len(prompt) + steps)
    logits_1v, cache = model.prefill(jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), cache)
    tokens: list[int] = []
    for i in range(steps):
        tokens.append(int(jnp.argmax(logits_1v[0])))
        if i + 1 < steps:
            positions_1 = jnp.asarray([len(prompt) + i], jnp.int32)
            logits_1v, cache = model.decode_step(jnp.asarray(tokens[-1:], jnp.int32), positions_1, cache)
    return tokens
