"""The engine core: bounds with clear messages, fresh random streams, versions, swaps, stop strings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import InferenceConfig
from arlo.model import ModelConfig, create_model, token_logprobs
from arlo.model.source import preset_source
from services.inference.engine import Engine, SamplingRequest


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(preset_source("tiny"), config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64))


PROMPT = (257, 260, 51, 43, 52, 61, 258, 261)


@pytest.mark.parametrize(("change", "message"), [
    ({"prompt": ()}, "must not be empty"),
    ({"prompt": (1,) * 65}, "at most 64"),
    ({"prompt": (999,)}, "prompt_token_ids must be in"),
    ({"n": 0}, "n must be in"),
    ({"n": 9}, "n must be in"),
    ({"max_tokens": 33}, "max_tokens must be in"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop_strings": ("",)}, "stop strings"),
])
def test_bad_requests_name_the_field(engine: Engine, change: dict, message: str) -> None:
    req = SamplingRequest(**{"prompt": PROMPT, "max_tokens": 4, **change})
    with pytest.raises(ValueError, match=message):
        engine.generate(req)


def test_unseeded_requests_differ_and_seeded_repeat(engine: Engine) -> None:
    req = SamplingRequest(prompt=PROMPT, n=4, max_tokens=8, temperature=1.0)
    a, b = engine.generate(req), engine.generate(req)
    assert [s.token_ids for s in a] != [s.token_ids for s in b]
    assert len({tuple(s.token_ids) for s in a}) > 1  # a group is not n copies of one sample
    seeded = SamplingRequest(prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=5)
    assert [s.token_ids for s in engine.generate(seeded)] == [s.token_ids for s in engine.generate(seeded)]


def test_swap_changes_outputs_and_versions() -> None:
    engine = Engine(preset_source("tiny"), config=InferenceConfig(max_n=2, max_tokens=8, max_prompt_tokens=32))
    req = SamplingRequest(prompt=PROMPT, max_tokens=8, temperature=0.0)
    before = engine.generate(req)[0]
    assert set(before.policy_versions) == {0}
    _, other = nnx.split(create_model(ModelConfig.named("tiny"), 123))
    engine.swap(other, 3)
    after = engine.generate(req)[0]
    assert set(after.policy_versions) == {3} and engine.version == 3
    assert after.logprobs != before.logprobs
    with pytest.raises(ValueError, match="not newer"):
        engine.swap(other, 3)


def test_stop_string_cuts_the_completion(engine: Engine) -> None:
    req = SamplingRequest(prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3)
    full = engine.generate(req)[0]
    text = engine.tokenizer.decode(full.token_ids)
    if not text:
        pytest.skip("this seed sampled only special tokens")
    stop = text[0]
    cut = engine.generate(SamplingRequest(prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                          stop_strings=(stop,)))[0]
    # Same seed, same tokens: the completion is the shortest prefix whose text holds the stop string.
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert stop in engine.tokenizer.decode(cut.token_ids)
    assert stop not in engine.tokenizer.decode(cut.token_ids[:-1])
    assert cut.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1e-30, 1e-12, 1e-40, 9.9e-6])
def test_tiny_temperatures_are_greedy_with_finite_logprobs(engine: Engine, temperature: float) -> None:
    """Below sampling.GREEDY_BELOW a temperature is greedy: dividing logits by it overflowed to
    +-inf logprobs, which the trainer then learned from."""
    import math

    greedy = engine.generate(SamplingRequest(prompt=PROMPT, n=2, max_tokens=8, temperature=0.0))
    tiny = engine.generate(SamplingRequest(prompt=PROMPT, n=2, max_tokens=8, temperature=temperature))
    for g, t in zip(greedy, tiny, strict=True):
        assert all(math.isfinite(x) and x <= 0 for x in t.logprobs), t.logprobs
        assert t.token_ids == g.token_ids
        assert t.logprobs == pytest.approx(g.logprobs, abs=1e-5)


def test_session_with_n_above_one_is_rejected(engine: Engine) -> None:
    with pytest.raises(ValueError, match="session_id"):
        engine.generate(SamplingRequest(prompt=PROMPT, n=2, max_tokens=4, session_id="s1"))


def test_sampled_logprobs_match_teacher_forcing(engine: Engine) -> None:
    """What the trainer recomputes from the tokens (a full forward, no cache) equals what the
    engine reported while sampling at temperature 1: the importance ratio starts at 1."""
    samples = engine.generate(SamplingRequest(prompt=PROMPT, n=2, max_tokens=12, temperature=1.0, seed=7))
    for s in samples:
        seq = jnp.asarray([[*PROMPT, *s.token_ids]], jnp.int32)
        logits_btv = nnx.merge(engine.graphdef, engine.state)(seq)
        lp_t = token_logprobs(logits_btv[:, :-1], seq[:, 1:])[0, len(PROMPT) - 1:]
        np.testing.assert_allclose(s.logprobs, lp_t, atol=1e-4)


def test_top_logprobs_are_the_sampling_distributions_best(engine: Engine) -> None:
    """inference.max_top_logprobs = 4: each token comes with the request's K most likely tokens of
    the distribution it was drawn from (here temperature 1, unfiltered: the model's log-softmax),
    most likely first; the sampled token, when among them, carries its own logprob; a request
    without alternatives samples what an engine without them samples."""
    limits = {"max_n": 2, "max_tokens": 12, "max_prompt_tokens": 32}
    with_top = Engine(preset_source("tiny"), config=InferenceConfig(**limits, max_top_logprobs=4))
    req = SamplingRequest(prompt=PROMPT, n=2, max_tokens=12, temperature=1.0, seed=7)
    samples = with_top.generate(dataclasses.replace(req, top_logprobs=3))
    for s in samples:
        assert s.top_ids is not None and s.top_logprobs is not None
        assert s.top_ids.shape == s.top_logprobs.shape == (len(s.token_ids), 3)
        assert (np.diff(s.top_logprobs, axis=-1) <= 0).all()
        seq = jnp.asarray([[*PROMPT, *s.token_ids]], jnp.int32)
        logits_tv = nnx.merge(with_top.graphdef, with_top.state)(seq)[0, len(PROMPT) - 1 : -1]
        ref_tv = np.asarray(jax.nn.log_softmax(logits_tv.astype(jnp.float32)))
        np.testing.assert_allclose(s.top_logprobs, -np.sort(-ref_tv, axis=-1)[:, :3], atol=1e-4)
        np.testing.assert_allclose(np.take_along_axis(ref_tv, s.top_ids, -1), s.top_logprobs, atol=1e-4)
        for token, lp, ids, lps in zip(s.token_ids, s.logprobs, s.top_ids, s.top_logprobs, strict=True):
            if token in ids:
                assert lps[list(ids).index(token)] == pytest.approx(lp, abs=1e-6)
    # Filtered to the 3 likeliest at temperature 0.8: every token is among its 3 alternatives, which
    # are the renormalised tempered top 3; greedy: the token is the first, with its own logprob.
    for knobs in ({"temperature": 0.8, "top_k": 3}, {"temperature": 0.0}):
        s = with_top.generate(dataclasses.replace(req, n=1, top_logprobs=3, **knobs))[0]
        assert s.top_ids is not None and s.top_logprobs is not None
        seq = jnp.asarray([[*PROMPT, *s.token_ids]], jnp.int32)
        logits_tv = nnx.merge(with_top.graphdef, with_top.state)(seq)[0, len(PROMPT) - 1 : -1].astype(jnp.float32)
        best_tk = -np.sort(-np.asarray(logits_tv / (knobs["temperature"] or 1.0)), axis=-1)[:, :3]
        if knobs["temperature"]:
            want = best_tk - np.log(np.exp(best_tk).sum(-1, keepdims=True))
        else:
            want = best_tk - np.log(np.exp(np.asarray(logits_tv, np.float64)).sum(-1, keepdims=True))
            assert [int(ids[0]) for ids in s.top_ids] == s.token_ids
        np.testing.assert_allclose(s.top_logprobs, want, atol=1e-4)
        for token, lp, ids, lps in zip(s.token_ids, s.logprobs, s.top_ids, s.top_logprobs, strict=True):
            assert token in ids and lps[list(ids).index(token)] == pytest.approx(lp, abs=1e-6)
    # K = 0 on this engine: the same tokens and logprobs as the engine compiled without alternatives.
    plain, other = with_top.generate(req), engine.generate(req)
    for a, b in zip(plain, other, strict=True):
        assert a.top_ids is None and a.top_logprobs is None
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    with pytest.raises(ValueError, match="max_top_logprobs"):
        with_top.generate(dataclasses.replace(req, top_logprobs=5))
    with pytest.raises(ValueError, match="max_top_logprobs"):
        engine.generate(dataclasses.replace(req, top_logprobs=1))
    # Cut with the tokens on a stop string.
    first = samples[0]
    text = with_top.tokenizer.decode(first.token_ids)
    if text:
        cut = with_top.generate(dataclasses.replace(req, top_logprobs=3, stop_strings=(text[0],)))[0]
        assert cut.top_ids is not None and len(cut.top_ids) == len(cut.token_ids) < len(first.token_ids) + 1
        np.testing.assert_array_equal(cut.top_ids, first.top_ids[: len(cut.token_ids)])
    with_top.close()


def test_a_request_the_scheduler_cannot_plan_fails_alone_and_the_rest_are_served(engine: Engine,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in planning one waiting request (injected: the scheduler raises for its prompt) made
    every engine step raise before anything ran, for ever: that request stayed at the head of the
    queue, and every request behind it waited without end. It now fails alone, at once."""
    from services.inference.scheduler import Scheduler

    poison = (7, 7, 7, 7, 7)
    plan = Scheduler._plan

    def planning_fails_for_the_poison(self: Scheduler, tokens: tuple[int, ...], *args: object, **kw: object) -> object:
        if tokens[: len(poison)] == poison:
            raise RuntimeError("cannot plan this prompt")
        return plan(self, tokens, *args, **kw)

    monkeypatch.setattr(Scheduler, "_plan", planning_fails_for_the_poison)
    bad, good = engine.submit_many([SamplingRequest(prompt=poison, max_tokens=4),
                                    SamplingRequest(prompt=PROMPT, max_tokens=4)])
    with pytest.raises(RuntimeError, match="cannot plan this prompt"):
        bad.result(60)
    assert len(good.result(120)[0].token_ids) >= 1
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_a_prompt_given_as_a_list_is_served_like_the_tuple(engine: Engine) -> None:
    """The prefix cache keys on the prompt: a list (what a Python caller builds) reached the
    scheduler unhashable and failed in the engine thread instead of being served."""
    want = engine.generate(SamplingRequest(prompt=PROMPT, max_tokens=6, temperature=0.0), 120)
    got = engine.generate(SamplingRequest(prompt=list(PROMPT), max_tokens=6, temperature=0.0), 120)  # type: ignore[arg-type]
    assert got[0].token_ids == want[0].token_ids
