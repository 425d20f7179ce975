"""Load a Hugging Face Llama/Qwen/Gemma checkpoint directory from local disk (no hub access).

A directory holds `config.json` and `model.safetensors`, or shards listed by
`model.safetensors.index.json`. HF linear weights are [out, in]; ours are [in, ...] with
heads split out (q_dnh, o_nhd), so loading transposes and reshapes. HF checkpoints already
use the rotate-half RoPE layout (rope.py), so q/k need no permutation.

Tensors are read one at a time (memory-mapped, through the safetensors library), widened to
float32 (our parameter dtype) on the host, and placed where the `like` state says, so a
model larger than one device's memory can load straight into a sharded layout.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from arlo.model.config import ModelConfig
from arlo.model.transformer import Transformer, abstract_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; recomputed here from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Convert = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class TensorMap:
    """One HF tensor <-> one of our parameters (flat key as in arlo.model.weights)."""

    hf_name: str
    key: str
    to_ours: Convert
    to_hf: Convert
    expert: int | None = None
    """Set when the HF tensor is one expert's slice (axis 0) of our stacked expert parameter."""

    def part(self, ours: np.ndarray) -> np.ndarray:
        """The slice of our parameter this HF tensor holds."""
        return ours if self.expert is None else ours[self.expert]

    def part_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return ours if self.expert is None else ours[1:]


def load_hf_model(path: str | Path, **overrides: Any) -> Transformer:
    """The model in `path`; `overrides` replace ModelConfig fields (e.g. dtype="bfloat16")."""
    cfg = ModelConfig.from_hf_dir(path, **overrides)
    graphdef, like = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, load_hf_state(path, cfg, like))


def load_hf_state(path: str | Path, cfg: ModelConfig, like: nnx.State) -> nnx.State:
    """The checkpoint's parameters as a state shaped like `like` (real or abstract, e.g.
    `nnx.split(abstract_model(cfg))[1]`), keeping its variable metadata and, where `like`
    carries shardings, placing each array accordingly. Raises FileNotFoundError naming a
    missing file, ValueError naming a missing, unexpected or mis-shaped tensor."""
    files = tensor_files(path)
    maps: dict[str, list[TensorMap]] = {}
    for m in tensor_maps(cfg):
        maps.setdefault(m.key, []).append(m)
    _check_names(files, maps, cfg)
    flat = list(nnx.to_flat_state(like))
    with _open_files(sorted(set(files.values()))) as handles:
        restored = []
        for var_path, var in flat:
            key = "/".join(str(p) for p in var_path)
            if key not in maps:
                raise ValueError(f"{path}: no HF tensor maps to parameter {key!r} (config and model disagree)")
            like_value = var.get_value()
            parts = [_read(handles[files[m.hf_name]], m, like_value, files[m.hf_name]) for m in maps[key]]
            array = parts[0] if maps[key][0].expert is None else np.stack(parts)  # experts in order
            restored.append((var_path, var.copy(_place(array, like_value))))
    return nnx.from_flat_state(restored)


def state_to_hf_tensors(state: nnx.State, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters under HF names and layouts (float32): the inverse of loading."""
    values = {"/".join(str(p) for p in path): var.get_value() for path, var in nnx.to_flat_state(state)}
    return {m.hf_name: np.ascontiguousarray(m.to_hf(m.part(np.asarray(jax.device_get(values[m.key]), np.float32))))
            for m in tensor_maps(cfg)}


def tensor_files(path: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (expected a Hugging Face model directory)")
    index = root / INDEX_FILE
    if index.is_file():
        return _from_index(index)
    single = root / SINGLE_FILE
    shards = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not shards:
        found = ", ".join(sorted(p.name for p in root.iterdir())) or "nothing"
        hint = "; PyTorch .bin weights are not read, convert them to safetensors" \
            if any(root.glob("*.bin")) else ""
        raise FileNotFoundError(f"{root}: missing {SINGLE_FILE} (or {INDEX_FILE} with its shards); "
                                f"found {found}{hint}")
    names: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            names.update(dict.fromkeys(f.keys(), shard))
    return names


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """Every parameter of a model with `cfg`, with its HF name and layout conversions."""
    d, n, k, h = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    maps = [TensorMap("model.embed_tokens.weight", "embedder/table_vd", _same, _same),
            TensorMap("model.norm.weight", "final_norm/scale", _same, _same)]
    if not cfg.tie_embeddings:
        maps.append(TensorMap("lm_head.weight", "lm_head_dv", _t, _t))
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers/{i}/"
        attn, a = hf + "self_attn.", ours + "attn/"
        maps += [
            *_norm_maps(cfg, hf, ours),
            TensorMap(attn + "q_proj.weight", a + "q_dnh", *_in_proj(d, n, h)),
            TensorMap(attn + "k_proj.weight", a + "k_dkh", *_in_proj(d, k, h)),
            TensorMap(attn + "v_proj.weight", a + "v_dkh", *_in_proj(d, k, h)),
            TensorMap(attn + "o_proj.weight", a + "o_nhd", *_out_proj(d, n, h)),
        ]
        maps += _mlp_maps(cfg, i)
        if cfg.qkv_bias:
            maps += [TensorMap(attn + "q_proj.bias", a + "q_bias_nh", *_heads(n, h)),
                     TensorMap(attn + "k_proj.bias", a + "k_bias_kh", *_heads(k, h)),
                     TensorMap(attn + "v_proj.bias", a + "v_bias_kh", *_heads(k, h))]
        if cfg.o_bias:
            maps.append(TensorMap(attn + "o_proj.bias", a + "o_bias_d", _same, _same))
        if cfg.qk_norm:
            maps += [TensorMap(attn + "q_norm.weight", a + "q_norm/scale", _same, _same),
                     TensorMap(attn + "k_norm.weight", a + "k_norm/scale", _same, _same)]
    return maps


def _mlp_maps(cfg: ModelConfig, i: int) -> list[TensorMap]:
    """Layer i's MLP: dense, or (Qwen3-MoE) the router `mlp.gate` and one HF tensor per expert
    and projection, each a slice of our stacked [E, ...] expert parameters (moe.py)."""
    hf, ours = f"model.layers.{i}.mlp.", f"layers/{i}/mlp/"
    if cfg.moe is None or not cfg.moe.routed(i):
        return [TensorMap(hf + "gate_proj.weight", ours + "gate_df", _t, _t),
                TensorMap(hf + "up_proj.weight", ours + "up_df", _t, _t),
                TensorMap(hf + "down_proj.weight", ours + "down_fd", _t, _t)]
    maps = [TensorMap(hf + "gate.weight", ours + "router_de", _t, _t)]
    for name, key in (("gate_proj", "gate_edf"), ("up_proj", "up_edf"), ("down_proj", "down_efd")):
        maps += [TensorMap(f"{hf}experts.{e}.{name}.weight", ours + key, _t, _t, expert=e)
                 for e in range(cfg.moe.num_experts)]
    return maps


def _norm_maps(cfg: ModelConfig, hf: str, ours: str) -> list[TensorMap]:
    """A layer's RMSNorm scales. HF stores Gemma's (1 + w) norms as w, as we do (RMSNorm
    unit_offset); Gemma's post_attention_layernorm is the norm after attention, its
    pre_feedforward_layernorm the one before the MLP (Llama's post_attention_layernorm)."""
    if not cfg.post_norms:
        return [TensorMap(hf + "input_layernorm.weight", ours + "attn_norm/scale", _same, _same),
                TensorMap(hf + "post_attention_layernorm.weight", ours + "mlp_norm/scale", _same, _same)]
    names = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
             ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm"))
    return [TensorMap(f"{hf}{theirs}.weight", f"{ours}{mine}/scale", _same, _same) for theirs, mine in names]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _t(x: np.ndarray) -> np.ndarray:
    return x.T


def _in_proj(d: int, heads: int, h: int) -> tuple[Convert, Convert]:
    return (lambda w: w.T.reshape(d, heads, h)), (lambda w: w.reshape(d, heads * h).T)


def _out_proj(d: int, heads: int, h: int) -> tuple[Convert, Convert]:
    return (lambda w: w.T.reshape(heads, h, d)), (lambda w: w.reshape(heads * h, d).T)


def _heads(heads: int, h: int) -> tuple[Convert, Convert]:
    return (lambda b: b.reshape(heads, h)), (lambda b: b.reshape(heads * h))


def _from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
    files = {name: index.parent / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}: missing; {index.name} lists it as a shard")
    return files


def _check_names(files: dict[str, Path], maps: dict[str, list[TensorMap]], cfg: ModelConfig) -> None:
    wanted = {m.hf_name for ms in maps.values() for m in ms}
    missing = sorted(wanted - files.keys())
    if missing:
        raise ValueError(f"checkpoint: missing tensor {missing[0]!r} ({len(missing)} missing; "
                         f"does config.json match the weights?)")
    # A tied model may still carry lm_head.weight (HF ignores it then; so do we).
    allowed = wanted | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    extra = sorted(n for n in files.keys() - allowed if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"checkpoint: unexpected tensor {extra[0]!r} in {files[extra[0]].name} "
                         f"({len(extra)} unexpected): an architecture part this decoder does not implement")


@contextlib.contextmanager
def _open_files(paths: list[Path]) -> Iterator[dict[Path, Any]]:
    with contextlib.ExitStack() as stack:
        yield {p: stack.enter_context(_TensorFile(p)) for p in paths}


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class _TensorFile:
    """A safetensors file read one tensor at a time with plain reads, not a memory map: the
    pages of a mapped file stay resident (and count in RSS) until it is closed, so mapping a
    checkpoint holds its whole size on the host on top of the loaded state (measured: 2.9x
    the model's bytes at peak; read this way ~1x, see bench/load_memory.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("rb")
        try:
            size = int.from_bytes(self._file.read(8), "little")
            self._header = json.loads(self._file.read(size))
        except (ValueError, UnicodeDecodeError) as e:
            self._file.close()
            raise ValueError(f"{path}: not a safetensors file ({e})") from e
        self._base = 8 + size

    def __enter__(self) -> _TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def tensor(self, name: str) -> np.ndarray:
        entry = self._header[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}; expected one of {sorted(_DTYPES)}")
        start, end = entry["data_offsets"]
        self._file.seek(self._base + start)
        data = self._file.read(end - start)
        return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])


def _read(handle: _TensorFile, m: TensorMap, like: Any, file: Path) -> np.ndarray:
    """The tensor in our layout, float32, after checking its HF shape against `like`'s."""
    expected = jax.eval_shape(m.to_hf, jax.ShapeDtypeStruct(m.part_shape(tuple(like.shape)), np.float32)).shape
    found = handle.shape(m.hf_name)
    if found != expected:
        raise ValueError(f"checkpoint: {m.hf_name!r} in {file.name} has shape {list(found)}, expected "
                         f"{list(expected)} for parameter {m.key!r} (does config.json match the weights?)")
    return m.to_ours(handle.tensor(m.hf_name).astype(np.float32))


def _place(array: np.ndarray, like: Any) -> jax.Array:
    array = np.ascontiguousarray(array, dtype=like.dtype)
    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if isinstance(sharding, jax.sharding.Sharding) else jax.device_put(array)
