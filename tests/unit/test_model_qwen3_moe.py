"""arlo's Qwen3-MoE against Hugging Face transformers (PyTorch CPU) on tiny random checkpoints.

transformers writes the checkpoint (8 experts, top-2, a dense layer among routed ones), arlo
loads it: the full forward, prefill, KV-cached decode and the engine's buffered decode give
transformers' logits within 1e-4 in float32; the router's choices are transformers' top-k;
the load-balancing loss is transformers' `aux_loss`; the export reloads in transformers with
the same logits; replayed experts are the ones used. Needs the `hf` extra; skipped without it.
"""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import KVCache, ModelConfig, init_cache
from arlo.model.export import export_hf
from arlo.model.hf import INDEX_FILE, load_hf_model
from arlo.model.kv_cache import write_band
from arlo.model.moe import MoE, load_balancing_loss
from arlo.model.tokenizer import get_tokenizer
from tests.support.fake_devices import run_on_fake_devices

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)

VOCAB = 264  # the byte tokenizer's ids fit, so the export's own tokenizer files match the model
_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
             num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
CASES: dict[str, dict[str, Any]] = {
    # Layer 1 dense (mlp_only_layers), renormalised top-k, saved in shards.
    "norm-topk-dense-layer": dict(norm_topk_prob=True, mlp_only_layers=[1]),
    # Every second layer routed (decoder_sparse_step), raw top-k probabilities.
    "sparse-step": dict(norm_topk_prob=False, decoder_sparse_step=2),
}
STEPS = 4


def _hf_model(extra: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**_BASE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # HF initialises norms to 1; perturb them so their mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, str]:
    model = _hf_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    sharded = request.param.startswith("norm")
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "1GB")
    assert (path / INDEX_FILE).is_file() == sharded
    return model, path, request.param


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(tokens_bt)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array, lengths_b: jax.Array,
             cache: KVCache) -> tuple[jax.Array, KVCache]:
    return nnx.merge(graphdef, state).prefill(tokens_bt, lengths_b, cache)


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef: nnx.GraphDef, state: nnx.State, tokens_b: jax.Array, positions_b: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    return nnx.merge(graphdef, state).decode_step(tokens_b, positions_b, cache)


@functools.partial(jax.jit, static_argnums=0)
def _chunk(graphdef: nnx.GraphDef, state: nnx.State, tokens_bk: jax.Array, base_b: jax.Array,
           cache: KVCache) -> tuple[jax.Array, KVCache]:
    """The engine's chunked decode: tokens_bk[:, i] at base_b + i, over a read-only cache."""
    model = nnx.merge(graphdef, state)
    buf = init_cache(model.cfg, batch=tokens_bk.shape[0], length=STEPS)

    def step(buf: KVCache, i: jax.Array) -> tuple[KVCache, jax.Array]:
        logits_bv, buf = model.decode_step_buffered(tokens_bk[:, i], base_b + i, base_b, cache, buf, i)
        return buf, logits_bv

    buf, logits_kbv = jax.lax.scan(step, buf, jnp.arange(STEPS, dtype=jnp.int32))
    return logits_kbv, write_band(cache, buf, jnp.arange(tokens_bk.shape[0], dtype=jnp.int32), base_b)


def _tokens(b: int, t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (b, t)).astype(np.int32)


def _hf_logits(hf_model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens).long()).logits.numpy()


def _close(ours: Any, ref: np.ndarray) -> None:
    ours = np.asarray(ours)
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) < 1e-4, np.max(np.abs(ours - ref))


def test_config_maps_the_experts(case: tuple[Any, Path, str]) -> None:
    _, path, name = case
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.moe is not None and cfg.qk_norm
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.mlp_dim) == (8, 2, 16)
    routed = [cfg.moe.routed(i) for i in range(cfg.num_layers)]
    assert routed == ([True, False, True] if name.startswith("norm") else [False, True, False])
    model = load_hf_model(path)
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == routed
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_full_forward_matches(case: tuple[Any, Path, str]) -> None:
    hf_model, path, _ = case
    tokens = _tokens(2, 24, seed=1)
    _close(_forward(*nnx.split(load_hf_model(path)), tokens), _hf_logits(hf_model, tokens))


def test_prefill_and_cached_decode_match(case: tuple[Any, Path, str]) -> None:
    """Right-padded rows of different lengths: prefill's last-token logits, then decode steps."""
    hf_model, path, _ = case
    model = load_hf_model(path)
    split = nnx.split(model)
    tokens = _tokens(2, 16, seed=2)
    ref = _hf_logits(hf_model, tokens)
    lengths = np.array([5, 9], np.int32)
    padded = np.where(np.arange(16)[None] < lengths[:, None], tokens, 0)
    cache = init_cache(model.cfg, batch=2, length=16)
    logits_bv, cache = _prefill(*split, padded, lengths, cache)
    _close(logits_bv, ref[[0, 1], lengths - 1])
    for i in range(STEPS):
        positions = lengths + i
        logits_bv, cache = _decode(*split, tokens[[0, 1], positions], positions, cache)
        _close(logits_bv, ref[[0, 1], positions])


def test_buffered_decode_matches(case: tuple[Any, Path, str]) -> None:
    hf_model, path, _ = case
    model = load_hf_model(path)
    split = nnx.split(model)
    tokens = _tokens(2, 16, seed=3)
    ref = _hf_logits(hf_model, tokens)
    lengths = np.array([3, 6], np.int32)
    padded = np.where(np.arange(16)[None] < lengths[:, None], tokens, 0)
    _, cache = _prefill(*split, padded, lengths, init_cache(model.cfg, batch=2, length=16))
    base = lengths
    for _ in range(2):  # the second chunk reads what the first wrote back
        cols = base[:, None] + np.arange(STEPS)
        logits_kbv, cache = _chunk(*split, np.take_along_axis(tokens, cols, axis=1), base, cache)
        _close(np.transpose(np.asarray(logits_kbv), (1, 0, 2)), np.take_along_axis(ref, cols[..., None], axis=1))
        base = base + STEPS


def test_routing_and_aux_loss_match_transformers(case: tuple[Any, Path, str]) -> None:
    hf_model, path, _ = case
    model = load_hf_model(path)
    tokens = _tokens(2, 12, seed=4)
    h, routings = jax.jit(lambda m, t: m.hidden_routed(t))(model, tokens)
    _close(model.logits_from_hidden(h), _hf_logits(hf_model, tokens))
    with torch.no_grad():
        out = hf_model(torch.from_numpy(tokens).long(), output_router_logits=True)
    assert len(routings) == len(out.router_logits)
    for routing, logits in zip(routings, out.router_logits, strict=True):
        ref = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices.numpy()
        assert (np.sort(np.asarray(routing.experts_btk).reshape(-1, 2), -1) == np.sort(ref, -1)).all()
    assert abs(float(load_balancing_loss(routings)) - float(out.aux_loss)) < 1e-5


def test_replayed_experts_are_used(case: tuple[Any, Path, str]) -> None:
    """Replaying the recorded experts reproduces the forward; other experts change it, and the
    routing returned is the replayed one."""
    _, path, _ = case
    model = load_hf_model(path)
    tokens = _tokens(2, 10, seed=5)
    routed = jax.jit(lambda m, t, e: m.hidden_routed(t, experts_lbtk=e))
    h, routings = routed(model, tokens, None)
    recorded = jnp.stack([r.experts_btk for r in routings])
    assert recorded.shape == (len(routings), 2, 10, 2)
    h_replay, again = routed(model, tokens, recorded)
    np.testing.assert_array_equal(np.asarray(h_replay), np.asarray(h))
    other = (recorded + 1) % 8
    h_other, used = routed(model, tokens, other)
    np.testing.assert_array_equal(np.asarray(jnp.stack([r.experts_btk for r in used])), np.asarray(other))
    assert np.max(np.abs(np.asarray(h_other - h))) > 1e-3


def test_grouped_and_dense_experts_agree() -> None:
    """The ragged_dot path (GPU/TPU's) and the dense one (CPU's default) compute the same outputs
    and gradients: the reference tests above run the dense one on CPU, this holds the grouped one
    to it (JAX's ragged_dot fallback runs on CPU, slowly)."""
    from arlo.model.config import MoeShape

    cfg = ModelConfig(vocab_size=VOCAB, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=48,
                      max_seq_len=64, moe=MoeShape(num_experts=8, top_k=2, mlp_dim=16, norm_topk_prob=True))
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 32))

    def loss(moe: MoE, x: jax.Array, grouped: bool) -> jax.Array:
        moe.grouped = grouped
        return jnp.sum(jnp.sin(moe(x)))

    values = {g: nnx.jit(nnx.value_and_grad(loss), static_argnums=2)(moe, x, g) for g in (True, False)}
    np.testing.assert_allclose(float(values[True][0]), float(values[False][0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(values[True][1]), jax.tree.leaves(values[False][1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_remat_keeps_the_numbers(case: tuple[Any, Path, str]) -> None:
    _, path, _ = case
    model = load_hf_model(path)
    tokens = _tokens(2, 8, seed=6)
    plain = jax.jit(lambda m, t: m.hidden(t))(model, tokens)
    full = jax.jit(lambda m, t: m.hidden(t, remat="full"))(model, tokens)
    np.testing.assert_allclose(np.asarray(full), np.asarray(plain), atol=1e-5)
    h, _ = jax.jit(lambda m, t: m.hidden_routed(t, remat="dots"))(model, tokens)
    np.testing.assert_allclose(np.asarray(h), np.asarray(plain), atol=1e-5)


def test_export_reloads_in_transformers(case: tuple[Any, Path, str], tmp_path: Path) -> None:
    hf_model, path, _ = case
    model = load_hf_model(path)
    export_hf(nnx.split(model)[1], model.cfg, tmp_path / "out", tokenizer=get_tokenizer("byte"),
              max_shard_bytes=1 << 16)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    tokens = _tokens(2, 12, seed=7)
    _close(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens))
    assert ModelConfig.from_hf_dir(tmp_path / "out") == model.cfg


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("mlp_only_layers", [5], "mlp_only_layers"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"),
])
def test_bad_moe_fields_name_the_field(field: str, value: Any, needle: str) -> None:
    hf = {**_BASE, "model_type": "qwen3_moe", field: value}
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_config(hf)


SHARDED_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from arlo.config import MeshConfig
    from arlo.distributed import make_mesh
    from arlo.model import ModelConfig, create_model
    from arlo.model.config import MoeShape
    from arlo.model.moe import load_balancing_loss
    from arlo.model.sharding import batch_sharding, fitted_state_shardings

    assert jax.device_count() == 8
    cfg = ModelConfig(vocab_size=264, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=48,
                      max_seq_len=64, qk_norm=True, tie_embeddings=False,
                      moe=MoeShape(num_experts=8, top_k=2, mlp_dim=16, norm_topk_prob=True, dense_layers=(1,)))
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    tokens = np.random.default_rng(0).integers(0, 264, (4, 16)).astype(np.int32)

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        h, routings = model.hidden_routed(tokens)
        return model.logits_from_hidden(h), jnp.stack([r.experts_btk for r in routings]), load_balancing_loss(routings)

    ref = run(state, tokens)
    for sizes in [(1, 8, 1), (2, 2, 2)]:
        mesh = make_mesh(MeshConfig(axis_names=("data", "expert", "tensor"), axis_sizes=sizes))
        sharded = jax.device_put(state, fitted_state_shardings(state, mesh))
        gate = sharded["layers"][0]["mlp"]["gate_edf"][...]
        assert gate.sharding.spec[0] == "expert", gate.sharding
        assert gate.addressable_shards[0].data.shape[0] == 8 // sizes[1], gate.addressable_shards[0].data.shape
        out = run(sharded, jax.device_put(tokens, batch_sharding(mesh, 4, rows_dim=0, ndim=2)))
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
        np.testing.assert_allclose(float(out[2]), float(ref[2]), atol=1e-6)
    print("ok")
""")


LEARNER_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from arlo.config import MeshConfig, TrainerConfig
    from arlo.distributed import make_mesh
    from arlo.model import ModelConfig
    from arlo.model.config import MoeShape
    from arlo.model.source import ModelSource
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner
    from tests.unit.test_trainer_learner import random_groups

    assert jax.device_count() == 8
    cfg = ModelConfig(vocab_size=264, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=48,
                      max_seq_len=64, qk_norm=True, tie_embeddings=False,
                      moe=MoeShape(num_experts=8, top_k=2, mlp_dim=16, norm_topk_prob=True, dense_layers=(1,)))
    tc = TrainerConfig(router_aux_loss_coef=0.01)
    batch = build_batch(random_groups(2, 4), 256, 256)
    mesh = make_mesh(MeshConfig(axis_names=("data", "expert", "tensor"), axis_sizes=(2, 4, 1)))
    plain = Learner(ModelSource.from_config(cfg, seed=0), cfg=tc)
    sharded = Learner(ModelSource.from_config(cfg, seed=0), cfg=tc, mesh=mesh)
    assert sharded.state["layers"][0]["mlp"]["up_edf"][...].sharding.spec[0] == "expert"
    a, b = plain.step(batch), sharded.step(batch)
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.grad_norm, b.grad_norm, rtol=1e-4)
    np.testing.assert_allclose(a.extra["router_aux_loss"], b.extra["router_aux_loss"], rtol=1e-5)
    print("ok")
""")


@pytest.mark.timeout(660)
def test_expert_parallel_forward_matches_one_device() -> None:
    """Experts sharded over an 'expert' mesh axis (alone, and beside data and tensor axes) on 8
    fake CPU devices: the same logits, routing and load-balancing loss as unsharded. XLA reads
    its flags when JAX starts, so this runs in a fresh interpreter."""
    _run_on_8_devices(SHARDED_SCRIPT)


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_expert_parallel_learner_matches_one_device() -> None:
    """The learner on a data 2 x expert 4 mesh takes the unsharded RL step (loss, gradient norm,
    load-balancing loss); minutes on 2 CPU cores, so in the slow tier."""
    _run_on_8_devices(LEARNER_SCRIPT)


def _run_on_8_devices(script: str) -> None:
    out = run_on_fake_devices(script, timeout_s=600)
    assert out.strip().endswith("ok"), out[-2000:]
