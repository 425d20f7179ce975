"""LoRA adapters on the decoder's projections, applied unmerged: y = x@W + scale * (x@A)@B.

The trainer and the inference engine run this same function, so a published adapter is served
exactly as it was trained. Merging `W + scale*B@A` into the serving weights instead would
round the sum into the serving dtype on every publish (TRL measured 2.4e-4 of drift after one
merge/unmerge cycle, 1.5e-2 after 1,000) and opens a logprob gap between trainer and sampler.

Adapters are `nnx.LoRAParam`s (a kind of `nnx.Param`): `split_adapters` separates them from
the frozen base, so the trainer differentiates and optimises only them, and a publish carries
only them. Their initialisation is PEFT's default (A: kaiming-uniform with a = sqrt(5), that is
U(-1/sqrt(fan_in), 1/sqrt(fan_in)); B: zeros), so a fresh adapter leaves the base's function
unchanged, and A comes from its own random stream: a preset's base weights are the same with
and without LoRA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model.config import LORA_TARGETS, LoraShape, ModelConfig

LORA_STREAM = "lora"
"""The nnx.Rngs stream adapters draw their A from (apart from `params`, the base's)."""


class TrainedNorm(nnx.LoRAParam):
    """An RMSNorm scale trained in full beside the adapters (`trainer.lora.train_norms`, PEFT's
    `modules_to_save`). A kind of LoRAParam, so `split_adapters` puts it with the adapters: the
    trainer optimises it, a publish and a checkpoint carry it, and the engine's frozen base never
    holds it (the published one is served). The merged export writes it as the base's norm."""


def trains_norms(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s RMSNorm scales are TrainedNorms (LoRA with train_norms)."""
    return cfg.lora is not None and cfg.lora.train_norms


class AdapterRows(nnx.Variable):
    """Which adapter slot each row of a batch uses ([rows] int32), in a model serving several
    adapters at once (`LoraShape.slots`); the engine sets it for each program call (`select_adapters`)."""


class LoraAdapter(nnx.Module):
    """The low-rank update of one projection whose weight maps `in_shape` to `out_shape`.

    With `shape.slots` = S > 0 it holds S adapters stacked (A [S, *in, r], B [S, r, *out]) and
    each row of a batch uses the one `rows` names: the rank-r updates of all S are computed as one
    rank-S*r update whose blocks are zeroed per row (two matmuls S times as wide as one
    adapter's, no per-row copy of any adapter), so rows of different runs share a batch.
    """

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], in_axes: tuple[str, ...],
                 out_axes: tuple[str, ...], shape: LoraShape, *, rngs: nnx.Rngs):
        r, fan_in = shape.rank, math.prod(in_shape)
        bound = 1.0 / math.sqrt(fan_in)
        key = (rngs[LORA_STREAM] if LORA_STREAM in rngs else rngs.params)()
        if shape.init == "gaussian":  # PEFT's init_lora_weights="gaussian"
            a = jax.random.normal(key, (*in_shape, r), jnp.float32) / r
        else:
            a = jax.random.uniform(key, (*in_shape, r), jnp.float32, -bound, bound)
        b = jnp.zeros((r, *out_shape), jnp.float32)
        self.slots = shape.slots
        stack: tuple[None, ...] = ()
        if self.slots:
            a, b, stack = jnp.broadcast_to(a, (self.slots, *a.shape)), jnp.zeros((self.slots, *b.shape)), (None,)
            self.rows = AdapterRows(jnp.zeros((1,), jnp.int32))
        self.a = nnx.LoRAParam(a, out_sharding=(*stack, *in_axes, None), eager_sharding=False)
        self.b = nnx.LoRAParam(b, out_sharding=(*stack, None, *out_axes), eager_sharding=False)
        self.scale = shape.scale
        self.in_dims = len(in_shape)

    def __call__(self, x: jax.Array, *, in_dims: int | None = None) -> jax.Array:
        """scale * (x@A)@B for x [..., *in_shape], in x's dtype. `in_dims`: how many trailing dims
        of x are the input (1 when the caller already flattened in_shape, row-major as A is)."""
        dt = x.dtype
        a, b = self.a[...].astype(dt), self.b[...].astype(dt)
        r = a.shape[-1]
        lead = x.shape[: x.ndim - (in_dims or self.in_dims)]
        if not self.slots:
            low = x.reshape(*lead, a.size // r) @ a.reshape(-1, r)
            out = (low @ b.reshape(r, -1)).reshape(*lead, *b.shape[1:])
            return out * jnp.asarray(self.scale, dt)
        s = self.slots
        low = jnp.einsum("...i,sir->...sr", x.reshape(*lead, -1), a.reshape(s, -1, r))
        pick = jax.nn.one_hot(self.rows[...], s, dtype=dt).reshape(lead[0], *(1,) * (len(lead) - 1), s, 1)
        out = jnp.einsum("...sr,sro->...o", low * pick, b.reshape(s, r, -1)).reshape(*lead, *b.shape[2:])
        return out * jnp.asarray(self.scale, dt)


def adapter(cfg: ModelConfig, target: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
            in_axes: tuple[str, ...], out_axes: tuple[str, ...], rngs: nnx.Rngs) -> LoraAdapter | None:
    """The adapter of projection `target` (an HF module name, e.g. "q_proj"), or None when the
    model has no LoRA or does not target it."""
    assert target in LORA_TARGETS, target
    if cfg.lora is None or target not in cfg.lora.targets:
        return None
    return LoraAdapter(in_shape, out_shape, in_axes, out_axes, cfg.lora, rngs=rngs)


def apply(y: jax.Array, lora: LoraAdapter | None, x: jax.Array, *, in_dims: int | None = None) -> jax.Array:
    """y (the frozen projection of x) plus the adapter's update of x, if any."""
    return y if lora is None else y + lora(x, in_dims=in_dims).astype(y.dtype)


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, base): the LoRA parameters and everything else."""
    adapters, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return adapters, base


def stacked(adapters: nnx.State, slots: int) -> nnx.State:
    """One adapter (the trainer's and a publish's shape) as `slots` identical stacked slots."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (slots, *x.shape)), adapters)


def slot_of(adapters: nnx.State, index: int) -> nnx.State:
    """Slot `index` of stacked adapters, in the published shape."""
    return jax.tree.map(lambda x: x[index], adapters)


def with_slot(adapters: nnx.State, index: int, one: nnx.State) -> nnx.State:
    """Stacked `adapters` with slot `index` replaced by `one` (published shape)."""
    return jax.tree.map(lambda stack, x: stack.at[index].set(x.astype(stack.dtype)), adapters, one)


def with_rows(state: nnx.State, rows_b: jax.Array) -> nnx.State:
    """`state` (of a model with stacked adapters) with every AdapterRows set to `rows_b`."""
    out = [(path, var.copy(rows_b) if isinstance(var, AdapterRows) else var) for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(out)


def select_adapters(model: nnx.Module, rows_b: jax.Array) -> nnx.Module:
    """`model` (merged inside a jitted program) with each batch row using adapter slot rows_b[row];
    a model without stacked adapters is returned as it is."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LoraAdapter) and module.slots:
            module.rows.set_value(rows_b)
    return model


def merge_states(*states: nnx.State) -> nnx.State:
    """One state from disjoint parts (adapters and base)."""
    return nnx.merge_state(*states)


def merged_weights(state: nnx.State, cfg: ModelConfig) -> nnx.State:
    """The base with every adapter folded in (W + scale * A@B, float32), trained norms in place of
    the base's, and no adapters: what
    `arlo export` writes as a plain Hugging Face model. Serving never uses this (see module doc)."""
    assert cfg.lora is not None
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    out = []
    for path, var in flat.items():
        if isinstance(var, TrainedNorm):  # the trained norm replaces the base's
            out.append((path, nnx.Param(var.get_value())))
            continue
        if isinstance(var, nnx.LoRAParam):
            continue
        value = var.get_value()
        owner, name = path[:-1], path[-1]
        target = _TARGET_OF_WEIGHT.get(str(name))
        a_var = flat.get((*owner, f"{target}_lora", "a")) if target else None
        if a_var is not None:
            a = jnp.asarray(a_var.get_value(), jnp.float32)
            b = jnp.asarray(flat[(*owner, f"{target}_lora", "b")].get_value(), jnp.float32)
            r = a.shape[-1]
            delta = (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(value.shape)
            value = jnp.asarray(value, jnp.float32) + cfg.lora.scale * delta
        out.append((path, var.copy(value)))
    return nnx.from_flat_state(out)


# The base weight each adapter attribute (`<target>_lora`) updates, by parameter name.
_TARGET_OF_WEIGHT = {"q_dnh": "q", "k_dkh": "k", "v_dkh": "v", "o_nhd": "o", "gate_df": "gate", "up_df": "up",
                     "down_fd": "down"}


def adapter_count(cfg: ModelConfig) -> int:
    """Parameters in the adapters of a model with `cfg` (0 without LoRA)."""
    if cfg.lora is None:
        return 0
    d, n, k, h, f, r = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.lora.rank
    sizes = {"q_proj": (d, n * h), "k_proj": (d, k * h), "v_proj": (d, k * h), "o_proj": (n * h, d),
             "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    count = cfg.num_layers * sum(r * (i + o) for t, (i, o) in sizes.items() if t in cfg.lora.targets)
    if cfg.lora.train_norms:  # attn/mlp (and Gemma's post) norms per layer, q/k norms, the final norm
        per_layer = (4 if cfg.post_norms else 2) * d + (2 * h if cfg.qk_norm else 0)
        count += cfg.num_layers * per_layer + d
    return count
