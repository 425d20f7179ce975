"""Decode attention read from the pages in place (inference.attention_kernel: pallas).

The kernel is JAX's own Pallas paged-attention kernel (the GPU one, in interpret mode on this CPU:
the same kernel body, evaluated by XLA); the references are JAX's dense GQA reference for it, and
the engine's gather path on the same requests."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention_reference

from arlo.config import InferenceConfig, load_config
from arlo.model import ModelConfig
from arlo.model.paged_attention import _gpu_blocks, attend_pages, kernel_for, reference
from arlo.model.paged_kv import KernelPool, gather_pages, init_pool, write_prefill, write_token
from arlo.model.source import preset_source
from services.inference.device_programs import decode_kernel
from services.inference.engine import Engine, SamplingRequest
from tests.support.fake_devices import run_on_fake_devices

B, N, KV, H, PAGES, PAGE, PER_ROW = 4, 8, 2, 32, 40, 8, 12


def _inputs(dtype: jnp.dtype = jnp.float32, per_row: int = PER_ROW) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, N, H), dtype)
    k_pages = jax.random.normal(ks[1], (KV, PAGES, PAGE, H), dtype)
    v_pages = jax.random.normal(ks[2], (KV, PAGES, PAGE, H), dtype)
    # Each row holds its own shuffled pages; entries past its length name the null page (0).
    lengths = jnp.array([1, PAGE, PAGE + 1, per_row * PAGE - 3], jnp.int32)
    perm = np.asarray(jax.random.permutation(ks[3], np.arange(1, PAGES)))
    tables = np.zeros((B, per_row), np.int32)
    for b, length in enumerate(np.asarray(lengths)):
        held = -(-int(length) // PAGE)
        tables[b, :held] = np.roll(perm, -b * 9)[:held]  # rows may share pages: reads only
    return q, k_pages, v_pages, jnp.asarray(tables), lengths


def _dense_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array,
                     cap: float | None) -> jax.Array:
    """JAX's own dense reference for its kernel, on the rows' pages laid out as dense [b, s, kv, h]."""
    def dense(pages: jax.Array) -> jax.Array:
        return jnp.transpose(pages[:, tables], (1, 2, 3, 0, 4)).reshape(B, tables.shape[1] * PAGE, KV, H)

    return paged_attention_reference(q, dense(k_pages), dense(v_pages), lengths, attn_logits_soft_cap=cap)


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("kernel", ["interpret", "reference"])
def test_paged_attention_matches_the_dense_reference(kernel: str, cap: float | None) -> None:
    """GQA (4 query heads a kv head), rows of 1 position, a page exactly, a page and one, and a
    ragged last page; pages shuffled; the soft-cap on and off."""
    q, k_pages, v_pages, tables, lengths = _inputs()
    got = attend_pages(q, k_pages, v_pages, tables, lengths, cap=cap, kernel=kernel)
    want = _dense_reference(q, k_pages, v_pages, tables, lengths, cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("per_row", [20, 36])
def test_tables_the_gpu_kernel_blocks_unevenly_are_padded_to_whole_power_of_two_blocks(per_row: int) -> None:
    """20 and 36 pages a row: 16 partitions of 2 and 4 pages (Triton wants a power-of-two block of
    keys), the table padded with null entries the kernel never reaches."""
    splits, per_block = _gpu_blocks(per_row)
    assert per_block & (per_block - 1) == 0 and splits * per_block * -(-per_row // (splits * per_block)) >= per_row
    q, k_pages, v_pages, tables, lengths = _inputs(per_row=per_row)
    got = attend_pages(q, k_pages, v_pages, tables, lengths, cap=None, kernel="interpret")
    want = _dense_reference(q, k_pages, v_pages, tables, lengths, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_pages_past_a_rows_length_are_never_read() -> None:
    """Whatever the pages past a row's length (its table's null entries) and the positions past it
    in its last page hold, the output is the same: the kernel masks by length, not by table."""
    q, k_pages, v_pages, tables, lengths = _inputs()
    got = attend_pages(q, k_pages, v_pages, tables, lengths, cap=None, kernel="interpret")
    noise = 1e3 * jnp.ones_like(k_pages[:, :1])
    k2, v2 = k_pages.at[:, :1].set(noise), v_pages.at[:, :1].set(noise)  # the null page
    last = tables[3, (lengths[3] - 1) // PAGE]
    k2, v2 = k2.at[:, last, PAGE - 1].set(1e3), v2.at[:, last, PAGE - 1].set(1e3)  # past row 3's end
    again = attend_pages(q, k2, v2, tables, lengths, cap=None, kernel="interpret")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_bfloat16_pages_agree_with_the_float32_reference_within_bf16_rounding() -> None:
    q, k_pages, v_pages, tables, lengths = _inputs(jnp.bfloat16)
    got = attend_pages(q, k_pages, v_pages, tables, lengths, cap=None, kernel="interpret")
    want = reference(*(x.astype(jnp.float32) for x in (q, k_pages, v_pages)), tables, lengths, cap=None)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


def test_the_kernel_layout_pool_holds_what_the_gather_layout_holds() -> None:
    """A prefill chunk written into both pool layouts reads back the same window, and a decode
    token written with write_token lands where the gather path reads position p."""
    cfg = ModelConfig(vocab_size=64, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32,
                      max_seq_len=64)
    pools = [init_pool(cfg, pages=9, page_size=4), init_pool(cfg, pages=9, page_size=4, kernel_layout=True)]
    assert isinstance(pools[1], KernelPool) and pools[1].length == pools[0].length == 4
    ks = jax.random.split(jax.random.key(1), 2)
    win = gather_pages(pools[0], jnp.zeros((2, 4), jnp.int32), 12)
    win = win._replace(k=tuple(jax.random.normal(ks[0], x.shape) for x in win.k),
                       v=tuple(jax.random.normal(ks[1], x.shape) for x in win.v))
    src = jnp.array([[1, 2, 3, 0], [4, 5, 6, 0]], jnp.int32)
    dst = jnp.array([[1, 2, 3, 0], [4, 5, 6, 0], [7, 8, 6, 0]], jnp.int32)  # sample 2 reads row 1 from its own pages
    rows, first = jnp.array([0, 1, 1], jnp.int32), jnp.zeros((2,), jnp.int32)
    written = [jax.jit(write_prefill, static_argnums=6)(p, win, src, dst, rows, first, 3) for p in pools]
    for a, b in zip(gather_pages(written[0], dst, 12), gather_pages(written[1], dst, 12), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    k_new, v_new = jnp.full((3, 2, 8), 7.0), jnp.full((3, 2, 8), -7.0)
    pos = jnp.array([5, 11, 2], jnp.int32)
    k_pages, v_pages = write_token(written[1].k[0], written[1].v[0], k_new, v_new, dst, pos)
    after = gather_pages(KernelPool(k=(k_pages,), v=(v_pages,)), dst, 12)
    for j, p in enumerate(np.asarray(pos)):
        np.testing.assert_array_equal(np.asarray(after.k[0][j, :, :, p]), 7.0)
        np.testing.assert_array_equal(np.asarray(after.v[0][j, :, p]), -7.0)


def test_the_kernel_follows_the_platform() -> None:
    assert [kernel_for(p) for p in ("gpu", "cuda", "tpu", "cpu")] == ["gpu", "gpu", "tpu", "interpret"]


def test_a_sliding_window_model_is_refused_by_the_settings_name() -> None:
    gemma = dataclasses.replace(preset_source("tiny").cfg, layer_types=("sliding_attention", "full_attention"),
                                sliding_window=8)
    with pytest.raises(ValueError, match=r"inference\.attention_kernel.*sliding"):
        decode_kernel("pallas", gemma, None)
    assert decode_kernel("xla", gemma, None) is None


def test_what_the_kernels_cannot_take_is_refused_before_a_compile() -> None:
    """Found lowering JAX's kernels for CUDA and TPU from this CPU: Mosaic takes head_dim only in
    multiples of 128 (Qwen2.5-0.5B's is 64), and Triton only power-of-two key blocks of 16 or more
    (page_size 0, the dense layout, is one page of max_seq_len)."""
    from arlo.config.base import ConfigError

    tiny = preset_source("tiny").cfg
    assert tiny.head_dim % 128
    with pytest.raises(ValueError, match=r"inference\.attention_kernel.*TPU.*multiple of 128"):
        decode_kernel("pallas", tiny, None, platform="tpu")
    assert decode_kernel("pallas", tiny, None, platform="gpu").name == "gpu"
    for page in (0, 8):
        with pytest.raises(ConfigError, match=r"inference\.page_size: must be at least 16 with attention_kernel"):
            load_config(overrides={"inference": {"attention_kernel": "pallas", "page_size": page}})


MESH_SCRIPT = textwrap.dedent("""
    import dataclasses
    import jax
    import pytest
    from arlo.config import InferenceConfig, MeshConfig
    from arlo.distributed import make_mesh
    from arlo.model.source import preset_source
    from services.inference.engine import Engine, SamplingRequest

    config = InferenceConfig(max_n=2, max_tokens=16, max_prompt_tokens=32, max_batch=4, max_seq_len=64,
                             decode_steps=4, page_size=16)
    reqs = [SamplingRequest(prompt=(5, 17, 42, 99, 7), n=2, max_tokens=14, temperature=0.0, ignore_eos=True),
            SamplingRequest(prompt=tuple(range(30, 52)), max_tokens=10, temperature=0.0, ignore_eos=True)]

    def serve(mesh, kernel):
        engine = Engine(preset_source("tiny"), config=dataclasses.replace(config, attention_kernel=kernel), mesh=mesh)
        try:
            return [[(s.token_ids, s.logprobs) for s in h.result(300)] for h in engine.submit_many(reqs)], engine
        finally:
            engine.close()

    want, _ = serve(None, "xla")
    tensor = make_mesh(MeshConfig(axis_sizes=(1, 1, 2)), jax.devices()[:2])
    got, engine = serve(tensor, "pallas")
    assert engine.runner.kernel.heads_axis == "tensor"
    k = engine.runner.cache.k[0]  # [kv heads, pages, page, head_dim]: a kv head per device
    assert k.addressable_shards[0].data.shape[0] == k.shape[0] // 2, k.sharding
    for a, b in zip(got, want):
        for (ta, la), (tb, lb) in zip(a, b):
            assert ta == tb, (ta, tb)
            assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-5
    data = make_mesh(MeshConfig(axis_sizes=(2, 1, 1)), jax.devices()[:2])
    with pytest.raises(ValueError, match=r"inference.attention_kernel.*spreads pages over .'data': 2"):
        serve(data, "pallas")
    print("ok")
""")


@pytest.mark.timeout(400)
def test_on_a_tensor_parallel_mesh_each_device_attends_its_own_kv_heads() -> None:
    """Two fake CPU devices, kv heads split over `tensor`: the kernel runs under shard_map and gives
    the one-device gather path's greedy tokens; a mesh that spreads pages over `data` is refused."""
    out = run_on_fake_devices(MESH_SCRIPT, devices=2, timeout_s=360)
    assert out.strip().endswith("ok"), out[-2000:]


def test_a_sliding_window_checkpoint_with_the_kernel_is_refused_at_config_load(tmp_path: Path) -> None:
    """A Gemma 3 checkpoint (transformers-written, sliding and global layers) with the kernel: the
    run's config is refused at load naming the setting, not the inference service at its start."""
    pytest.importorskip("transformers")
    from arlo.config.base import ConfigError
    from arlo.model.tiny_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "gemma3", "gemma3")
    overrides = {"model": {"path": str(path)}, "rollout": {"max_episode_tokens": 256}}
    load_config(overrides=overrides)  # the gather path serves it
    with pytest.raises(ConfigError, match=r"inference\.attention_kernel: 'pallas' has no sliding window.*gemma3"):
        load_config(overrides={**overrides, "inference": {"attention_kernel": "pallas"}})


PROMPTS = [tuple(range(10, 10 + n)) for n in (3, 17, 31, 40)]


def _generate(kernel: str, **config: object) -> tuple[list, Engine]:
    cfg = InferenceConfig(max_n=2, max_tokens=32, max_prompt_tokens=64, max_batch=8, decode_steps=4, page_size=16,
                          attention_kernel=kernel, **config)
    engine = Engine(preset_source("tiny"), config=cfg)
    try:
        handles = engine.submit_many([SamplingRequest(prompt=p, max_tokens=30, temperature=0.0, stop_token_ids=(),
                                                      ignore_eos=True, n=2) for p in PROMPTS])
        return [h.result(300) for h in handles], engine
    finally:
        engine.close()


def test_the_kernel_decode_gives_the_gather_paths_tokens_and_logprobs() -> None:
    """Greedy, float32, the tiny model: prompts across page boundaries, n = 2 samples sharing their
    prompt's pages, several decode chunks. The kernel decode compiles one program per row bucket
    (no window), and reads and writes the pool the prefill wrote."""
    want, dense = _generate("xla")
    got, paged = _generate("pallas")
    assert isinstance(paged.runner.cache, KernelPool)
    assert {k[2] for k in paged.runner.shapes if k[0] == "decode"} == {0}
    assert {k[2] for k in dense.runner.shapes if k[0] == "decode"} != {0}
    for samples_a, samples_b in zip(got, want, strict=True):
        for a, b in zip(samples_a, samples_b, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_the_memory_plan_lowers_the_in_place_decode_over_the_same_pool() -> None:
    """`arlo plan` with the kernel lowers the decode the engine runs (no window) over a pool of the
    same bytes in the kernels' layout. (Its temporaries here are interpret mode's, which copies each
    layer's pages into the kernel's block; a GPU kernel reads them in place, so no bound on them.)"""
    from services.inference.memory_plan import engine_plan

    base = {"rollout": {"max_episode_tokens": 128}, "inference": {"max_prompt_tokens": 16, "max_tokens": 100,
                                                                  "max_batch": 4, "max_n": 2, "max_seq_len": 128}}
    gather = engine_plan(load_config(overrides=base))
    paged = engine_plan(load_config(overrides={**base, "inference": {**base["inference"], "attention_kernel": "pallas"}}))
    assert paged["decode"]["window"] == 0 < gather["decode"]["window"]
    assert paged["kv_cache_bytes"] == gather["kv_cache_bytes"]
    assert paged["decode"]["temporaries_bytes"] > 0 and paged["decode"]["peak_bytes"] > paged["kv_cache_bytes"]
