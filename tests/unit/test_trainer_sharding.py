"""The learner sharded over a data x fsdp x tensor mesh of 8 fake CPU devices gives the same step.

XLA flags must be set before JAX starts, so the check runs in a fresh interpreter.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.fake_devices import run_on_fake_devices

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
    assert run_on_fake_devices(SCRIPT, timeout_s=600).startswith("ok")


KV_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from arlo.config import AlgorithmConfig, ConfigError, MeshConfig, ModelSpec, TrainerConfig
    from arlo.distributed import make_mesh
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner
    from tests.unit.test_trainer_learner import random_groups

    assert jax.device_count() == 8
    model = ModelSpec(path=sys.argv[1])
    tc = TrainerConfig(learning_rate=1e-3)
    mesh = make_mesh(MeshConfig(axis_sizes=(1, 2, 4)), path="trainer.mesh")  # tensor 4 > the 2 kv heads
    plain = Learner(model.source(), cfg=tc)
    sharded = Learner(model.source(), cfg=tc, mesh=mesh)
    assert sharded.model_cfg.num_kv_heads == 2 and sharded.model_cfg.num_heads == 4
    attn = sharded.state["layers"][0]["attn"]
    q, k = attn["q_dnh"][...], attn["k_dkh"][...]
    assert q.sharding.spec[1] == "tensor", q.sharding  # 4 heads over tensor 4
    assert k.sharding.spec[1] is None, k.sharding  # 2 kv heads: replicated, as inference serves them
    batch = build_batch(random_groups(2, 4), 256, 256)
    for step in range(3):  # real RL steps, the same as on one device
        a, b = plain.step(batch), sharded.step(batch)
        assert not b.skipped and np.isfinite(b.loss)
        np.testing.assert_allclose(b.loss, a.loss, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(b.grad_norm, a.grad_norm, rtol=1e-3)
    gae = Learner(model.source(), cfg=TrainerConfig(algorithm=AlgorithmConfig(advantage="gae")), mesh=mesh)
    m = gae.step(batch)  # the critic (a copy of the backbone) takes the policy's fitted shardings
    assert not m.skipped and m.extra["value_skipped"] == 0.0 and np.isfinite(m.extra["value_loss"])
    try:  # 8 devices cannot lay out 1 x 2 x 3: a config error naming the field, not a crash
        make_mesh(MeshConfig(axis_sizes=(1, 2, 3)), path="trainer.mesh")
        raise AssertionError("no error")
    except ConfigError as e:
        assert str(e).startswith("trainer.mesh.axis_sizes: "), e
    print("ok", q.sharding.spec, k.sharding.spec)
""")


@pytest.mark.timeout(660)
def test_tensor_parallel_trainer_replicates_kv_heads_the_mesh_does_not_divide(tmp_path) -> None:
    """Issue 32, item 4: `trainer.mesh.axis_sizes: [1, 2, 4]` with a 2-kv-head Qwen2 checkpoint (as
    transformers writes it) raised IndivisibleError in Learner.__init__; inference replicated
    those dimensions. The trainer now fits its shardings the same way and steps as on one device."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from tests.support.hf_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "qwen2", "qwen2")
    assert run_on_fake_devices(KV_SCRIPT, str(path), timeout_s=600).startswith("ok")


def test_a_mesh_the_devices_cannot_lay_out_is_a_config_error() -> None:
    import jax

    from arlo.config import ConfigError, MeshConfig
    from arlo.distributed import make_mesh

    n = jax.device_count()
    with pytest.raises(ConfigError, match=rf"^trainer.mesh.axis_sizes: mesh data=1 x fsdp=2 x tensor=4 has 8 "
                                          rf"devices, but there are {n}"):
        make_mesh(MeshConfig(axis_sizes=(1, 2, 4)), path="trainer.mesh")
