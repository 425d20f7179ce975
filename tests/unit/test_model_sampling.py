"""Sampling and teacher-forced logprobs: pure functions over small logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlo.model import sample, sampling_logprobs, token_logprobs
from arlo.model.sampling import LOGPROB_FLOOR, sample_with_top

LOGITS_BV = jax.random.normal(jax.random.key(0), (4, 32)) * 2.0


@jax.jit
def _sample(logits_bv: jax.Array, key: jax.Array, t: jax.Array, k: jax.Array, p: jax.Array,
            m: jax.Array) -> tuple[jax.Array, jax.Array]:
    return sample(logits_bv, key, temperature=t, top_k=k, top_p=p, min_p=m)


@jax.jit
def _dist(logits_bv: jax.Array, t: jax.Array, k: jax.Array, p: jax.Array, m: jax.Array) -> jax.Array:
    return sampling_logprobs(logits_bv, temperature=t, top_k=k, top_p=p, min_p=m)


def _knobs(t: float = 1.0, k: int = 0, p: float = 1.0, m: float = 0.0) -> tuple[jax.Array, ...]:
    return jnp.float32(t), jnp.int32(k), jnp.float32(p), jnp.float32(m)


def test_greedy_is_argmax_with_untempered_logprob() -> None:
    tokens, logprobs = _sample(LOGITS_BV, jax.random.key(1), *_knobs(t=0.0, k=3, p=0.5))
    np.testing.assert_array_equal(tokens, jnp.argmax(LOGITS_BV, axis=-1))
    expected = jnp.max(jax.nn.log_softmax(LOGITS_BV), axis=-1)
    np.testing.assert_allclose(logprobs, expected, rtol=1e-6)


def test_top_k_one_is_greedy() -> None:
    for seed in range(3):
        tokens, logprobs = _sample(LOGITS_BV, jax.random.key(seed), *_knobs(t=1.3, k=1))
        np.testing.assert_array_equal(tokens, jnp.argmax(LOGITS_BV, axis=-1))
        np.testing.assert_allclose(logprobs, 0.0, atol=1e-6)


@pytest.mark.parametrize("knobs", [
    _knobs(), _knobs(t=0.5), _knobs(t=0.0), _knobs(k=5), _knobs(p=0.7), _knobs(m=0.2),
    _knobs(t=0.8, k=10, p=0.9, m=0.05),
])
def test_sampling_distribution_sums_to_one(knobs: tuple[jax.Array, ...]) -> None:
    probs = np.exp(np.asarray(_dist(LOGITS_BV, *knobs), np.float64))
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)


def test_filters_keep_the_right_support() -> None:
    probs_bv = jax.nn.softmax(LOGITS_BV)
    top5 = np.isfinite(np.asarray(_dist(LOGITS_BV, *_knobs(k=5))))
    assert (top5.sum(-1) == 5).all()
    kept = np.isfinite(np.asarray(_dist(LOGITS_BV, *_knobs(m=0.2))))
    ratio = np.asarray(probs_bv / probs_bv.max(-1, keepdims=True))
    np.testing.assert_array_equal(kept, ratio >= 0.2)
    kept = np.isfinite(np.asarray(_dist(LOGITS_BV, *_knobs(p=0.7))))
    for row in range(4):  # the smallest top set with mass >= 0.7
        sorted_p = np.sort(np.asarray(probs_bv[row]))[::-1]
        assert kept[row].sum() == int(np.searchsorted(np.cumsum(sorted_p), 0.7) + 1)


def test_reported_logprob_is_the_sampling_distribution() -> None:
    knobs = _knobs(t=0.8, k=10, p=0.9, m=0.05)
    tokens, logprobs = _sample(LOGITS_BV, jax.random.key(7), *knobs)
    dist_bv = _dist(LOGITS_BV, *knobs)
    np.testing.assert_allclose(logprobs, dist_bv[jnp.arange(4), tokens], rtol=1e-5)


def test_empirical_frequencies_match() -> None:
    logits_v = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -10.0, 1.5])
    rows = 20_000
    knobs = _knobs(t=0.9, k=6, p=0.95)
    tokens, _ = _sample(jnp.broadcast_to(logits_v, (rows, 8)), jax.random.key(3), *knobs)
    freq = np.bincount(np.asarray(tokens), minlength=8) / rows
    expected = np.exp(np.asarray(_dist(logits_v[None], *knobs)[0]))
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_seeds_rows_and_reproducibility() -> None:
    flat_bv = jnp.zeros((16, 64))  # uniform: any collision pattern would be suspicious
    a, _ = _sample(flat_bv, jax.random.key(1), *_knobs())
    b, _ = _sample(flat_bv, jax.random.key(2), *_knobs())
    again, _ = _sample(flat_bv, jax.random.key(1), *_knobs())
    assert len(set(np.asarray(a).tolist())) > 1  # rows draw independently
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, again)


def test_per_row_keys_and_raw_keys() -> None:
    keys = jax.random.split(jax.random.key(5), 4)
    tokens, _ = _sample(LOGITS_BV, keys, *_knobs())
    for row in range(4):
        single, _ = _sample(LOGITS_BV[row : row + 1], keys[row : row + 1], *_knobs())
        assert int(single[0]) == int(tokens[row])
    raw, _ = _sample(LOGITS_BV, jax.random.key_data(jax.random.key(1)), *_knobs())
    typed, _ = _sample(LOGITS_BV, jax.random.key(1), *_knobs())
    np.testing.assert_array_equal(raw, typed)


def test_knob_values_do_not_recompile() -> None:
    fn = jax.jit(lambda x, key, t, k, p, m: sample(x, key, temperature=t, top_k=k, top_p=p, min_p=m))
    for knobs in (_knobs(), _knobs(t=0.0), _knobs(t=0.3, k=4, p=0.5, m=0.1)):
        fn(LOGITS_BV, jax.random.key(0), *knobs)
    assert fn._cache_size() == 1


def test_token_logprobs_matches_log_softmax() -> None:
    logits_btv = jax.random.normal(jax.random.key(2), (2, 5, 11)) * 3
    targets_bt = jax.random.randint(jax.random.key(3), (2, 5), 0, 11)
    got = jax.jit(token_logprobs)(logits_btv, targets_bt)
    want = jnp.take_along_axis(jax.nn.log_softmax(logits_btv), targets_bt[..., None], -1)[..., 0]
    assert got.dtype == jnp.float32 and got.shape == (2, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_filtered_tokens_are_never_drawn_on_a_wide_vocabulary() -> None:
    # The inverse-CDF draw sums 50k probabilities per row in a parallel scan: float rounding
    # there must never land a draw on a token the filters removed.
    logits_bv = jax.random.normal(jax.random.key(5), (512, 50_000)) * 3
    tokens, logprobs = _sample(logits_bv, jax.random.key(9), *_knobs(t=1.3, k=3))
    top3 = np.argsort(-np.asarray(logits_bv), axis=-1)[:, :3]
    assert all(t in row for t, row in zip(np.asarray(tokens), top3, strict=True))
    assert np.isfinite(np.asarray(logprobs)).all()


def _numpy_sampling_logprobs(logits_bv: np.ndarray, t: float, k: int) -> np.ndarray:
    """The reference: temperature (none when greedy), then a top-k filter (none when greedy),
    renormalised; float64 numpy."""
    x = np.asarray(logits_bv, np.float64) / (t if t > 0 else 1.0)
    if k > 0 and t > 0:
        kth = np.sort(x, axis=-1)[:, -k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.mark.parametrize(("t", "k"), [(1.0, 0), (0.7, 0), (1.3, 3), (0.0, 0), (0.0, 3)])
def test_top_logprobs_are_the_sampling_distributions_best(t: float, k: int) -> None:
    logits_bv = np.asarray(jax.random.normal(jax.random.key(11), (6, 40)) * 3)
    top = 5
    fn = jax.jit(lambda x, key: sample_with_top(x, key, top=top, temperature=t, top_k=k, top_p=1.0, min_p=0.0))
    tokens, logprobs, ids, lps = (np.asarray(a) for a in fn(jnp.asarray(logits_bv), jax.random.key(3)))
    want = _numpy_sampling_logprobs(logits_bv, t, k)
    order = np.argsort(-want, axis=-1, kind="stable")[:, :top]
    assert ids.shape == lps.shape == (6, top) and ids.dtype == np.int32 and lps.dtype == np.float32
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_allclose(lps, np.maximum(np.take_along_axis(want, order, -1), LOGPROB_FLOOR), rtol=1e-5,
                               atol=1e-5)
    assert (np.diff(lps, axis=-1) <= 0).all()  # most likely first
    # `sample` draws the same tokens, and a sampled token among the top carries its own logprob.
    plain_tokens, plain_logprobs = (np.asarray(a) for a in _sample(jnp.asarray(logits_bv), jax.random.key(3),
                                                                   *_knobs(t=t, k=k)))
    np.testing.assert_array_equal(tokens, plain_tokens)
    np.testing.assert_array_equal(logprobs, plain_logprobs)
    for row in range(6):
        if tokens[row] in ids[row]:
            assert lps[row][list(ids[row]).index(tokens[row])] == logprobs[row]
    if t == 0.0:  # greedy: the token is the best, with the untempered log-softmax's logprob
        np.testing.assert_array_equal(ids[:, 0], tokens)
        np.testing.assert_allclose(lps, np.take_along_axis(np.asarray(jax.nn.log_softmax(logits_bv)), order, -1),
                                   rtol=1e-5)
    if k and t:  # filtered-out tokens fill the places past k, at the finite floor
        np.testing.assert_array_equal(lps[:, k:], LOGPROB_FLOOR)
