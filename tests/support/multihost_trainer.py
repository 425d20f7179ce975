"""One process of a multi-host trainer test: `python -m tests.support.multihost_trainer OUT_DIR CKPT_DIR`.

With the JobSet's variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) it is
one of several processes; without them, the single-process reference. Process 0 (or the single
process) drives: two steps on one batch, publish, checkpoint, a third step, restore; the others
replay it through `follow`. Then every process gathers the parameters (the same collective, at
the same point) and writes them to OUT_DIR/params-<process>.npz with a JSON summary.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from arlo.config import MeshConfig, TrainerConfig
from arlo.distributed import initialize_from_env, make_mesh
from arlo.model import ModelConfig
from arlo.model.source import ModelSource
from services.trainer.batching import build_batch
from services.trainer.checkpoint import Checkpointer, CheckpointMeta
from services.trainer.gather import host_state, state_bytes
from services.trainer.learner import Learner
from services.trainer.lockstep import Replica, channel_for_this_process, follow
from tests.unit.test_trainer_learner import random_groups

MESH = MeshConfig(axis_sizes=(1, -1, 1))
"""All devices on fsdp: parameters are sharded ACROSS the processes, the hard case."""


def lead(replica: Replica) -> dict:
    batch = build_batch(random_groups(2, 4), 256, 256)  # 8 rows over the 4 devices
    losses = [replica.step(batch).loss for _ in range(2)]
    published = replica.state_bytes()
    sha = hashlib.sha256(published).hexdigest()
    replica.start_save(CheckpointMeta(version=2, step=2, params_sha256=sha, trajectory_ids=batch.trajectory_ids))
    assert replica.checkpointer is not None
    replica.checkpointer.wait()
    losses.append(replica.step(batch).loss)  # moves the parameters away from the checkpoint ...
    restored = replica.restore_newest()  # ... and back
    assert restored is not None
    replica.stop()
    return {"losses": losses, "published_sha256": sha, "restored_version": restored.meta.version,
            "restored_step": replica.learner.step_count}


def _flat(state: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in nnx.to_flat_state(state)}


def main() -> None:
    out, ckpt_dir = Path(sys.argv[1]), sys.argv[2]
    initialize_from_env(timeout_s=60)
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig(learning_rate=1e-2),
                      mesh=make_mesh(MESH))
    initial = _flat(host_state(learner.state))  # a collective: every process gathers here
    if jax.process_count() == 1:
        np.savez(out / "initial.npz", **initial)
    replica = Replica(learner, Checkpointer(ckpt_dir), channel_for_this_process())
    summary = lead(replica) if replica.channel.is_leader else {"ops": follow(replica)}
    replica.checkpointer.close()  # type: ignore[union-attr]
    params = _flat(host_state(learner.state))
    summary |= {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
                "sharded": not learner.state["layers"][0]["attn"]["q_dnh"][...].is_fully_addressable,
                "params_sha256": hashlib.sha256(state_bytes(learner.state)).hexdigest()}
    np.savez(out / f"params-{jax.process_index()}.npz", **params)
    print(json.dumps(summary), flush=True)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
