"""A checkpoint's host snapshot (services/trainer/checkpoint.py host_copy) is taken under the
step lock and written beside the next step, which donates the arrays it was copied from: the
snapshot must be a copy of its own, never a view of a buffer the step overwrites."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from arlo.config import AlgorithmConfig, TrainerConfig
from arlo.model import ModelConfig
from arlo.model.source import ModelSource
from services.trainer.batching import build_batch
from services.trainer.checkpoint import Checkpointer, CheckpointMeta, params_sha256, tree_sha256
from services.trainer.learner import Learner
from services.trainer.lockstep import SINGLE, Replica, learner_arrays
from tests.unit.test_trainer_learner import group


def leaves(tree) -> list[np.ndarray]:
    return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def test_a_snapshot_keeps_the_weights_it_was_taken_of_after_a_donating_step(tmp_path: Path) -> None:
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0),
                      cfg=TrainerConfig(learning_rate=1e-2, algorithm=AlgorithmConfig(advantage="gae")))
    replica = Replica(learner, Checkpointer(str(tmp_path)), SINGLE)
    learner.step(build_batch([group(learner, 55, 56)], 256, 256))  # the moments are non-zero from here
    before = leaves(learner_arrays(learner))
    sha_before = params_sha256(learner.state)
    snapshot = replica.save_snapshot()
    assert snapshot is not None and snapshot.critic is not None  # the critic is saved with the rest
    learner.step(build_batch([group(learner, 55, 56)], 256, 256))  # donates params, moments, critic
    after = leaves(learner_arrays(learner))
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))  # the step did change them
    held = leaves(snapshot)
    assert all(np.array_equal(a, b) for a, b in zip(before, held, strict=True))

    # Saved from the snapshot after the step: the checkpoint restores the pre-step state exactly.
    meta = CheckpointMeta(version=1, step=1, params_sha256=sha_before)
    replica.save_from(snapshot, meta)
    replica.checkpointer.wait()
    restored = replica.checkpointer.restore_newest(learner.state, learner.opt_state, learner.critic_checkpoint())
    assert restored is not None and restored.meta.version == 1 and not restored.skipped
    assert params_sha256(restored.params) == sha_before
    assert tree_sha256(restored.opt_state) == tree_sha256(snapshot.opt_state)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored.params))  # live arrays, as before
