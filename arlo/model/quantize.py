"""QLoRA's frozen base: the projection weights stored quantised, dequantised where they are used.

A `QuantizedArray` stands where a projection weight's array stood, inside the same `nnx.Param`;
the layers read weights as `param[...]`, which dequantises here, so no layer knows. Inside a
jitted forward the dequantised weight is one layer's temporary: with `trainer.remat` a step
keeps the base in its stored bytes, and the backward pass dequantises each layer again instead
of keeping every layer's full-precision copy (without remat XLA may keep them for the backward,
and QLoRA then saves only the resident base).

Both kinds quantise blocks of `block` consecutive elements along the weight's last axis with one
float32 absmax scale each (a last axis the block does not divide is one block per row), so the
codes keep the weight's leading axes and its sharding:
- "int8": symmetric, 127 levels per sign (1 byte per element + 4 / block);
- "nf4": QLoRA's NormalFloat-4 levels (Dettmers et al. 2023), two codes per byte (0.5 byte
  per element + 4 / block).
The trainer and the engine quantise the same base the same way, so they still compute one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

QUANTIZED_WEIGHTS = ("q_dnh", "k_dkh", "v_dkh", "o_nhd", "gate_df", "up_df", "down_fd")
"""The projection weights QLoRA stores quantised (embeddings, norms and biases stay as they are)."""

NF4_LEVELS = np.asarray([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedArray:
    codes: jax.Array
    """int8 [..., n] ("int8") or uint8 [..., n / 2], two 4-bit codes per byte ("nf4")."""
    scales: jax.Array
    """float32 [..., n / block]: each block's absmax (int8: / 127)."""
    kind: str = field(metadata={"static": True})
    dtype: str = field(metadata={"static": True})
    """The dequantised array's dtype (model.param_dtype)."""

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n = self.codes.shape
        return (*lead, n * 2 if self.kind == "nf4" else n)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def __getitem__(self, key: Any) -> jax.Array:
        return self.dequantize()[key]

    def dequantize(self) -> jax.Array:
        *lead, n = self.shape
        blocks = self.scales.shape[-1]
        if self.kind == "nf4":
            high, low = self.codes >> 4, self.codes & 0xF
            index = jnp.stack([high, low], axis=-1).reshape(*lead, n)
            values = jnp.asarray(NF4_LEVELS)[index.astype(jnp.int32)]
        else:
            values = self.codes.astype(jnp.float32)
        values = values.reshape(*lead, blocks, n // blocks) * self.scales[..., None]
        return values.reshape(*lead, n).astype(self.dtype)


def block_of(n: int, block: int) -> int:
    """The block actually used along a last axis of n: `block` where it divides n, else n."""
    return block if n % block == 0 else n


def quantize(x: jax.Array, kind: str, block: int) -> QuantizedArray:
    """`x` quantised blockwise along its last axis (see the module docstring)."""
    *lead, n = x.shape
    if kind == "nf4" and n % 2:
        raise ValueError(f"nf4 packs two codes per byte: a last axis of {n} is odd")
    size = block_of(n, block)
    blocks_ = x.astype(jnp.float32).reshape(*lead, n // size, size)
    absmax = jnp.max(jnp.abs(blocks_), axis=-1)
    safe = jnp.where(absmax > 0, absmax, 1.0)[..., None]
    if kind == "int8":
        codes = jnp.round(blocks_ / safe * 127).astype(jnp.int8).reshape(*lead, n)
        return QuantizedArray(codes=codes, scales=absmax / 127, kind=kind, dtype=str(x.dtype))
    if kind != "nf4":
        raise ValueError(f"unknown quantisation {kind!r}; use int8 or nf4")
    index = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), (blocks_ / safe).reshape(*lead, n)).astype(jnp.uint8)
    pairs = index.reshape(*lead, n // 2, 2)
    codes = (pairs[..., 0] << 4) | pairs[..., 1]
    return QuantizedArray(codes=codes, scales=absmax, kind=kind, dtype=str(x.dtype))


def quantize_base(base: nnx.State, kind: str, block: int) -> nnx.State:
    """`base` with its projection weights quantised (LoRA adapters, if present, untouched)."""
    if kind == "none":
        return base
    fn = jax.jit(quantize, static_argnums=(1, 2))
    out = []
    for path, var in nnx.to_flat_state(base):
        if str(path[-1]) in QUANTIZED_WEIGHTS and not isinstance(var, nnx.LoRAParam):
            var = var.copy(fn(var.get_value(), kind, block))
        out.append((path, var))
    return nnx.from_flat_state(out)


def dequantized(state: nnx.State) -> nnx.State:
    """`state` with every quantised weight back to a plain array (what the forward computed with)."""
    out = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        out.append((path, var.copy(value.dequantize()) if isinstance(value, QuantizedArray) else var))
    return nnx.from_flat_state(out)


def stored_bytes(state: nnx.State) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(state))
