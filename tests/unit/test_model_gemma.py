"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers on tiny random checkpoints it writes.

Each checkpoint mixes sliding-window and full layers with a window (6) shorter than the prompts
(20 tokens), so a path that ignored the window would differ. Gemma 2 soft-caps attention and
final logits (caps lowered so tanh bends them), Gemma 3 has QK-norm, its own RoPE base for
sliding layers and linear RoPE scaling on full ones. arlo's logits from the full forward, the
prefill, the per-token KV-cached decode and the engine's buffered decode chunks equal
transformers' within 1e-4 (float32); an export reloads in transformers with the same logits.
Needs the `hf` extra (`pip install -e '.[hf]'`); skipped without it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import KVCache, ModelConfig, get_tokenizer, init_cache
from arlo.model.export import export_hf
from arlo.model.hf import load_hf_model
from arlo.model.kv_cache import write_band
from arlo.model.rope import RopeScaling
from arlo.model.source import check_model_dir
from arlo.model.transformer import abstract_model

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)

WINDOW, T, VOCAB = 6, 20, 264
_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
             max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # Layers slide, attend fully, slide: a remat scan step is one (sliding, full) period plus one layer.
    "gemma2": ("Gemma2Config", dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters=GEMMA3_ROPE, tie_word_embeddings=False,
                                        attention_bias=True)),
}
Split = tuple[nnx.GraphDef, nnx.State]


def _hf_model(name: str) -> Any:
    config_class, extra = CASES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**_BASE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # HF initialises Gemma's norms to 0 (a scale of 1) and biases to 0; move them so their mapping counts.
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, str]:
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, request.param


@pytest.fixture(scope="module")
def split(case: tuple[Any, Path, str]) -> Split:
    return nnx.split(load_hf_model(case[1]))


@pytest.fixture(scope="module")
def reference(case: tuple[Any, Path, str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [2, T], transformers' logits [2, T, V])."""
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, T)).astype(np.int32)
    with torch.no_grad():
        logits = case[0](torch.from_numpy(tokens).long()).logits.numpy()
    return tokens, logits


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


@functools.partial(jax.jit, static_argnums=(0, 5))
def _chunk(graphdef: nnx.GraphDef, state: nnx.State, tokens_bk: jax.Array, base_b: jax.Array, cache: KVCache,
           steps: int) -> tuple[jax.Array, KVCache]:
    """The engine's decode chunk: tokens_bk[:, i] at base_b + i over a read-only cache and a
    `steps`-slot buffer, written back once; returns logits [steps, b, v] and the cache."""
    model = nnx.merge(graphdef, state)
    buf = init_cache(model.cfg, batch=tokens_bk.shape[0], length=steps)

    def step(buf: KVCache, i: jax.Array) -> tuple[KVCache, jax.Array]:
        logits_bv, buf = model.decode_step_buffered(tokens_bk[:, i], base_b + i, base_b, cache, buf, i)
        return buf, logits_bv

    buf, logits_kbv = jax.lax.scan(step, buf, jnp.arange(steps, dtype=jnp.int32))
    return logits_kbv, write_band(cache, buf, jnp.arange(tokens_bk.shape[0], dtype=jnp.int32), base_b)


def _max_diff(ours: Any, theirs: Any) -> float:
    return float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))


def test_config_maps_gemma_features(case: tuple[Any, Path, str]) -> None:
    _, path, name = case
    cfg = ModelConfig.from_hf_dir(path)
    assert (cfg.norm_unit_offset, cfg.embed_scale, cfg.post_norms, cfg.mlp_activation) == (True, True, True,
                                                                                           "gelu_tanh")
    assert (cfg.query_pre_attn_scalar, cfg.sliding_window, cfg.layer_types) == (
        24.0, WINDOW, tuple(CASES[name][1]["layer_types"]))
    if name == "gemma2":
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.qk_norm, cfg.tie_embeddings) == (5.0, 3.0,
                                                                                                     False, True)
        assert cfg.rope_local_theta is None
    else:
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.qk_norm, cfg.tie_embeddings) == (None, None,
                                                                                                     True, False)
        assert (cfg.qkv_bias, cfg.o_bias, cfg.rope_theta, cfg.rope_local_theta) == (True, True, 1e6, 1e4)
        assert cfg.rope_scaling == RopeScaling(kind="linear", factor=2.0, original_max_seq_len=64)


def test_full_forward_matches(split: Split, reference: tuple[np.ndarray, np.ndarray],
                              case: tuple[Any, Path, str]) -> None:
    tokens, theirs = reference
    ours = _forward(*split, jnp.asarray(tokens))
    assert ours.shape == theirs.shape and _max_diff(ours, theirs) < 1e-4
    # The prompts are long enough for the window to matter: every layer attending fully differs.
    unwindowed = load_hf_model(case[1], layer_types=("full_attention",) * 3)
    assert _max_diff(_forward(*nnx.split(unwindowed), jnp.asarray(tokens)), theirs) > 1e-2


def test_training_remat_matches(split: Split, reference: tuple[np.ndarray, np.ndarray]) -> None:
    """The remat scan steps over the layer kinds' period: same hidden states and gradients."""
    tokens = jnp.asarray(reference[0])
    graphdef, state = split

    def loss(state: nnx.State, remat: str) -> jax.Array:
        return jnp.mean(nnx.merge(graphdef, state).hidden(tokens, remat=remat) ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    plain, plain_grad = value_and_grad(state, "none")
    value, grad = value_and_grad(state, "full")
    assert abs(float(value) - float(plain)) < 1e-5
    assert max(jax.tree.leaves(jax.tree.map(_max_diff, grad, plain_grad))) < 1e-5


def test_prefill_and_cached_decode_match(split: Split, reference: tuple[np.ndarray, np.ndarray]) -> None:
    """Rows prefilled to different lengths, both past the window, then one token per step."""
    tokens, theirs = reference
    lengths = np.array([9, 13], np.int32)
    padded = np.where(np.arange(T)[None] < lengths[:, None], tokens, 0)
    cache = init_cache(nnx.merge(*split).cfg, batch=2, length=24)
    logits_bv, cache = _prefill(*split, jnp.asarray(padded), jnp.asarray(lengths), cache)
    for row in range(2):
        assert _max_diff(logits_bv[row], theirs[row, lengths[row] - 1]) < 1e-4
    pos = lengths.copy()
    while pos.max() < T:
        step_pos = np.minimum(pos, T - 1)
        logits_bv, cache = _decode(*split, jnp.asarray(tokens[np.arange(2), step_pos]), jnp.asarray(step_pos), cache)
        for row in range(2):
            if pos[row] < T:
                assert _max_diff(logits_bv[row], theirs[row, pos[row]]) < 1e-4, (row, pos[row])
        pos += 1


@pytest.mark.parametrize("steps", [4, 8], ids=["chunk-under-window", "chunk-over-window"])
def test_buffered_decode_chunks_match(split: Split, reference: tuple[np.ndarray, np.ndarray], steps: int) -> None:
    """decode_step_buffered (the engine's path) over two chunks: the second reads what the first
    wrote back; a chunk longer than the window masks the buffer's own old slots too."""
    tokens, theirs = reference
    lengths = np.array([3, 7], np.int32)
    padded = np.where(np.arange(T)[None] < lengths[:, None], tokens, 0)
    cache = init_cache(nnx.merge(*split).cfg, batch=2, length=32)
    _, cache = _prefill(*split, jnp.asarray(padded), jnp.asarray(lengths), cache)
    base = lengths.copy()
    for _ in range(2):
        cols = np.minimum(base[:, None] + np.arange(steps), T - 1)
        logits_kbv, cache = _chunk(*split, jnp.asarray(np.take_along_axis(tokens, cols, axis=1)),
                                   jnp.asarray(base), cache, steps)
        for row in range(2):
            for i in range(steps):
                if base[row] + i < T:
                    assert _max_diff(logits_kbv[i, row], theirs[row, base[row] + i]) < 1e-4, (row, base[row] + i)
        base = base + steps


def test_export_reloads_in_transformers(split: Split, reference: tuple[np.ndarray, np.ndarray],
                                        case: tuple[Any, Path, str], tmp_path: Path) -> None:
    _, path, name = case
    cfg = nnx.merge(*split).cfg
    base = json.loads((path / "config.json").read_text())
    out = tmp_path / "export"
    export_hf(split[1], cfg, out, tokenizer=get_tokenizer("byte"), base_config=base)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[name]
    tokens, theirs = reference
    with torch.no_grad():
        reloaded = hf(torch.from_numpy(tokens).long()).logits.numpy()
    assert _max_diff(reloaded, theirs) < 1e-4
    assert ModelConfig.from_hf_dir(out) == cfg  # and back into arlo, field for field


def test_legacy_gemma3_config_layout_maps_alike() -> None:
    """transformers 4.x wrote rope_theta, rope_local_base_freq, rope_scaling (full layers only)
    and sliding_window_pattern instead of rope_parameters per layer type and layer_types."""
    legacy = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=WINDOW,
                  sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16)
    cfg = ModelConfig.from_hf_config(legacy)
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (
        1e6, 1e4, "linear", 8.0)
    assert (cfg.qk_norm, cfg.tie_embeddings, cfg.attn_logit_softcap) == (True, True, None)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert list(cfg.layer_types) == hf.layer_types


def test_presets_keep_their_parameter_tree() -> None:
    """Gemma's parts are parameters only when enabled: a Llama/Qwen preset has none of them."""
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(abstract_model(ModelConfig.named("tiny"))))}
    assert not any("post_" in n for n in names)
    assert len(names) == 2 + 2 * 9  # embedding, final norm; per layer 2 norms, q/k/v/o, 3 MLP


_GEMMA2_JSON = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=VOCAB, hidden_size=32,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=64)
_GEMMA3_JSON = {**_GEMMA2_JSON, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}


@pytest.mark.parametrize(("hf", "field"), [
    (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], text_config=_GEMMA3_JSON,
          vision_config={"model_type": "siglip_vision_model"}), "vision_config"),
    ({**_GEMMA2_JSON, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({**_GEMMA3_JSON, "quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({**_GEMMA3_JSON, "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
     r"rope_type: 'dynamic'"),
    ({**_GEMMA2_JSON, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"rope_type: 'longrope'"),
    ({**_GEMMA3_JSON, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"sliding_attention\.rope_type"),
    ({**_GEMMA2_JSON, "hidden_activation": "relu"}, "hidden_activation"),
    ({**_GEMMA3_JSON, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**_GEMMA2_JSON, "layer_types": ["sliding_attention"]}, "layer_types"),
    ({**_GEMMA2_JSON, "sliding_window": 0}, "sliding_window"),
], ids=["vision", "quantized-gemma2", "quantized-gemma3", "rope-dynamic", "rope-longrope", "local-rope-scaled",
        "activation", "bidirectional", "layer-types", "window"])
def test_unimplemented_fields_are_config_errors_naming_field_and_file(hf: dict[str, Any], field: str,
                                                                      tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    file = str(tmp_path / "config.json")
    with pytest.raises(ValueError, match=field) as error:
        ModelConfig.from_hf_dir(tmp_path)
    assert str(error.value).startswith(file)
    with pytest.raises(ValueError, match=field) as error:
        check_model_dir(tmp_path)  # what model.path goes through at config load, before any service
    assert str(error.value).startswith(file)


def test_chat_template_renders_as_transformers(tmp_path: Path) -> None:
    from arlo.model.hf_tokenizer import HFTokenizer
    from tests.support.hf_checkpoints import write_tokenizer

    chat = [("system", "be brief"), ("user", "What is 12*7?"), ("assistant", "84"), ("user", "calc 12*7")]
    for family in ("gemma2", "gemma3"):
        write_tokenizer(tmp_path / family, family)
        ref = transformers.AutoTokenizer.from_pretrained(tmp_path / family)
        ours = HFTokenizer.from_dir(tmp_path / family)
        messages = chat[1:] if family == "gemma2" else chat  # Gemma 2's template refuses a system turn
        expected = ref.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.encode_messages(messages, add_generation_prompt=True, add_bos=True) == list(expected)
        text = ours.render_messages(messages, add_generation_prompt=True, add_bos=True)
        assert "<start_of_turn>model\n84<end_of_turn>\n" in text and text.endswith("<start_of_turn>model\n")
        assert ours.stop_token_ids[0] == ours.encode("<end_of_turn>")[0]
