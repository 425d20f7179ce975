"""The inference engine on a mesh of fake CPU devices serves the same tokens as on one device.

Weights shard by their logical axes, the KV cache by slots (data axes) and kv heads
(tensor). XLA flags must be set before JAX starts, so the check runs in a fresh interpreter.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.fake_devices import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from arlo.config import MeshConfig
    from arlo.distributed import make_mesh
    from arlo.model import create_model, state_from_bytes, state_to_bytes
    from arlo.config import InferenceConfig
    from arlo.model.source import preset_source
    from services.inference.engine import Engine, SamplingRequest

    assert jax.device_count() == 8
    config = InferenceConfig(max_n=2, max_tokens=24, max_prompt_tokens=32, max_batch=6, max_seq_len=64, decode_steps=4)
    reqs = [SamplingRequest(prompt=(5, 17, 42, 99, 7), n=2, max_tokens=20, temperature=0.0, ignore_eos=True),
            SamplingRequest(prompt=tuple(range(30, 52)), n=1, max_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingRequest(prompt=(1, 2, 3), n=2, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)]

    def serve(mesh):
        engine = Engine(preset_source("tiny"), config=config, mesh=mesh)
        try:
            first = [[s.token_ids for s in h.result(300)] for h in engine.submit_many(reqs)]
            # A swap on the mesh keeps every parameter's placement (no recompile, no gather).
            new = state_from_bytes(state_to_bytes(nnx.split(create_model(engine.model_cfg, 1))[1]), engine.state)
            engine.swap(new, 1)
            second = [[s.token_ids for s in h.result(300)] for h in engine.submit_many(reqs[:1])]
            return first, second, engine
        finally:
            engine.close()

    ref_first, ref_second, _ = serve(None)
    for sizes in [(2, 1, 2), (1, 1, 4)]:
        mesh = make_mesh(MeshConfig(axis_sizes=sizes), jax.devices()[: int(np.prod(sizes))])
        first, second, engine = serve(mesh)
        assert first == ref_first, (sizes, first, ref_first)
        assert second == ref_second, (sizes, second, ref_second)
        q = engine.state["layers"][0]["attn"]["q_dnh"][...]
        assert q.sharding.spec[1] == "tensor", q.sharding
        k, v = engine.runner.cache.k[0], engine.runner.cache.v[0]
        if sizes == (2, 1, 2):  # pages over data, kv heads (2) over tensor (2)
            for x in (k, v):
                assert tuple(x.sharding.spec)[:2] == ("data", "tensor"), x.sharding
                shard = x.addressable_shards[0].data.shape
                assert shard[0] == x.shape[0] // 2 and shard[1] == x.shape[1] // 2, (shard, x.shape)
            assert engine.runner.pool_pages % 2 == 0
        else:  # 2 kv heads do not split 4 ways: the cache stays whole, the tokens the same
            assert k.sharding.is_fully_replicated, k.sharding
        assert len(k.sharding.device_set) == int(np.prod(sizes))
    print("ok")
""")


@pytest.mark.timeout(660)
def test_sharded_engine_matches_single_device() -> None:
    out = run_on_fake_devices(SCRIPT, timeout_s=600)
    assert out.strip().endswith("ok"), out[-2000:]


def test_service_builds_no_mesh_on_one_device() -> None:
    from arlo.config import MeshConfig
    from services.inference.__main__ import inference_mesh

    assert inference_mesh(MeshConfig()) is None  # one CPU device here: the plain single-device path
