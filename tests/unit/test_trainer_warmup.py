"""The trainer's warm-up compiles the RL step for each batch length ahead of time: the first real
step of that shape then compiles nothing, and the weights are those the learner started with."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from arlo.compile_watch import CompileWatch
from arlo.config import TrainerConfig
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2
from services.trainer.batching import bucket_length, build_batch, trained_length
from services.trainer.learner import Learner
from services.trainer.warmup import length_buckets, warm_up_learner


def test_length_buckets_cover_every_episode_length() -> None:
    assert length_buckets(32, 128) == [16, 32]
    assert length_buckets(33, 128) == [16, 32, 48]  # 33 rounded up to a multiple of 16
    assert length_buckets(1000, 100) == [16, 32, 64, 100]  # cut at the model's context, as build_batch does
    assert length_buckets(48, 128) == [16, 32, 48]  # the longest episode is a bucket: nothing pads to 64
    assert length_buckets(100, 1024) == [16, 32, 64, 112]
    # Every length build_batch can give an episode within the budget is among them.
    for budget in (17, 48, 100, 256):
        lengths = set(length_buckets(budget, 128))
        assert {min(bucket_length(n, longest_episode=budget), 128) for n in range(1, budget + 1)} <= lengths


def test_trailing_context_is_not_trained_on_so_it_takes_no_bucket() -> None:
    traj = common_pb2.Trajectory(token_ids=list(range(17)), loss_mask=[0] * 4 + [1] * 12 + [0],
                                 logprobs=[0.0] * 17, policy_versions=[0] * 17)
    assert trained_length(traj) == 16  # the closing end-of-turn (context) falls off
    assert build_batch([[traj]], 128, 0).tokens_bt.shape == (1, 16)


@pytest.mark.timeout(300)
def test_a_warmed_length_steps_without_compiling() -> None:
    learner = Learner(preset_source("tiny"), cfg=TrainerConfig(groups_per_step=1))
    before = [np.asarray(x) for x in jax.tree.leaves(learner.state)]
    watch = CompileWatch().install()
    try:
        assert warm_up_learner(learner, lengths=[16], groups=1, group_size=2) == 1
        assert all(np.array_equal(a, np.asarray(b))
                   for a, b in zip(before, jax.tree.leaves(learner.state), strict=True))
        watch.mark_warm()
        trajs = [common_pb2.Trajectory(token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 1], reward=r,
                                       logprobs=[0.0, 0.0, -1.0, -1.0, -1.0], policy_versions=[-1, -1, 0, 0, 0])
                 for r in (0.0, 1.0)]
        metrics = learner.step(build_batch([trajs], learner.model_cfg.max_seq_len, 0))
        assert not metrics.skipped and watch.late == 0, list(watch.late_names)
    finally:
        watch.close()
