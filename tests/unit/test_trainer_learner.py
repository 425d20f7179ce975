"""The jitted GRPO step on the real tiny model: it learns a rewarded token, and logprobs line up."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from flax import nnx

from arlo.config import AlgorithmConfig, SFTConfig, TrainerConfig
from arlo.model import ModelConfig, get_tokenizer, token_logprobs
from arlo.model.source import ModelSource
from arlo.proto.v1 import common_pb2
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from services.trainer.sft import Example, sft_batch

TOK = get_tokenizer("byte")


def group(learner: Learner, good: int, bad: int) -> list[common_pb2.Trajectory]:
    """Two samples of one prompt: the one ending in `good` is rewarded, `bad` is not."""
    prompt = [257, 260, 51, 43, 52, 61, 258, 261]
    out = []
    for token, reward in ((good, 1.0), (bad, 0.0)):
        ids = prompt + [token]
        logits = _logits(learner, ids)
        lp = float(token_logprobs(logits[None, :-1], np.asarray([ids[1:]]))[0, -1])
        out.append(common_pb2.Trajectory(
            id=f"{token}", group_id="g", group_size=2, token_ids=ids,
            logprobs=[0.0] * len(prompt) + [lp], loss_mask=[0] * len(prompt) + [1],
            policy_versions=[-1] * len(prompt) + [0], reward=reward))
    return out


def _logits(learner: Learner, ids: list[int]) -> np.ndarray:
    from flax import nnx

    return np.asarray(nnx.merge(learner.graphdef, learner.state)(np.asarray([ids]))[0])


def test_grpo_steps_raise_the_rewarded_token_probability() -> None:
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig(learning_rate=1e-2))
    prompt_logits = _logits(learner, [257, 260, 51, 43, 52, 61, 258, 261])[-1]
    before = jax.nn.log_softmax(prompt_logits)
    for _ in range(5):
        metrics = learner.step(build_batch([group(learner, 55, 56)], 256, 256))
        assert np.isfinite(metrics.loss) and metrics.num_tokens == 2
    after = jax.nn.log_softmax(_logits(learner, [257, 260, 51, 43, 52, 61, 258, 261])[-1])
    assert after[55] - before[55] > 0.5
    assert after[56] < before[56]
    assert learner.step_count == 5


def test_on_policy_ratio_is_one_at_the_first_step() -> None:
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=1), cfg=TrainerConfig())
    metrics = learner.step(build_batch([group(learner, 55, 56)], 256, 256))
    # Behaviour logprobs were computed from the same weights: nothing is clipped, KL is ~0.
    assert metrics.clip_fraction == 0.0 and abs(metrics.approx_kl) < 1e-5


def random_groups(num_groups: int, size: int, seed: int = 0) -> list[list[common_pb2.Trajectory]]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        members = []
        for k in range(size):
            n_prompt, n_gen = int(rng.integers(3, 8)), int(rng.integers(1, 9))
            ids = [int(x) for x in rng.integers(0, 256, n_prompt + n_gen)]
            members.append(common_pb2.Trajectory(
                id=f"{g}-{k}", group_id=f"g{g}", group_size=size, token_ids=ids,
                logprobs=[0.0] * n_prompt + [float(x) for x in rng.normal(-3, 0.3, n_gen)],
                loss_mask=[0] * n_prompt + [1] * n_gen, policy_versions=[-1] * n_prompt + [0] * n_gen,
                reward=float(rng.integers(0, 2))))
        groups.append(members)
    return groups


def sgd_update(micro_batch_size: int, algorithm: AlgorithmConfig | None = None, **trainer) -> list[np.ndarray]:
    """One plain-SGD step (lr 1) through the learner's step function: the update is -gradient.

    Adam would normalise tiny gradient entries to +-lr and hide (or magnify) float noise, so
    the equivalence is checked on the gradient itself.
    """
    import functools

    import optax

    from services.trainer.learner import _rl_step

    tc = TrainerConfig(micro_batch_size=micro_batch_size, algorithm=algorithm or AlgorithmConfig(), **trainer)
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=tc)
    batch = build_batch(random_groups(3, 2), 256, 256)  # 6 rows
    tx = optax.sgd(1.0)
    before = jax.tree.leaves(jax.device_get(nnx.to_pure_dict(learner.state)))
    step = jax.jit(functools.partial(_rl_step, learner.graphdef, tx, tc, "float32", learner.sampling), static_argnums=(6,))
    key = jax.random.key_data(jax.random.key(0))
    rewards, rows = learner.device_inputs(batch, mini_batches=1)
    after, _, _ = step(learner.state, tx.init(learner.state), None, rows, jax.numpy.asarray(rewards), key, 1)
    return [b - a for a, b in zip(before, jax.tree.leaves(jax.device_get(nnx.to_pure_dict(after))), strict=True)]


def test_micro_batches_give_the_full_batch_gradient_including_a_partial_last_one() -> None:
    for objective in ({}, {"algorithm": AlgorithmConfig(aggregation="seq_mean_token_mean")}):
        full = sgd_update(0, **objective)
        for mb in (4, 1):  # 6 rows: 4 + a partial 2; and 6 x 1
            for a, b in zip(full, sgd_update(mb, **objective), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
        assert max(float(np.abs(a).max()) for a in full) > 1e-4  # the step did something


# The KL and entropy variants are in the slow tier: test_trainer_chunked_terms.py's default cases step the
# learner with KL in the loss (k3) and in the reward (k1), entropy_coef on, and check their metrics.
@pytest.mark.parametrize("objective", [
    {"advantage": "rloo"}, {"advantage": "dr_grpo"}, {"advantage": "reinforce_pp"},
    pytest.param({"kl_coef": 0.1, "kl_kind": "k3"}, marks=pytest.mark.slow),
    pytest.param({"kl_coef": 0.1, "kl_in_reward": True, "kl_kind": "k1"}, marks=pytest.mark.slow),
    pytest.param({"entropy_coef": 0.01}, marks=pytest.mark.slow), {"decoupled": True},
])
def test_objective_variants_take_finite_steps(objective: dict) -> None:
    algorithm = AlgorithmConfig(**objective)
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig(micro_batch_size=4, algorithm=algorithm))
    metrics = learner.step(build_batch(random_groups(2, 4), 256, 256))
    assert np.isfinite(metrics.loss) and np.isfinite(metrics.grad_norm) and metrics.grad_norm > 0
    if objective.get("kl_coef") and not objective.get("kl_in_reward"):
        assert metrics.extra["kl_ref"] == pytest.approx(0.0, abs=1e-5)  # the reference is the initial policy
    if objective.get("entropy_coef"):
        assert metrics.extra["entropy"] > 0


def test_sft_steps_lower_the_demonstration_loss() -> None:
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig(learning_rate=1e-2, micro_batch_size=2,
                                                                      sft=SFTConfig(warmup_steps=0)))
    (demos,) = random_groups(1, 3, seed=5)
    batch = sft_batch([Example(list(t.token_ids), list(t.loss_mask)) for t in demos], 256, 256)
    losses = [learner.sft_step(batch).loss for _ in range(8)]
    assert losses[-1] < losses[0] * 0.8


def test_warmup_cosine_schedule() -> None:
    from services.trainer.optimizers import make_schedule

    sched = make_schedule(learning_rate=1.0, warmup_steps=10, total_steps=110)
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(110)) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("forward", [{"remat": "full"}, {"remat": "dots"}, {"logprob_chunk": 4}])
def test_memory_options_give_the_same_gradient(forward: dict) -> None:
    plain = sgd_update(0)
    for a, b in zip(plain, sgd_update(0, **forward), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_sft_has_its_own_optimizer_and_leaves_rl_state_fresh() -> None:
    from services.env_gateway.envs.arith import demonstration
    from services.trainer.sft import tokenize_demonstration

    cfg = ModelConfig.named("tiny")
    learner = Learner(ModelSource.from_config(cfg, seed=0), cfg=TrainerConfig(learning_rate=1e-3,
                                                     sft=SFTConfig(learning_rate=1e-2, warmup_steps=0)))
    rl_state_before = jax.tree.map(np.asarray, learner.opt_state)
    rng = random.Random(0)
    demos = [demonstration(i, {"op": "*", "max_operand": 30, "tool": True}, tool_prob=1.0, rng=rng) for i in range(16)]
    batch = sft_batch([tokenize_demonstration(d, TOK) for d in demos], 64, TOK.pad_id)
    losses = [learner.sft_step(batch).loss for _ in range(6)]
    assert losses[-1] < losses[0] and learner.step_count == 6 and learner.sft_opt_state is not None
    # RL's AdamW state is untouched by the warm start: RL starts with fresh moments.
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(rl_state_before),
                                                   jax.tree.leaves(jax.tree.map(np.asarray, learner.opt_state)),
                                                   strict=True))


@pytest.mark.parametrize("poison", ["nan_reward", "huge_negative_logprob"])
def test_a_non_finite_step_is_skipped_leaving_weights_and_optimizer_state_unchanged(poison: str) -> None:
    """The skip is decided inside the jitted step (its inputs are donated): nothing of it lands."""
    from arlo.model.weights import state_to_bytes

    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig(learning_rate=1e-2))
    learner.step(build_batch([group(learner, 55, 56)], 256, 256))  # Adam's moments are non-zero now
    weights, moments = state_to_bytes(learner.state), [np.asarray(x) for x in jax.tree.leaves(learner.opt_state)]
    bad = group(learner, 55, 56)
    if poison == "nan_reward":
        bad[0].reward = float("nan")
    else:  # finite, so intake passes it, but the importance ratio overflows to inf
        bad[1].logprobs[-1] = -1e30
    metrics = learner.step(build_batch([bad], 256, 256))
    assert metrics.skipped and learner.step_count == 1
    assert not (np.isfinite(metrics.loss) and np.isfinite(metrics.grad_norm))
    assert state_to_bytes(learner.state) == weights
    after = [np.asarray(x) for x in jax.tree.leaves(learner.opt_state)]
    assert all(np.array_equal(a, b) for a, b in zip(moments, after, strict=True))
    good = learner.step(build_batch([group(learner, 55, 56)], 256, 256))
    assert not good.skipped and learner.step_count == 2 and state_to_bytes(learner.state) != weights
