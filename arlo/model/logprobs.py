"""Per-token log-probabilities of given targets: the trainer's view of the policy.

`token_logprobs` is the model's own distribution (temperature 1, nothing filtered);
`sampled_token_logprobs` is the distribution the sampler drew from (arlo/model/sampling.py):
tempered, filtered by top-k / top-p / min-p, renormalised over the kept tokens, with the
sampled token always among the kept (a forward that differs from the engine's in the last
bits must not drop a sampled token from learning). The trainer uses the second with the
run's `rollout.sampling`, so that its importance ratios compare the policy it trains with the
policy that sampled, not two different distributions (docs/algorithms.md).

`chunked_token_logprobs` computes any of these (and `token_entropy`, and several at once: the
train step's one pass returns the behaviour logprobs, the model's own logprobs for the KL and
the entropy together) a chunk of positions at a time from the hidden states, so no
[batch, length, vocab] logits are ever held whole, in the forward or the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from arlo.model.sampling import GREEDY_BELOW

LogprobFn = Callable[[jax.Array, jax.Array], Any]
"""(logits_btv, targets_bt) -> logprobs_bt float32, or a tuple of [b, t] arrays whose first is
the logprobs (`sampled_token_logprobs_and_outside`)."""


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """log softmax(logits)[target] per position, float32 [b, t].

    Computed as logit[target] - logsumexp(logits) so the full [b, t, v] log-softmax is
    never materialised. Untempered and unfiltered: it equals the sampler's logprob at
    temperature 1 with no top-k/top-p/min-p.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target_bt - jax.nn.logsumexp(logits_btv, axis=-1)


def token_entropy(logits_btv: jax.Array) -> jax.Array:
    """Entropy of each position's next-token distribution (temperature 1, unfiltered), float32 [b, t].

    Autodiff's gradient; a hand-written one (-p (x - logsumexp + H)) was tried and measured
    worse where it matters: 182 MiB against 152 MiB of RL-step temporaries at vocab 32,768,
    8 x 512, chunk 32 (better only where a chunk's backward is the step's peak: 12.3 against
    14.3 MiB at vocab 8,192, 2 x 256, dim 32, 1 layer).
    """
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)


def sampled_token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float, top_k: int,
                           top_p: float, min_p: float) -> jax.Array:
    """The sampler's logprob of each sampled target, float32 [b, t]: `sampled_token_logprobs_and_outside`'s
    first half (its docstring says how a target outside the trainer's filter is scored)."""
    return sampled_token_logprobs_and_outside(logits_btv, targets_bt, temperature=temperature, top_k=top_k,
                                              top_p=top_p, min_p=min_p)[0]


def sampled_token_logprobs_and_outside(logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float,
                                       top_k: int, top_p: float, min_p: float) -> tuple[jax.Array, jax.Array]:
    """(logprobs float32 [b, t], outside bool [b, t]): each target is a token the sampler drew
    (arlo.model.sampling.sample), scored under the distribution it was drawn from.

    The rule: **a sampled token is always in the kept set it is scored with.** The trainer's
    kept set is its own filter's (tempered logits, then top-k, top-p, min-p, as the sampler)
    plus the target itself. Its forward differs from the engine's in the last bits (bf16,
    KV-cached decode vs a full forward), so at a near-tie on the filter's edge it can rank a
    sampled token just outside: that token is scored with its own mass added to the kept set's
    (`outside` marks it), never with a floor that would drop it from learning.

    Value and gradient: the value is log(p(target) / kept mass), p the tempered softmax, so a
    ratio compares like with like; the gradient is that of the tempered log p(target) alone
    (the kept mass is a constant of the gradient), the estimator verl and TRL train with. So a
    token the filter made certain (kept alone: logprob 0 on both sides) still passes a gradient.

    The settings are static Python numbers (one compiled program per run's settings), which
    buys the cheap paths: temperature is a divide; top-k is `lax.top_k` with a static k, and
    top-p / min-p then work on those k sorted values only; with top_k 0, top-p needs the whole
    vocabulary sorted (`lax.top_k` with k = vocab: O(v log v) per position, the price of
    nucleus sampling without a top-k cap); min-p alone needs no sort (a threshold on the max).
    Same rules as the sampler: the most likely token is always kept, top-p on the top-k
    renormalised mass before a token, min-p against the top token; temperature below
    GREEDY_BELOW is greedy, whose logprob is the untempered, unfiltered one.
    """
    x = logits_btv.astype(jnp.float32)
    nowhere = jnp.zeros(targets_bt.shape, bool)
    if temperature < GREEDY_BELOW:
        return token_logprobs(x, targets_bt), nowhere
    x = x / jnp.float32(temperature)
    target = jnp.take_along_axis(x, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    tempered = target - jax.nn.logsumexp(x, axis=-1)
    kept = _kept_logsumexp(x, targets_bt, top_k=top_k, top_p=top_p, min_p=min_p)
    if kept is None:  # no filter: the tempered softmax is the sampling distribution
        return tempered, nowhere
    lse, inside = kept
    value = target - jnp.where(inside, lse, jnp.logaddexp(lse, target))
    # The value of `value`, the gradient of `tempered` (g - stop_gradient(g) is exactly 0).
    return jax.lax.stop_gradient(value) + (tempered - jax.lax.stop_gradient(tempered)), ~inside


def _kept_logsumexp(x: jax.Array, targets_bt: jax.Array, *, top_k: int, top_p: float,
                    min_p: float) -> tuple[jax.Array, jax.Array] | None:
    """(logsumexp of the tempered logits `x` over the filter's kept set, whether the target is
    in it), [b, t] each; None when no filter is on."""
    vocab = x.shape[-1]
    use_k, use_p, use_m = 0 < top_k < vocab, 0 < top_p < 1, min_p > 0
    log_m = jnp.log(jnp.float32(min_p)) if use_m else None
    if not (use_k or use_p):
        if not use_m:
            return None
        threshold = x.max(axis=-1, keepdims=True) + log_m
        target = jnp.take_along_axis(x, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jax.nn.logsumexp(jnp.where(x >= threshold, x, -jnp.inf), axis=-1), target >= threshold[..., 0]
    values, ids = jax.lax.top_k(x, top_k if use_k else vocab)  # descending, lower id first on ties
    keep = jnp.ones(values.shape, bool)
    if use_p:
        probs = jax.nn.softmax(values, axis=-1)
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < jnp.float32(top_p)
    if use_m:
        keep &= values >= values[..., :1] + log_m
    keep = keep.at[..., 0].set(True)
    inside = jnp.any((ids == targets_bt[..., None].astype(jnp.int32)) & keep, axis=-1)
    return jax.nn.logsumexp(jnp.where(keep, values, -jnp.inf), axis=-1), inside


def chunked_token_logprobs(model, h_btd: jax.Array, targets_bt: jax.Array, chunk: int,
                           logprob_fn: LogprobFn = token_logprobs) -> Any:
    """`logprob_fn` (token_logprobs by default) without ever holding [batch, length, vocab]
    logits whole; returns what `logprob_fn` returns (any tree of [b, t] arrays: several terms
    of the same logits come out of one pass, each piece's logits computed once for all).

    The sequence is cut into `chunk`-token pieces scanned in order (`lax.map`); each piece's
    logits are computed, reduced and dropped, and recomputed in the backward pass
    (jax.checkpoint: the scan keeps only each piece's hidden states and targets), so peak
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
    def piece(args: tuple[jax.Array, jax.Array]) -> Any:
        h_bcd, t_bc = args
        return logprob_fn(model.logits_from_hidden(h_bcd), t_bc)

    out = jax.lax.map(piece, (h_nbcd, t_nbc))
    return jax.tree.map(lambda x_nbc: x_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t], out)
