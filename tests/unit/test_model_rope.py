"""RoPE and its scaling variants: frequencies per band, rotation properties, validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlo.model.rope import RopeScaling, apply_rope, attention_factor, inverse_frequencies

HEAD_DIM, THETA = 64, 10000.0


def test_default_and_linear() -> None:
    base = inverse_frequencies(HEAD_DIM, THETA)
    np.testing.assert_allclose(base, THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM), rtol=1e-6)
    linear = inverse_frequencies(HEAD_DIM, THETA, RopeScaling(kind="linear", factor=4.0))
    np.testing.assert_allclose(linear, base / 4.0, rtol=1e-6)


def test_llama3_bands() -> None:
    s = RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=256, low_freq_factor=1.0, high_freq_factor=4.0)
    base, scaled = inverse_frequencies(HEAD_DIM, THETA), inverse_frequencies(HEAD_DIM, THETA, s)
    wavelen = 2 * math.pi / base
    short, long = wavelen < 256 / 4, wavelen > 256 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_allclose(scaled[short], base[short], rtol=1e-6)  # kept
    np.testing.assert_allclose(scaled[long], base[long] / 8.0, rtol=1e-6)  # interpolated
    mid = ~short & ~long
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8.0)  # blended


def test_yarn_bands_and_attention_factor() -> None:
    s = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=256)
    base, scaled = inverse_frequencies(HEAD_DIM, THETA), inverse_frequencies(HEAD_DIM, THETA, s)
    assert scaled[0] == base[0] and np.isclose(scaled[-1], base[-1] / 4.0)
    assert np.all(np.diff(scaled / base) <= 1e-7)  # monotone from extrapolation to interpolation
    assert attention_factor(s) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert attention_factor(RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=256,
                                        attention_factor=1.5)) == 1.5
    assert attention_factor(None) == 1.0


def test_rotation_is_relative() -> None:
    """q.k after RoPE depends on positions only through their difference; norms are kept."""
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, HEAD_DIM))
    s = RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=64)

    def score(m: int, n: int) -> float:
        rq = apply_rope(q, jnp.array([[m]]), THETA, s)
        rk = apply_rope(k, jnp.array([[n]]), THETA, s)
        return float(jnp.sum(rq * rk))

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
    rotated = apply_rope(q, jnp.array([[37]]), THETA)
    assert float(jnp.linalg.norm(rotated)) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-5)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(kind="dynamic", factor=2.0), "kind"),
    (dict(kind="linear", factor=0.0), "factor"),
    (dict(kind="llama3", factor=8.0), "original_max_seq_len"),
    (dict(kind="llama3", factor=8.0, original_max_seq_len=64, low_freq_factor=4.0, high_freq_factor=1.0),
     "high_freq_factor"),
])
def test_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kwargs)
