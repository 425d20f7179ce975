"""generate(): cached decode vs a naive full-forward reference, stops, seeds, recompiles."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import ModelConfig, create_model, generate, token_logprobs
from arlo.model.generate import bucket, compiled_variants

CFG = ModelConfig.named("tiny")
PROMPT = [257, 260, 104, 105, 258, 261]
Split = tuple[nnx.GraphDef, nnx.State]


@pytest.fixture(scope="module")
def split() -> Split:
    return nnx.split(create_model(CFG, seed=0))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(tokens_bt)


def _gen(split: Split, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(n=4, max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                  seed=0, stop_token_ids=[], max_seq_len=CFG.max_seq_len)
    kwargs.update(overrides)
    prompt = kwargs.pop("prompt", PROMPT)
    return generate(split[0], split[1], prompt, **kwargs)


def _reference_greedy(split: Split, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """No cache: re-run the full forward on the growing sequence (padded to 32, causal)."""
    seq, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        padded = jnp.zeros((1, 32), jnp.int32).at[0, : len(seq)].set(jnp.array(seq))
        logits_v = _forward(*split, padded)[0, len(seq) - 1]
        tok = int(jnp.argmax(logits_v))
        tokens.append(tok)
        logprobs.append(float(jax.nn.log_softmax(logits_v)[tok]))
        seq.append(tok)
    return tokens, logprobs


def test_greedy_matches_naive_reference(split: Split) -> None:
    result = _gen(split, n=2, temperature=0.0)
    ref_tokens, ref_logprobs = _reference_greedy(split, PROMPT, 12)
    for row in range(2):
        assert result.tokens[row].tolist() == ref_tokens
        np.testing.assert_allclose(result.logprobs[row], ref_logprobs, atol=1e-4)
    assert result.lengths.tolist() == [12, 12] and result.finish_reasons == ["length", "length"]
    assert result.tokens.dtype == np.int32 and result.logprobs.dtype == np.float32


def test_sampled_logprobs_match_teacher_forcing(split: Split) -> None:
    """What the trainer recomputes from the tokens equals what the sampler reported."""
    result = _gen(split, n=2, temperature=1.0)
    seqs = np.array([PROMPT + row.tolist() for row in result.tokens])
    padded = jnp.zeros((2, 32), jnp.int32).at[:, : seqs.shape[1]].set(seqs)
    logits_btv = _forward(*split, padded)
    lp_bt = token_logprobs(logits_btv[:, :-1], padded[:, 1:])
    expected = lp_bt[:, len(PROMPT) - 1 : len(PROMPT) - 1 + 12]
    np.testing.assert_allclose(result.logprobs, expected, atol=1e-4)


def test_rows_differ_and_seed_reproduces(split: Split) -> None:
    a = _gen(split, n=4, seed=1)
    assert len({tuple(row) for row in a.tokens.tolist()}) > 1
    np.testing.assert_array_equal(_gen(split, n=4, seed=1).tokens, a.tokens)
    assert not np.array_equal(_gen(split, n=4, seed=2).tokens, a.tokens)
    # A row's stream is fold_in(seed, row): independent of n.
    np.testing.assert_array_equal(_gen(split, n=2, seed=1).tokens, a.tokens[:2])


def test_stop_token_ends_row(split: Split) -> None:
    greedy = _gen(split, n=2, temperature=0.0).tokens[0].tolist()
    stop = greedy[4]
    first = greedy.index(stop)
    result = _gen(split, n=2, temperature=0.0, stop_token_ids=[stop], pad_id=256)
    assert result.lengths.tolist() == [first + 1] * 2
    assert result.finish_reasons == ["stop", "stop"]
    assert result.tokens[0, : first + 1].tolist() == greedy[: first + 1]
    assert (result.tokens[:, first + 1 :] == 256).all()
    assert (result.logprobs[:, first + 1 :] == 0).all()


def test_mixed_finish_reasons(split: Split) -> None:
    stops = list(range(0, 264, 11))  # ~9% of the vocabulary: some rows stop, some don't
    result = _gen(split, n=16, max_tokens=10, stop_token_ids=stops)
    assert set(result.finish_reasons) == {"stop", "length"}
    for row, reason in enumerate(result.finish_reasons):
        length = int(result.lengths[row])
        body = result.tokens[row, :length].tolist()
        assert not set(body[:-1]) & set(stops)
        if reason == "stop":
            assert body[-1] in stops
        else:
            assert length == 10 and body[-1] not in stops


def test_invalid_requests(split: Split) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        _gen(split, max_tokens=CFG.max_seq_len - len(PROMPT) + 1)
    with pytest.raises(ValueError, match="prompt"):
        _gen(split, prompt=[])
    with pytest.raises(ValueError, match="prompt"):
        _gen(split, prompt=[CFG.vocab_size])
    with pytest.raises(ValueError, match="n:"):
        _gen(split, n=0)
    with pytest.raises(ValueError, match="max_tokens"):
        _gen(split, max_tokens=0)


def test_new_weights_and_knobs_do_not_recompile(split: Split) -> None:
    before = _gen(split, n=2, seed=3)
    compiled = compiled_variants()
    other_state = nnx.state(create_model(CFG, seed=1))
    after = generate(split[0], other_state, PROMPT, n=2, max_tokens=12, temperature=1.0, top_p=1.0, top_k=0,
                     min_p=0.0, seed=3, stop_token_ids=[], max_seq_len=CFG.max_seq_len)
    assert not np.array_equal(before.tokens, after.tokens)
    # Same buckets, other knob values and true lengths: still the one program.
    _gen(split, n=2, seed=9, temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, max_tokens=9,
         prompt=PROMPT + [65, 66], stop_token_ids=[258])
    assert compiled_variants() == compiled


def test_bucket() -> None:
    assert [bucket(s, 16) for s in (1, 16, 17, 100)] == [16, 16, 32, 128]
