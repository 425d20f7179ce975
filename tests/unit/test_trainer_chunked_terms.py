"""With `trainer.logprob_chunk` the RL step holds no whole [batch, length, vocab] logits, and
computes the same numbers: the KL to the reference (every `kl_kind`, as a loss term or in the
reward, GAE's too) and the entropy bonus, chunk by chunk, against the whole-logits step
(`logprob_chunk` 0) in float32; and the compiled step's temporaries barely grow with them on;
the entropy and its gradient against torch's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from arlo.config import AlgorithmConfig, TrainerConfig
from arlo.model import ModelConfig
from arlo.model.source import ModelSource, cast_state
from bench.long_context import MemoryShape, step_temp_bytes
from services.trainer.batching import build_batch
from services.trainer.learner import Learner, _rl_step
from tests.unit.test_trainer_learner import random_groups

CHUNK = 3  # divides no row length of the batch: the last chunk is padding-filled


def learner_with_a_distant_reference(tc: TrainerConfig) -> Learner:
    """A learner whose KL reference is a quarter of the way to another model (seed 1), so every
    KL form and its gradient are well away from 0 (against the initial policy the k2/k3
    gradients vanish) without k3's exp(ref - logprob) blowing the gradient up to 1e4."""
    cfg = ModelConfig.named("tiny")
    learner = Learner(ModelSource.from_config(cfg, seed=0), cfg=tc)
    other = Learner(ModelSource.from_config(cfg, seed=1), cfg=TrainerConfig())
    mixed = jax.tree.map(lambda a, b: a + 0.25 * (b - a), learner.state, other.state)
    learner.ref_state = cast_state(mixed, learner.param_dtype)
    return learner


def sgd_step(algorithm: AlgorithmConfig, logprob_chunk: int) -> tuple[list[np.ndarray], dict[str, float]]:
    """(-gradient of every parameter, the step's diagnostics): one plain-SGD update (lr 1) through
    the learner's own RL step, its batch-start passes (the reference's logprobs, kl_in_reward's
    KL) and the differentiated one over 3 micro-batches. One update: a second would start from
    weights the first moved by the rounding of a gradient of norm ~8, and compare that too."""
    tc = TrainerConfig(logprob_chunk=logprob_chunk, micro_batch_size=2, algorithm=algorithm)
    learner = learner_with_a_distant_reference(tc)
    batch = build_batch(random_groups(3, 2), 256, 256)
    tx = optax.sgd(1.0)
    before = jax.tree.leaves(jax.device_get(nnx.to_pure_dict(learner.state)))
    step = jax.jit(functools.partial(_rl_step, learner.graphdef, tx, tc, "float32", learner.sampling),
                   static_argnums=(6,))
    rewards, rows = learner.device_inputs(batch, mini_batches=1)
    key = jax.random.key_data(jax.random.key(0))
    after, _, metrics = step(learner.state, tx.init(learner.state), learner.ref_state, rows, jnp.asarray(rewards),
                             key, 1)
    update = [b - a for a, b in zip(before, jax.tree.leaves(jax.device_get(nnx.to_pure_dict(after))), strict=True)]
    return update, {k: float(v) for k, v in metrics.items()}


# The estimator (kl_kind) is applied to the chunked logprobs elementwise (test_trainer_math.py checks each):
# one case per KL placement stays in the default tier, the other estimators are in the slow tier.
@pytest.mark.parametrize(("kind", "kl_in_reward"), [
    pytest.param(kind, in_reward, id=f"{kind}-{'kl_reward' if in_reward else 'kl_loss'}",
                 marks=() if (kind, in_reward) in (("k3", False), ("k1", True)) else pytest.mark.slow)
    for in_reward in (False, True) for kind in ("k1", "k2", "k3")])
def test_chunked_kl_and_entropy_equal_the_whole_logits_step(kind: str, kl_in_reward: bool) -> None:
    algorithm = AlgorithmConfig(kl_coef=0.5, kl_kind=kind, kl_in_reward=kl_in_reward, entropy_coef=0.1)
    whole, whole_metrics = sgd_step(algorithm, 0)
    chunked, chunked_metrics = sgd_step(algorithm, CHUNK)
    assert whole_metrics.keys() == chunked_metrics.keys()
    for name, value in whole_metrics.items():
        assert chunked_metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    assert max(float(np.abs(a).max()) for a in whole) > 1e-3  # the step moved the weights
    if not kl_in_reward:  # the reference is another model: the KL is far from 0
        assert abs(whole_metrics["kl_ref"]) > 0.01 and whole_metrics["entropy"] > 1.0  # k1 may be < 0


def test_gaes_kl_in_the_reward_is_chunked_and_hands_the_reference_on() -> None:
    algorithm = AlgorithmConfig(advantage="gae", kl_coef=0.5, kl_in_reward=True, kl_kind="k3")
    batch = build_batch(random_groups(2, 2), 256, 256)
    out = {}
    for chunk in (0, CHUNK):
        learner = learner_with_a_distant_reference(TrainerConfig(logprob_chunk=chunk, algorithm=algorithm))
        _, rows = learner.device_inputs(batch, mini_batches=1)
        out[chunk], _ = learner._prepare_gae(learner.critic, learner.state, learner.ref_state, rows)
    np.testing.assert_allclose(np.asarray(out[CHUNK]["ref_logprobs_bt"]), np.asarray(out[0]["ref_logprobs_bt"]),
                               rtol=1e-6, atol=1e-6)
    # Returns sum a sequence's per-token KLs and advantages are whitened: a logprob near -5.5 is
    # 5e-7 apart from its float32 neighbours, so a few ulps of each add up past 1e-6 (seen: 1.3e-6).
    for name in ("returns_bt", "advantages_bt"):
        np.testing.assert_allclose(np.asarray(out[CHUNK][name]), np.asarray(out[0][name]), rtol=1e-5, atol=1e-5)
    # The reference differs from the policy, so the KL moved the returns off the bare reward.
    assert float(jnp.abs(out[0]["returns_bt"]).max()) > 1e-3


def test_kl_and_entropy_add_little_to_the_compiled_steps_temporaries() -> None:
    """The bench's bar (bench/long_context.py, train_memory) at issue 36's own shape, narrow so it
    compiles in seconds: before the chunked terms 152 / 2,562 MiB off / on (16.9x): whole
    [8, 512, 32768] logits (512 MiB each) for the reference and the entropy's log-softmax."""
    shape = MemoryShape(name="test", vocab=32_768, rows=8, length=512, chunk=32)
    off = step_temp_bytes(shape)
    on = step_temp_bytes(shape, kl_coef=0.05, entropy_coef=0.01)
    assert on / off <= 1.2, (on, off)


def test_entropy_and_its_gradient_equal_torchs_categorical() -> None:
    """token_entropy and its gradient (arlo/model/logprobs.py) against torch's autodiff of
    Categorical(logits).entropy(), on peaked and flat rows."""
    import torch

    from arlo.model.logprobs import token_entropy

    x = np.random.default_rng(3).normal(size=(2, 5, 300)).astype(np.float32) * np.float32(4.0)
    x[1, 2] = 0.0
    g = np.random.default_rng(4).normal(size=(2, 5)).astype(np.float32)
    ours, grad = jax.value_and_grad(lambda v: (token_entropy(v) * g).sum())(jnp.asarray(x))
    xt = torch.tensor(x, requires_grad=True)
    theirs = (torch.distributions.Categorical(logits=xt).entropy() * torch.tensor(g)).sum()
    theirs.backward()
    assert float(ours) == pytest.approx(float(theirs.detach()), rel=1e-5)
    # Each entry is -p (logp + H): where logp is near -H both sides subtract nearly equal
    # float32 numbers of magnitude ~5, so an entry may be off by a few 1e-6 (seen: 2.8e-6).
    np.testing.assert_allclose(np.asarray(grad), xt.grad.numpy(), rtol=1e-5, atol=1e-5)
