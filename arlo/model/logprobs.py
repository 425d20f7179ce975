"""Per-token log-probabilities of given targets: the trainer's view of the policy.

`token_logprobs` is the model's own distribution (temperature 1, nothing filtered);
`sampled_token_logprobs` is the distribution the sampler drew from (arlo/model/sampling.py):
tempered, filtered by top-k / top-p / min-p, renormalised over the kept tokens. The trainer
uses the second with the run's `rollout.sampling`, so that its importance ratios compare
the policy it trains with the policy that sampled, not two different distributions.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from arlo.model.sampling import GREEDY_BELOW, LOGPROB_FLOOR

LogprobFn = Callable[[jax.Array, jax.Array], jax.Array]
"""(logits_btv, targets_bt) -> logprobs_bt float32."""


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """log softmax(logits)[target] per position, float32 [b, t].

    Computed as logit[target] - logsumexp(logits) so the full [b, t, v] log-softmax is
    never materialised. Untempered and unfiltered: it equals the sampler's logprob at
    temperature 1 with no top-k/top-p/min-p.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target_bt - jax.nn.logsumexp(logits_btv, axis=-1)


def sampled_token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float, top_k: int,
                           top_p: float, min_p: float) -> jax.Array:
    """The sampler's logprob of each target (arlo.model.sampling.sample's), float32 [b, t].

    The settings are static Python numbers (one compiled program per run's settings), which
    buys the cheap paths: temperature is a divide; top-k is `lax.top_k` with a static k, and
    top-p / min-p then work on those k sorted values only; with top_k 0, top-p needs the whole
    vocabulary sorted (`lax.top_k` with k = vocab: O(v log v) per position, the price of
    nucleus sampling without a top-k cap); min-p alone needs no sort (a threshold on the max).
    The logsumexp runs over the kept set. Same rules as the sampler: the most likely token is
    always kept, top-p on the top-k renormalised mass before a token, min-p against the top
    token; temperature below GREEDY_BELOW is greedy, whose reported logprob is the untempered,
    unfiltered one. A target outside the kept set (it can be once the weights have moved)
    gets LOGPROB_FLOOR, a constant: its ratio is ~0 and it passes no gradient.
    """
    x = logits_btv.astype(jnp.float32)
    targets = targets_bt[..., None].astype(jnp.int32)
    if temperature < GREEDY_BELOW:
        return token_logprobs(x, targets_bt)
    x = x / jnp.float32(temperature)
    vocab = x.shape[-1]
    use_k, use_p, use_m = 0 < top_k < vocab, 0 < top_p < 1, min_p > 0
    target = jnp.take_along_axis(x, targets, axis=-1)[..., 0]
    log_m = jnp.log(jnp.float32(min_p)) if use_m else None
    if not (use_k or use_p):
        if not use_m:
            return target - jax.nn.logsumexp(x, axis=-1)
        threshold = x.max(axis=-1, keepdims=True) + log_m
        lse = jax.nn.logsumexp(jnp.where(x >= threshold, x, -jnp.inf), axis=-1)
        return jnp.where(target >= threshold[..., 0], target - lse, LOGPROB_FLOOR)
    values, ids = jax.lax.top_k(x, top_k if use_k else vocab)  # descending, lower id first on ties
    keep = jnp.ones(values.shape, bool)
    if use_p:
        probs = jax.nn.softmax(values, axis=-1)
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < jnp.float32(top_p)
    if use_m:
        keep &= values >= values[..., :1] + log_m
    keep = keep.at[..., 0].set(True)
    lse = jax.nn.logsumexp(jnp.where(keep, values, -jnp.inf), axis=-1)
    kept = jnp.any((ids == targets) & keep, axis=-1)
    return jnp.where(kept, target - lse, LOGPROB_FLOOR)


def chunked_token_logprobs(model, h_btd: jax.Array, targets_bt: jax.Array, chunk: int,
                           logprob_fn: LogprobFn = token_logprobs) -> jax.Array:
    """`logprob_fn` (token_logprobs by default) without ever holding [batch, length, vocab]
    logits whole.

    The sequence is cut into `chunk`-token pieces; each piece's logits are computed, reduced
    to logprobs and dropped, and recomputed in the backward pass (jax.checkpoint), so peak
    memory holds one piece's logits instead of the whole sequence's.
    """
    b, t, d = h_btd.shape
    pad = (-t) % chunk
    h = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0)))
    tg = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    n = (t + pad) // chunk
    h_nbcd = h.reshape(b, n, chunk, d).transpose(1, 0, 2, 3)
    t_nbc = tg.reshape(b, n, chunk).transpose(1, 0, 2)

    @jax.checkpoint
    def piece(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        h_bcd, t_bc = args
        return logprob_fn(model.logits_from_hidden(h_bcd), t_bc)

    out_nbc = jax.lax.map(piece, (h_nbcd, t_nbc))
    return out_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
