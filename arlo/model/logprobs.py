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


def chunked_token_logprobs(model, h_btd: jax.Array, targets_bt: jax.Array, chunk: int) -> jax.Array:
    """token_logprobs without ever holding [batch, length, vocab] logits whole.

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
        return token_logprobs(model.logits_from_hidden(h_bcd), t_bc)

    out_nbc = jax.lax.map(piece, (h_nbcd, t_nbc))
    return out_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
