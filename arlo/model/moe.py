"""Routed experts (Qwen3-MoE): a router picks top-k of E SwiGLU experts for each token.

Routing is HF's `Qwen3MoeTopKRouter`: a softmax over the E router logits (float32), the top-k
probabilities, renormalised over the k when `norm_topk_prob`; a token's output is its k
experts' outputs weighted by those probabilities. No shared expert. Which layers route is
`MoeShape.routed(layer)` (HF's `decoder_sparse_step` and `mlp_only_layers`); the others keep
the dense `layers.MLP`.

Grouped matmul, no capacity: the n*k (token, expert) pairs are sorted by expert and each
projection is one `jax.lax.ragged_dot` over the sorted rows (group sizes = pairs per expert).
No token is dropped and the work is the pairs', not E dense MLPs'. Memory with XLA's ragged-dot
instruction (GPU, TPU): the sorted pairs in and out ([n*k, dim] each) and their gate and up
([n*k, moe_mlp_dim] each) beside the weights: at Qwen3-30B-A3B's shape (dim 2048, moe_mlp_dim
768, k 8) 2 * 32 + 2 * 12 = 88 KiB per token in bf16, whatever the routing; a dense dispatch
with capacity factor 1.25 holds [E, capacity, dim] buffers of the same order and drops the
tokens past an expert's capacity, which RL cannot afford (the sampler never dropped them).
XLA:CPU has no such kernel (JAX's fallback expands the pairs to [E, n*k, dim] before one dense
contraction, E times the pairs' work), so on CPU every expert runs over every token with zero
weight on the unchosen ones (`MoE._dense`, the same work, compiled several times faster): right
for the CPU tests and demos, not for serving a real MoE.

Expert weights carry the logical axis "expert" (arlo.model.sharding maps it onto a mesh axis
of that name: expert parallel); the router is small and replicated.

Routing replay ("R3"): `routed(x, experts_btk=..., replay_bt=...)` uses the given experts
instead of the router's top-k at the tokens `replay_bt` marks (every token without it), weighted
by the router's current probabilities of those experts (so the router still learns), and every
call returns the experts it used and the router's own top-k, so the sampler's choices can be
recorded, the trainer's forward made to use them, and the two compared (`routing_mismatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model.config import ModelConfig


class Routing(NamedTuple):
    """What one routed layer did, for recording (replay) and the load-balancing loss."""

    experts_btk: jax.Array
    """int32 [b, t, k]: the experts each token went to, the router's choice or the replayed one."""
    own_btk: jax.Array
    """int32 [b, t, k]: the router's own top-k (equal to experts_btk where nothing is replayed)."""
    load_e: jax.Array
    """float32 [E]: (token, expert) pairs counted per expert, over the counted tokens."""
    prob_e: jax.Array
    """float32 [E]: the router's probabilities summed per expert over the counted tokens."""
    tokens: jax.Array
    """float32 []: tokens counted (count_bt's sum; every token without it)."""


class MoE(nnx.Module):
    """E SwiGLU experts behind a top-k router; `__call__` has the dense MLP's interface.

    `grouped`: the experts as ragged_dot over the pairs sorted by expert (True), or as every
    expert over every token weighted by the routing (False, `_dense`); None picks the grouped
    matmul on GPU/TPU and the dense form on CPU, where ragged_dot has no kernel of its own.
    """

    grouped: bool | None = None

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        assert cfg.moe is not None
        d, f, e = cfg.dim, cfg.moe.mlp_dim, cfg.moe.num_experts
        self.top_k, self.norm_topk_prob = cfg.moe.top_k, cfg.moe.norm_topk_prob
        fan_in = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2, out_axis=-1,
                                                   batch_axis=(0,))
        router_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")
        self.router_de = _param(router_init(rngs.params(), (d, e), jnp.float32), ("embed", None))
        self.gate_edf = _param(fan_in(rngs.params(), (e, d, f), jnp.float32), ("expert", "embed", "mlp"))
        self.up_edf = _param(fan_in(rngs.params(), (e, d, f), jnp.float32), ("expert", "embed", "mlp"))
        self.down_efd = _param(fan_in(rngs.params(), (e, f, d), jnp.float32), ("expert", "mlp", "embed"))

    @property
    def num_experts(self) -> int:
        return self.router_de.shape[1]

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return self.routed(x_btd)[0]

    def routed(self, x_btd: jax.Array, experts_btk: jax.Array | None = None,
               count_bt: jax.Array | None = None, replay_bt: jax.Array | None = None) -> tuple[jax.Array, Routing]:
        """(y_btd, Routing). `experts_btk` (int [b, t, top_k]) replaces the router's choice, at the
        tokens `replay_bt` (0/1 [b, t]) marks when given (the router's own top-k elsewhere), at every
        token without it; `count_bt` (0/1 [b, t]) picks the tokens the Routing's load statistics count."""
        b, t, d = x_btd.shape
        probs_bte = self.router_probs(x_btd)
        weights_btk, own_btk = jax.lax.top_k(probs_bte, self.top_k)
        if experts_btk is None:
            experts_btk = own_btk
        else:
            if experts_btk.shape != (b, t, self.top_k):
                raise ValueError(f"MoE replay: experts_btk has shape {experts_btk.shape}, expected "
                                 f"{(b, t, self.top_k)} (batch, length, top_k)")
            experts_btk = experts_btk.astype(jnp.int32)
            if replay_bt is not None:
                experts_btk = jnp.where(replay_bt[:, :, None] > 0, experts_btk, own_btk)
            weights_btk = jnp.take_along_axis(probs_bte, experts_btk, axis=-1)
        if self.norm_topk_prob:
            weights_btk = weights_btk / weights_btk.sum(axis=-1, keepdims=True)
        y_nd = self._experts(x_btd.reshape(b * t, d), experts_btk.reshape(b * t, -1),
                             weights_btk.reshape(b * t, -1).astype(x_btd.dtype))
        return y_nd.reshape(b, t, d), _routing(probs_bte, experts_btk, own_btk, count_bt)

    def router_probs(self, x_btd: jax.Array) -> jax.Array:
        """float32 [b, t, E]. In float32 whatever the compute dtype: a bf16 router turns near-ties
        between experts into different choices from one forward to the next."""
        logits = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.router_de[...],
                            preferred_element_type=jnp.float32)
        return jax.nn.softmax(logits, axis=-1)

    def _experts(self, x_nd: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array) -> jax.Array:
        grouped = jax.default_backend() != "cpu" if self.grouped is None else self.grouped
        return (self._grouped if grouped else self._dense)(x_nd, experts_nk, weights_nk)

    def _dense(self, x_nd: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array) -> jax.Array:
        """Every expert over every token, each token's output the experts' weighted sum with zero
        weight on the unchosen ones: the work of JAX's CPU fallback for ragged_dot, in plain
        einsums XLA:CPU compiles several times faster (a routed layer's forward 0.5 s, not 1.9)."""
        dt = x_nd.dtype
        combine_ne = jnp.einsum("nke,nk->ne", jax.nn.one_hot(experts_nk, self.num_experts, dtype=dt), weights_nk)
        gate_nef = jnp.einsum("nd,edf->nef", x_nd, self.gate_edf[...].astype(dt))
        up_nef = jnp.einsum("nd,edf->nef", x_nd, self.up_edf[...].astype(dt))
        h_nef = jax.nn.silu(gate_nef) * up_nef * combine_ne[:, :, None]
        return jnp.einsum("nef,efd->nd", h_nef, self.down_efd[...].astype(dt))

    def _grouped(self, x_nd: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array) -> jax.Array:
        n, k = experts_nk.shape
        dt = x_nd.dtype
        flat = experts_nk.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # pairs sorted by expert, then token
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        x_md = x_nd[order // k]
        gate_mf = jax.lax.ragged_dot(x_md, self.gate_edf[...].astype(dt), group_sizes)
        up_mf = jax.lax.ragged_dot(x_md, self.up_edf[...].astype(dt), group_sizes)
        out_md = jax.lax.ragged_dot(jax.nn.silu(gate_mf) * up_mf, self.down_efd[...].astype(dt), group_sizes)
        # Back to (token, slot) order by the inverse permutation, then the weighted sum over the k:
        # a gather, not a scatter-add, so the sum's order is fixed.
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
        return jnp.einsum("nkd,nk->nd", out_md[inverse].reshape(n, k, -1), weights_nk)


def _routing(probs_bte: jax.Array, experts_btk: jax.Array, own_btk: jax.Array, count_bt: jax.Array | None) -> Routing:
    e = probs_bte.shape[-1]
    count = jnp.ones(probs_bte.shape[:2], jnp.float32) if count_bt is None else count_bt.astype(jnp.float32)
    chosen_bte = jax.nn.one_hot(experts_btk, e, dtype=jnp.float32).sum(axis=2)
    return Routing(experts_btk=experts_btk, own_btk=own_btk, load_e=jnp.einsum("bte,bt->e", chosen_bte, count),
                   prob_e=jnp.einsum("bte,bt->e", probs_bte, count), tokens=count.sum())


def set_differs_bt(a_btk: jax.Array, b_btk: jax.Array) -> jax.Array:
    """bool [b, t]: whether the SET of k experts differs (the order of the k does not matter)."""
    return jnp.any(jnp.sort(a_btk, axis=-1) != jnp.sort(b_btk, axis=-1), axis=-1)


def routing_mismatch_bt(routings: Sequence[Routing], recorded_lbtk: jax.Array) -> jax.Array:
    """bool [b, t]: tokens where any routed layer's own top-k set differs from the recorded one."""
    out = jnp.zeros(recorded_lbtk.shape[1:3], jnp.bool_)
    for routing, recorded_btk in zip(routings, recorded_lbtk, strict=True):
        out = out | set_differs_bt(routing.own_btk, recorded_btk)
    return out


def load_balancing_loss(routings: Sequence[Routing]) -> jax.Array:
    """The Switch Transformer auxiliary loss as HF's `load_balancing_loss_func` computes it: over
    every routed layer's counted tokens pooled, E * sum_e f_e * P_e, where f_e is the pairs sent to
    expert e per token and P_e its mean router probability (top_k when balanced, towards E as one
    expert takes every token with all the probability). Weighted by `trainer.router_aux_loss_coef` in the trainer."""
    if not routings:
        raise ValueError("load_balancing_loss: the model has no routed layer")
    tokens = jnp.maximum(sum(r.tokens for r in routings), 1.0)
    load_e = sum(r.load_e for r in routings) / tokens
    prob_e = sum(r.prob_e for r in routings) / tokens
    return load_e.shape[0] * jnp.sum(load_e * prob_e)


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)
