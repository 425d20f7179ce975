"""The learner sharded over a data x fsdp x tensor mesh of 8 fake CPU devices gives the same step.

XLA flags must be set before JAX starts, so the check runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from arlo.config import MeshConfig
    from arlo.distributed import make_mesh
    from arlo.model import ModelConfig
    from arlo.model.source import ModelSource
    from services.trainer.batching import build_batch
    from arlo.config import TrainerConfig
    from services.trainer.learner import Learner
    from tests.unit.test_trainer_learner import random_groups

    assert jax.device_count() == 8
    mesh = make_mesh(MeshConfig(axis_names=("data", "fsdp", "tensor"), axis_sizes=(2, 2, 2)))
    batch = build_batch(random_groups(2, 4), 256, 256)  # 8 rows: split over data x fsdp
    plain = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig())
    sharded = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=TrainerConfig(), mesh=mesh)
    q = sharded.state["layers"][0]["attn"]["q_dnh"][...]
    assert not q.sharding.is_fully_replicated, q.sharding
    a, b = plain.step(batch), sharded.step(batch)
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.grad_norm, b.grad_norm, rtol=1e-4)
    print("ok", q.sharding.spec)
""")


@pytest.mark.timeout(660)
def test_sharded_learner_matches_single_device() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
