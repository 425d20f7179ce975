"""The jitted GRPO step on the real tiny model: it learns a rewarded token, and logprobs line up."""

from __future__ import annotations

import jax
import numpy as np

from arlo.model import ModelConfig, token_logprobs
from arlo.proto.v1 import common_pb2
from services.trainer.batching import build_batch
from services.trainer.learner import Learner, LearnerConfig


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
    learner = Learner(ModelConfig.named("tiny"), seed=0, cfg=LearnerConfig(learning_rate=1e-2))
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
    learner = Learner(ModelConfig.named("tiny"), seed=1, cfg=LearnerConfig())
    metrics = learner.step(build_batch([group(learner, 55, 56)], 256, 256))
    # Behaviour logprobs were computed from the same weights: nothing is clipped, KL is ~0.
    assert metrics.clip_fraction == 0.0 and abs(metrics.approx_kl) < 1e-5
