"""Token sampling: temperature, top-k, top-p, min-p. Pure and jittable.

All four knobs may be traced scalars or per-row arrays [b] (a continuous-batching engine
mixes requests with different settings in one batch), so one compiled program serves
every setting. The
filters work on the vocabulary sorted by probability, where each keeps a prefix: top-k by
rank, top-p by the mass before a token (on the top-k renormalised distribution, as HF and
vLLM do), min-p by the ratio to the top token. The most likely token is always kept. Off
values: top_k <= 0, top_p <= 0 or >= 1, min_p <= 0.

Reported logprobs are those of the distribution actually sampled from (after temperature
and filtering, renormalised), so they are the behaviour policy's for off-policy
corrections. Temperature 0 is greedy: the token is the argmax (lowest id on ties) and its
logprob is taken under the *untempered, unfiltered* softmax, i.e. the model's own
confidence, since the point mass's logprob (always 0) carries no information. Any
temperature below GREEDY_BELOW (1e-5) is greedy too: dividing logits by 1e-12..1e-30
overflows float32 and gave +-inf or NaN logprobs, and such a distribution is a point mass
anyway. A returned logprob is always finite, in [LOGPROB_FLOOR, 0]: a non-finite one would
poison the trainer's importance ratios. `sample_with_top` also returns each row's K most likely
tokens under that same distribution (the OpenAI endpoint's top_logprobs).

Filtering sorts the vocabulary (one full sort per row and step, only in batches where some
row filters); on a large vocabulary a static `lax.top_k` cap would be cheaper, at the
price of a recompile per cap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ArrayLike = jax.Array | float | int

GREEDY_BELOW = 1e-5
"""Temperatures below this (0 included) are greedy; the documented floor of sampling.temperature."""
LOGPROB_FLOOR = -1e4
"""Returned logprobs are clipped to [LOGPROB_FLOOR, 0], NaN mapped to the floor: always finite."""


def sampling_logprobs(
    logits_bv: jax.Array, *, temperature: ArrayLike, top_k: ArrayLike, top_p: ArrayLike, min_p: ArrayLike
) -> jax.Array:
    """Log-probabilities of the sampling distribution over the vocabulary (-inf where
    filtered out); float32 [b, v]. At temperature 0, the untempered log-softmax."""
    order_bv, logprobs_sorted_bv = _sorted_sampling_logprobs(logits_bv, temperature, top_k, top_p, min_p)
    rows_b1 = jnp.arange(order_bv.shape[0])[:, None]
    return jnp.zeros_like(logprobs_sorted_bv).at[rows_b1, order_bv].set(logprobs_sorted_bv)


def sample(
    logits_bv: jax.Array,
    key: jax.Array,
    *,
    temperature: ArrayLike,
    top_k: ArrayLike,
    top_p: ArrayLike,
    min_p: ArrayLike,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; returns (tokens_b int32, logprobs_b float32). See `_sample`."""
    tokens_b, logprobs_b, _ = _sample(logits_bv, key, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return tokens_b, logprobs_b


def sample_with_top(
    logits_bv: jax.Array,
    key: jax.Array,
    *,
    top: int,
    temperature: ArrayLike,
    top_k: ArrayLike,
    top_p: ArrayLike,
    min_p: ArrayLike,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`sample` (the same tokens and logprobs) plus, per row, the `top` most likely tokens of the
    distribution the token was drawn from: (tokens_b, logprobs_b, top_ids_bk, top_logprobs_bk).

    `top` is static (part of the program): a serving engine compiles one K for every request.
    The alternatives come from the very [b, v] matrix the sampled logprob is read from, so a
    sampled token among them carries exactly its own logprob (OpenAI's top_logprobs)."""
    tokens_b, logprobs_b, logprobs_bv = _sample(logits_bv, key, temperature=temperature, top_k=top_k, top_p=top_p,
                                                min_p=min_p)
    return tokens_b, logprobs_b, *top_logprobs(logprobs_bv, top)


def top_logprobs(logprobs_bv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The `k` (static) largest entries of each row, most likely first and the lowest id first on
    ties (`lax.top_k`, no full sort): (ids_bk int32, logprobs_bk float32). The logprobs are made
    finite as the sampled ones are, so a filtered-out token (-inf) that fills a place reads
    LOGPROB_FLOOR: JSON has no -inf."""
    values_bk, ids_bk = jax.lax.top_k(logprobs_bv, k)
    return ids_bk.astype(jnp.int32), finite_logprobs(values_bk)


def _sample(
    logits_bv: jax.Array,
    key: jax.Array,
    *,
    temperature: ArrayLike,
    top_k: ArrayLike,
    top_p: ArrayLike,
    min_p: ArrayLike,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row; returns (tokens_b int32, logprobs_b float32, the sampling
    distribution's logprobs_bv float32: -inf where filtered out, untempered at temperature 0).

    `key` is one PRNG key (row r then uses fold_in(key, r), so a row's draw does not depend
    on how many rows share the call) or a batch of keys [b], one stream per row. Raw
    uint32 key data is accepted too.

    The draw inverts the row's CDF in *token-id* order with one uniform per row, so a row's
    token does not depend on whether its batch took the sorted path, and random bits cost
    O(batch), not O(batch x vocab): the Gumbel-max trick drew one noise value per token id,
    which on a 152k vocabulary was 1.17 s of a batch-64 decode step on CPU (2x the lm_head
    matmul; the cumsum draw takes ~0.15 s there). The vocabulary sort runs only when some row
    of the batch filters (top-k, top-p or min-p); plain temperature sampling, the RL
    default, is a log-softmax.
    """
    b, v = logits_bv.shape
    keys_b = _row_keys(key, b)
    uniform_b = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_b)
    k, p, m = _per_row(top_k, jnp.int32), _per_row(top_p, jnp.float32), _per_row(min_p, jnp.float32)
    filtered = ((k > 0) & (k < v)) | ((p > 0) & (p < 1)) | (m > 0)

    def plain() -> jax.Array:
        t = _per_row(temperature, jnp.float32)
        return jax.nn.log_softmax(logits_bv.astype(jnp.float32) / jnp.where(t < GREEDY_BELOW, 1.0, t), axis=-1)

    def sorted_() -> jax.Array:
        order_bv, logprobs_sorted_bv = _sorted_sampling_logprobs(logits_bv, temperature, top_k, top_p, min_p)
        rows_b1 = jnp.arange(b)[:, None]
        return jnp.zeros_like(logprobs_sorted_bv).at[rows_b1, order_bv].set(logprobs_sorted_bv)

    logprobs_bv = jax.lax.cond(jnp.any(filtered), sorted_, plain)
    greedy_b = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32) < GREEDY_BELOW, (b,))
    # Greedy: argmax of the logits (lowest id on ties); its logprob is the untempered one.
    tokens_b = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), _inverse_cdf_draw(logprobs_bv, uniform_b))
    logprobs_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
    return tokens_b.astype(jnp.int32), finite_logprobs(logprobs_b), logprobs_bv


def _inverse_cdf_draw(logprobs_bv: jax.Array, uniform_b: jax.Array) -> jax.Array:
    """The first token whose cumulative probability exceeds u * total, per row.

    The cumsum is a parallel scan, so its float sums need not be exactly monotone across a
    zero-probability token; a draw that lands on one (a filtered token, in practice never)
    falls back to the row's mode rather than emit a token the filters removed.
    """
    probs_bv = jnp.exp(logprobs_bv)
    cdf_bv = jnp.cumsum(probs_bv, axis=-1)
    target_b = uniform_b * cdf_bv[:, -1]
    drawn_b = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(cdf_bv, target_b)
    drawn_b = jnp.minimum(drawn_b, logprobs_bv.shape[-1] - 1)
    allowed_b = jnp.take_along_axis(probs_bv, drawn_b[:, None], axis=-1)[:, 0] > 0
    return jnp.where(allowed_b, drawn_b, jnp.argmax(logprobs_bv, axis=-1))


def finite_logprobs(logprobs: jax.Array) -> jax.Array:
    """Clips to [LOGPROB_FLOOR, 0] and maps NaN to the floor: what leaves the sampler is finite."""
    return jnp.clip(jnp.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0), LOGPROB_FLOOR, 0.0)


def _sorted_sampling_logprobs(
    logits_bv: jax.Array, temperature: ArrayLike, top_k: ArrayLike, top_p: ArrayLike, min_p: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """(order_bv: token ids by descending probability, logprobs of the sampling
    distribution in that order)."""
    t = _per_row(temperature, jnp.float32)
    greedy = t < GREEDY_BELOW
    scaled_bv = logits_bv.astype(jnp.float32) / jnp.where(greedy, 1.0, t)
    order_bv = jnp.argsort(scaled_bv, axis=-1, descending=True, stable=True)
    sorted_bv = jnp.take_along_axis(scaled_bv, order_bv, axis=-1)
    rank_v = jnp.arange(sorted_bv.shape[-1])

    k = _per_row(top_k, jnp.int32)
    keep_bv = jnp.broadcast_to((k <= 0) | (rank_v < k), sorted_bv.shape)

    p = _per_row(top_p, jnp.float32)
    probs_bv = jax.nn.softmax(jnp.where(keep_bv, sorted_bv, -jnp.inf), axis=-1)
    mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    keep_bv &= (p <= 0) | (p >= 1) | (mass_before_bv < p)

    m = _per_row(min_p, jnp.float32)
    log_m = jnp.log(jnp.maximum(m, jnp.finfo(jnp.float32).tiny))
    keep_bv &= (m <= 0) | (sorted_bv >= sorted_bv[:, :1] + log_m)

    keep_bv |= (rank_v == 0) | greedy
    return order_bv, jax.nn.log_softmax(jnp.where(keep_bv, sorted_bv, -jnp.inf), axis=-1)


def _per_row(x: ArrayLike, dtype: jnp.dtype) -> jax.Array:
    """A scalar stays a scalar; a per-row [b] array becomes [b, 1] to broadcast over the vocabulary."""
    x = jnp.asarray(x, dtype)
    return x[:, None] if x.ndim == 1 else x


def _row_keys(key: jax.Array, b: int) -> jax.Array:
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(b, dtype=jnp.uint32))
    if key.shape != (b,):
        raise ValueError(f"sample: key must be one key or {b} keys (one per row), got shape {key.shape}")
    return key
