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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from arlo.model.sampling import GREEDY_BELOW

LogprobFn = Callable[[jax.Array, Any], Any]
"""(logits_btv, targets) -> logprobs_bt float32, or a tuple of [b, t] arrays whose first is
the logprobs (`sampled_token_logprobs_and_outside`). `targets`: targets_bt int32, or
`SampledTargets` for the sampler's distribution with the kept sets the sampler recorded."""


class SampledTargets(NamedTuple):
    """Sampled targets with the kept set each was drawn from (filter replay): `kept_btk` int32
    [b, t, K], the token ids the sampler's top-k / top-p / min-p filter kept, -1 padded; a
    position with no id at all (no record: a prompt token, a trajectory without kept sets) is
    scored with the trainer's own filter."""

    ids_bt: jax.Array
    kept_btk: jax.Array


def target_ids(targets: Any) -> jax.Array:
    """The target token ids of `targets` (an array, or `SampledTargets`)."""
    return targets.ids_bt if isinstance(targets, SampledTargets) else targets


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


def sampled_token_logprobs(logits_btv: jax.Array, targets_bt: Any, *, temperature: float, top_k: int,
                           top_p: float, min_p: float) -> jax.Array:
    """The sampler's logprob of each sampled target, float32 [b, t]: `sampled_token_logprobs_and_outside`'s
    first half (its docstring says how a target outside the trainer's filter is scored)."""
    return sampled_token_logprobs_and_outside(logits_btv, targets_bt, temperature=temperature, top_k=top_k,
                                              top_p=top_p, min_p=min_p)[0]


def sampled_token_logprobs_and_outside(logits_btv: jax.Array, targets: Any, *, temperature: float,
                                       top_k: int, top_p: float, min_p: float) -> tuple[jax.Array, jax.Array]:
    """(logprobs float32 [b, t], outside bool [b, t]): each target is a token the sampler drew
    (arlo.model.sampling.sample), scored under the distribution it was drawn from.

    With `SampledTargets` (filter replay) a position the sampler recorded is scored over exactly
    the kept set that sampled it: the same set on both sides whatever the numerics, so no token
    is outside it (the sampled token is always in its own kept set). Only the logits differ.

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
    targets_bt = target_ids(targets)
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
    if isinstance(targets, SampledTargets):
        lse, inside = _recorded_logsumexp(x, targets, lse, inside)
    value = target - jnp.where(inside, lse, jnp.logaddexp(lse, target))
    # The value of `value`, the gradient of `tempered` (g - stop_gradient(g) is exactly 0).
    return jax.lax.stop_gradient(value) + (tempered - jax.lax.stop_gradient(tempered)), ~inside


def _recorded_logsumexp(x: jax.Array, targets: SampledTargets, own_lse: jax.Array,
                        own_inside: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logsumexp of the tempered logits `x` over each position's recorded kept set, whether the
    target is in it), [b, t] each; the trainer's own filter's (`own_*`) where nothing is recorded."""
    kept = targets.kept_btk.astype(jnp.int32)
    valid = kept >= 0
    recorded = valid.any(axis=-1)
    # "clip": an id past the vocabulary (refused at intake) must not read NaN into the step.
    values = jnp.take_along_axis(x, jnp.where(valid, kept, 0), axis=-1, mode="clip")
    # A position with no record has logsumexp(-inf, ...) = -inf here, replaced below; its
    # gradient would be NaN, which is why the caller takes the kept mass's value only.
    lse = jax.nn.logsumexp(jnp.where(valid, values, -jnp.inf), axis=-1)
    inside = jnp.any(valid & (kept == targets.ids_bt[..., None].astype(jnp.int32)), axis=-1)
    return jnp.where(recorded, lse, own_lse), jnp.where(recorded, inside, own_inside)


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


def chunked_token_logprobs(model, h_btd: jax.Array, targets: Any, chunk: int,
                           logprob_fn: LogprobFn = token_logprobs) -> Any:
    """`logprob_fn` (token_logprobs by default) without ever holding [batch, length, vocab]
    logits whole; returns what `logprob_fn` returns (any tree of [b, t] arrays: several terms
    of the same logits come out of one pass, each piece's logits computed once for all).

    The sequence is cut into `chunk`-token pieces scanned in order (`lax.map`); each piece's
    logits are computed, reduced and dropped, and recomputed in the backward pass
    (jax.checkpoint: the scan keeps only each piece's hidden states and targets), so peak
    memory holds one piece's logits instead of the whole sequence's.
    """
    b, t, _ = h_btd.shape
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def pieces(x: jax.Array) -> jax.Array:  # [b, t, ...] -> [n, b, chunk, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def piece(args: tuple[jax.Array, Any]) -> Any:
        h_bcd, t_bc = args
        return logprob_fn(model.logits_from_hidden(h_bcd), t_bc)

    out = jax.lax.map(piece, (pieces(h_btd), jax.tree.map(pieces, targets)))
    return jax.tree.map(lambda x_nbc: x_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t], out)
