"""n samples for one prompt: one prefill, then a decode loop that stays on the device.

Compiles are few and known: one program per (graphdef, n, prompt bucket, max_tokens
bucket, stop-id bucket), buckets being powers of two. Weights (`state`), the prompt's true
length, max_tokens, seed and every sampling knob are traced arguments, so swapping in new
weights or changing temperature never recompiles (new weights must keep the same tree,
shapes and dtypes). The only host-device sync is the final fetch of the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arlo.model.kv_cache import KVCache, broadcast_cache, init_cache
from arlo.model.sampling import sample

MIN_PROMPT_BUCKET = 16
MIN_TOKEN_BUCKET = 16
MIN_STOP_BUCKET = 4


@dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray
    """[n, max_tokens] int32; pad_id after each row's end."""
    logprobs: np.ndarray
    """[n, max_tokens] float32 sampling logprobs (see arlo.model.sampling); 0 after the end."""
    lengths: np.ndarray
    """[n] int32 generated tokens per row, the stop token included."""
    finish_reasons: list[str]
    """Per row: "stop" (hit a stop id) or "length" (ran to max_tokens)."""


def bucket(size: int, minimum: int) -> int:
    """Smallest power of two >= max(size, minimum)."""
    return 1 << (max(size, minimum) - 1).bit_length()


def generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt: Sequence[int],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int,
    stop_token_ids: Sequence[int],
    max_seq_len: int,
    pad_id: int = 0,
) -> GenerationResult:
    """Sample n continuations of `prompt` with the model `nnx.merge(graphdef, state)`.

    Row r draws from its own stream fold_in(key(seed), r), so a row's tokens do not depend
    on n. Raises ValueError for an empty prompt, out-of-vocabulary ids, n or max_tokens < 1,
    or prompt + max_tokens > max_seq_len.
    """
    vocab_size = state["embedder"]["table_vd"].shape[0]
    _validate(prompt, n=n, max_tokens=max_tokens, seed=seed, max_seq_len=max_seq_len, vocab_size=vocab_size)
    prompt_1t = np.full((1, bucket(len(prompt), MIN_PROMPT_BUCKET)), pad_id, np.int32)
    prompt_1t[0, : len(prompt)] = prompt
    stop_s = np.full((bucket(len(stop_token_ids), MIN_STOP_BUCKET),), -1, np.int32)
    stop_s[: len(stop_token_ids)] = stop_token_ids
    knobs = _Knobs(
        prompt_len=np.int32(len(prompt)), max_tokens=np.int32(max_tokens),
        seed_2=np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32), stop_s=stop_s,
        temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p),
        min_p=np.float32(min_p), pad_id=np.int32(pad_id),
    )
    out = _generate_jit(graphdef, state, prompt_1t, knobs, n=n, token_bucket=bucket(max_tokens, MIN_TOKEN_BUCKET))
    tokens_nt, logprobs_nt, lengths_n, stopped_n = jax.device_get(out)
    return GenerationResult(
        tokens=np.asarray(tokens_nt[:, :max_tokens], np.int32),
        logprobs=np.asarray(logprobs_nt[:, :max_tokens], np.float32),
        lengths=np.asarray(lengths_n, np.int32),
        finish_reasons=["stop" if s else "length" for s in stopped_n],
    )


def compiled_variants() -> int:
    """Programs compiled so far by `generate` (for metrics and recompile tests)."""
    return _generate_jit._cache_size()


def _validate(prompt: Sequence[int], *, n: int, max_tokens: int, seed: int, max_seq_len: int,
              vocab_size: int) -> None:
    if not prompt:
        raise ValueError("prompt: must hold at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed: must be in [0, 2**64), got {seed}")
    if len(prompt) + max_tokens > max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"max_seq_len ({max_seq_len})")


class _Knobs(NamedTuple):
    """Traced per-request scalars: changing them never recompiles."""

    prompt_len: np.int32 | jax.Array
    max_tokens: np.int32 | jax.Array
    seed_2: np.ndarray | jax.Array
    stop_s: np.ndarray | jax.Array
    temperature: np.float32 | jax.Array
    top_k: np.int32 | jax.Array
    top_p: np.float32 | jax.Array
    min_p: np.float32 | jax.Array
    pad_id: np.int32 | jax.Array


class _Loop(NamedTuple):
    step: jax.Array
    last_n: jax.Array
    cache: KVCache
    tokens_nt: jax.Array
    logprobs_nt: jax.Array
    lengths_n: jax.Array
    stopped_n: jax.Array


def _generate_device(
    graphdef: nnx.GraphDef, state: nnx.State, prompt_1t: jax.Array, knobs: _Knobs, *, n: int, token_bucket: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    cache = init_cache(model.cfg, batch=1, length=prompt_1t.shape[1] + token_bucket)
    logits_1v, cache = model.prefill(prompt_1t, knobs.prompt_len[None], cache)
    key = jax.random.fold_in(jax.random.key(knobs.seed_2[0]), knobs.seed_2[1])
    row_keys_n = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(n, dtype=jnp.uint32))

    def draw(logits_nv: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        keys_n = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys_n, step)
        return sample(logits_nv, keys_n, temperature=knobs.temperature, top_k=knobs.top_k,
                      top_p=knobs.top_p, min_p=knobs.min_p)

    first_n, first_lp_n = draw(jnp.broadcast_to(logits_1v, (n, logits_1v.shape[-1])), jnp.int32(0))
    start = _Loop(
        step=jnp.int32(1), last_n=first_n, cache=broadcast_cache(cache, n),
        tokens_nt=jnp.full((n, token_bucket), knobs.pad_id, jnp.int32).at[:, 0].set(first_n),
        logprobs_nt=jnp.zeros((n, token_bucket), jnp.float32).at[:, 0].set(first_lp_n),
        lengths_n=jnp.ones((n,), jnp.int32), stopped_n=jnp.isin(first_n, knobs.stop_s),
    )

    def keep_going(s: _Loop) -> jax.Array:
        return (s.step < knobs.max_tokens) & ~jnp.all(s.stopped_n)

    def step(s: _Loop) -> _Loop:
        # Finished rows still run (static batch) but write padding and stop counting.
        positions_n = jnp.full((n,), knobs.prompt_len + s.step - 1, jnp.int32)
        logits_nv, cache = model.decode_step(s.last_n, positions_n, s.cache)
        tok_n, lp_n = draw(logits_nv, s.step)
        active_n = ~s.stopped_n
        return _Loop(
            step=s.step + 1, last_n=tok_n, cache=cache,
            tokens_nt=s.tokens_nt.at[:, s.step].set(jnp.where(active_n, tok_n, knobs.pad_id)),
            logprobs_nt=s.logprobs_nt.at[:, s.step].set(jnp.where(active_n, lp_n, 0.0)),
            lengths_n=s.lengths_n + active_n,
            stopped_n=s.stopped_n | (active_n & jnp.isin(tok_n, knobs.stop_s)),
        )

    end = jax.lax.while_loop(keep_going, step, start)
    return end.tokens_nt, end.logprobs_nt, end.lengths_n, end.stopped_n


# The jit cache lives on this function: keyed by graphdef (hashable, static), n, the
# token bucket and the shapes of prompt_1t / stop_s.
_generate_jit = jax.jit(_generate_device, static_argnames=("graphdef", "n", "token_bucket"))
