"""Rotary position embedding and the Llama/Qwen families' context-extension variants.

The frequencies are a pure function of static config, so they are computed once on the
host (float64, as numpy) and enter the jitted program as constants. Layout is HF Llama's
"rotate half" (dimension i pairs with i + head_dim/2), the layout of every HF Llama/Qwen
checkpoint, so their q/k weights load without permutation.

Variants (HF `rope_type`): "default", "linear" (position interpolation), "llama3" (Llama
3.1+ band-wise interpolation) and "yarn" (Qwen2.5/Qwen3 long context). "dynamic" NTK is not
supported on purpose: it changes the frequencies with the current sequence length, so keys
already in a KV cache would have been rotated with different frequencies than new ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jax

ROPE_KINDS = ("linear", "llama3", "yarn")


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """Context-extension parameters; field names follow HF's `rope_parameters`."""

    kind: str
    """One of ROPE_KINDS (HF `rope_type`)."""
    factor: float
    """Context-extension factor (> 0)."""
    original_max_seq_len: int = 0
    """Pre-training context length (HF `original_max_position_embeddings`); llama3 and yarn."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are fully interpolated."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are left alone."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated (high-frequency) band."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated (low-frequency) band."""
    attention_factor: float | None = None
    """yarn: multiplier on cos/sin; None derives 0.1 * ln(factor) + 1 as in the paper."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions (HF default)."""

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind: expected one of {ROPE_KINDS}, got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor: must be > 0, got {self.factor}")
        if self.kind in ("llama3", "yarn") and self.original_max_seq_len < 1:
            raise ValueError(f"RopeScaling.original_max_seq_len: {self.kind} needs the pre-training "
                             f"context length, got {self.original_max_seq_len}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("RopeScaling.high_freq_factor: must exceed low_freq_factor")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """[head_dim // 2] float32 angular frequencies, scaled as `scaling` says."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        inv_freq = _SCALERS[scaling.kind](inv_freq, head_dim, theta, scaling)
    return inv_freq.astype(np.float32)


def attention_factor(scaling: RopeScaling | None) -> float:
    """Multiplier on cos/sin (so on q.k twice over); 1 except for yarn."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, theta: float,
               scaling: RopeScaling | None = None) -> jax.Array:
    """Rotate pairs (i, i + half) of every head by position * frequency_i."""
    import jax.numpy as jnp  # here: the config loads RopeScaling, and config loading must not import JAX

    inv_freq_h = jnp.asarray(inverse_frequencies(x_btnh.shape[-1], theta, scaling))
    angle_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq_h
    mscale = attention_factor(scaling)
    sin, cos = jnp.sin(angle_bth)[:, :, None, :], jnp.cos(angle_bth)[:, :, None, :]
    if mscale != 1.0:
        sin, cos = sin * mscale, cos * mscale
    x = x_btnh.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


def _linear(inv_freq: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    del head_dim, theta
    return inv_freq / s.factor


def _llama3(inv_freq: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and
    # the band between blends the two linearly in 1/wavelength.
    del head_dim, theta
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv_freq: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension band: avoid dividing by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1 for high frequencies: left as pre-trained
    return inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate


_SCALERS = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}
