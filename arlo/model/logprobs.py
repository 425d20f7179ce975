"""Per-token log-probabilities of given targets: the trainer's view of the policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """log softmax(logits)[target] per position, float32 [b, t].

    Computed as logit[target] - logsumexp(logits) so the full [b, t, v] log-softmax is
    never materialised. Untempered and unfiltered: it equals the sampler's logprob at
    temperature 1 with no top-k/top-p/min-p.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    target_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target_bt - jax.nn.logsumexp(logits_btv, axis=-1)
