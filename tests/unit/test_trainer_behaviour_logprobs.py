"""The trainer's logprobs are the sampler's: same temperature, same top-k / top-p / min-p.

Against the real inference engine (KV-cached decode, its own sampler) on the same weights:
the trainer's full forward over the sampled tokens gives the logprobs the engine reported.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import AlgorithmConfig, InferenceConfig, SamplingConfig, TrainerConfig
from arlo.model import sampling_logprobs
from arlo.model.logprobs import sampled_token_logprobs, sampled_token_logprobs_and_outside
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2
from services.inference.engine import Engine, SamplingRequest
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from services.trainer.objectives import behaviour_logprob_fn, forward_logprobs

PROMPT = (257, 260, 51, 43, 52, 61, 258, 261)
BAR = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)


SETTINGS = [
    (0.7, 20, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (0.5, 0, 1.0, 0.1), (1.3, 5, 1.0, 0.05), (0.8, 0, 0.95, 0.02),
    (0.0, 20, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0),
]


@pytest.mark.parametrize(("t", "k", "p", "m"), SETTINGS)
def test_every_token_gets_the_samplers_logprob(t: float, k: int, p: float, m: float) -> None:
    """Each vocabulary entry as a target: one the filter keeps gets sampling_logprobs' value; one
    it filters out is scored with its own mass added to the kept set's (never the floor) and is
    marked outside."""
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (4, 300)), jnp.float32)
    dist = np.asarray(sampling_logprobs(logits, temperature=t, top_k=k, top_p=p, min_p=m), np.float64)
    kept = np.isfinite(dist)
    x = np.asarray(logits, np.float64) / (t if t else 1.0)
    kept_lse = np.log(np.where(kept, np.exp(x), 0.0).sum(-1, keepdims=True))
    want = np.where(kept, dist, x - np.logaddexp(kept_lse, x))
    every = jnp.broadcast_to(jnp.arange(300), (4, 300))
    logits_btv = jnp.broadcast_to(logits[:, None, :], (4, 300, 300))
    got, outside = sampled_token_logprobs_and_outside(logits_btv, every, temperature=t, top_k=k, top_p=p, min_p=m)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(outside), ~kept if t else np.zeros_like(kept))
    plain = sampled_token_logprobs(logits_btv, every, temperature=t, top_k=k, top_p=p, min_p=m)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(got))


@pytest.mark.parametrize(("t", "k", "p", "m"), [s for s in SETTINGS if s[0]])
def test_the_gradient_is_the_tempered_logprobs(t: float, k: int, p: float, m: float) -> None:
    """The kept mass is a constant of the gradient (verl and TRL train on tempered logits): every
    target, kept or filtered out, passes the tempered log-softmax's gradient."""
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 3, (2, 3, 40)), jnp.float32)
    targets = jnp.asarray([[7, 1, 2], [3, 4, 39]], jnp.int32)

    def filtered(x: jax.Array) -> jax.Array:
        return sampled_token_logprobs(x, targets, temperature=t, top_k=k, top_p=p, min_p=m).sum()

    def tempered(x: jax.Array) -> jax.Array:
        return jnp.take_along_axis(jax.nn.log_softmax(x / t), targets[..., None], axis=-1).sum()

    np.testing.assert_allclose(np.asarray(jax.grad(filtered)(logits)), np.asarray(jax.grad(tempered)(logits)),
                               atol=1e-6)


def test_a_token_the_filter_made_certain_still_learns() -> None:
    """top_p 0.3 keeps token 7 alone (p 0.34): logprob 0 on both sides, ratio 1, and the gradient
    of its tempered logprob, not none (the sampler's point mass has no gradient of its own)."""
    logits = jnp.zeros((1, 1, 40)).at[0, 0, 7].set(3.0)
    target = jnp.asarray([[7]], jnp.int32)

    def lp(x: jax.Array) -> jax.Array:
        return sampled_token_logprobs(x, target, temperature=1.0, top_k=0, top_p=0.3, min_p=0.0)[0, 0]

    assert float(lp(logits)) == pytest.approx(0.0, abs=1e-6)
    grad = np.asarray(jax.grad(lp)(logits))[0, 0]
    probs = np.asarray(jax.nn.softmax(logits[0, 0]))
    np.testing.assert_allclose(grad, np.eye(40)[7] - probs, atol=1e-6)
    assert grad[7] > 0.5


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(preset_source("tiny"), config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64))


def samples(engine: Engine, s: SamplingConfig):
    return engine.generate(SamplingRequest(prompt=PROMPT, n=8, max_tokens=24, temperature=s.temperature,
                                           top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=11))


@pytest.mark.parametrize("logprob_chunk", [0, 5])
def test_trainer_logprobs_match_the_engines_at_temperature_and_filters(engine: Engine, logprob_chunk: int) -> None:
    """The issue's bar: temperature 0.7, top_p 0.9, top_k 20, mean |difference| < 1e-5 in float32."""
    model = nnx.merge(engine.graphdef, engine.state)
    diffs, untempered = [], []
    for s in samples(engine, BAR):
        seq = jnp.asarray([[*PROMPT, *s.token_ids]], jnp.int32)
        lp, _, _ = forward_logprobs(model, seq[:, :-1], seq[:, 1:], logprob_chunk=logprob_chunk,
                                    logprob_fn=behaviour_logprob_fn(BAR))
        diffs.extend(np.abs(np.asarray(lp[0, len(PROMPT) - 1:]) - np.asarray(s.logprobs)))
        plain, _, _ = forward_logprobs(model, seq[:, :-1], seq[:, 1:])
        untempered.extend(np.abs(np.asarray(plain[0, len(PROMPT) - 1:]) - np.asarray(s.logprobs)))
    assert len(diffs) > 50
    assert np.mean(diffs) < 1e-5, np.mean(diffs)
    assert np.mean(untempered) > 1e-2  # the untempered, unfiltered logprobs were a different distribution


def group_from(samples_, reward_of) -> list[common_pb2.Trajectory]:
    return [common_pb2.Trajectory(
        id=str(i), group_id="g", group_size=len(samples_), token_ids=[*PROMPT, *s.token_ids],
        logprobs=[0.0] * len(PROMPT) + list(s.logprobs), loss_mask=[0] * len(PROMPT) + [1] * len(s.token_ids),
        policy_versions=[-1] * len(PROMPT) + [0] * len(s.token_ids), reward=reward_of(i))
        for i, s in enumerate(samples_)]


@pytest.mark.parametrize("trainer", [{}, {"ppo_epochs": 2, "mini_batches": 2}])
def test_the_learner_reports_the_sampler_trainer_mismatch(engine: Engine, trainer: dict) -> None:
    """`logprob_mismatch` is behaviour vs trainer on the same weights (the batch's start)."""
    batch = build_batch([group_from(samples(engine, BAR), lambda i: float(i % 2))], 256, 256)
    tc = TrainerConfig(learning_rate=1e-2, **trainer)
    matched = Learner(preset_source("tiny"), cfg=tc, sampling=BAR).step(batch)
    assert matched.extra["logprob_mismatch"] < 1e-5
    if not trainer:  # several updates: each update's own weights judge outside (see rl_objective)
        assert matched.extra["logprob_outside"] == 0.0
    assert not matched.skipped and np.isfinite(matched.loss)
    unfiltered = Learner(preset_source("tiny"), cfg=tc).step(batch)
    assert unfiltered.extra["logprob_mismatch"] > 1e-2


def test_several_updates_per_batch_keep_the_proximal_policy_and_move_further() -> None:
    """ppo_epochs x mini_batches: more updates move the policy further from the batch's start
    (approx_kl against the fixed proximal policy grows; a single update's ratio is 1 exactly),
    one version per batch."""
    from tests.unit.test_trainer_learner import random_groups

    batch = build_batch(random_groups(2, 4), 256, 256)
    kls = []
    for epochs, minis in ((1, 1), (2, 2), (4, 2)):
        learner = Learner(preset_source("tiny"), cfg=TrainerConfig(
            learning_rate=1e-2, ppo_epochs=epochs, mini_batches=minis, algorithm=AlgorithmConfig(decoupled=True)))
        first = jax.device_get(jax.tree.leaves(learner.state)[0]).copy()
        m = learner.step(batch)
        assert learner.step_count == 1 and not m.skipped and np.isfinite(m.loss)
        assert not np.array_equal(first, jax.device_get(jax.tree.leaves(learner.state)[0]))
        kls.append(m.approx_kl)
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[0] < kls[1] < kls[2]
