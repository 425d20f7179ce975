"""Where a run's model comes from: a named preset (random init from a seed) or a local
Hugging Face checkpoint directory. Resolved once into a `ModelSource`, which inference,
trainer, rollout, evaluation, SFT and export all use, so they agree on the decoder shape,
the tokenizer, its chat template and stop ids, and version 0's weights.

`check_model_dir` is what config load calls: every file a service will read is checked
before any service starts, and errors name the config field and the file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model.config import LoraShape, ModelConfig, sequence_length
from arlo.model.hf import INDEX_FILE, SINGLE_FILE, load_hf_state
from arlo.model.hf_config import CONFIG_FILE, SUPPORTED_MODEL_TYPES, read_hf_config
from arlo.model.lora import merge_states, split_adapters
from arlo.model.tokenizer import Tokenizer, get_tokenizer, tokenizer_name
from arlo.model.transformer import abstract_model, create_model

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    cfg: ModelConfig
    """The decoder's shape, with the run's compute dtype and sequence cap applied."""
    checkpoint: Path | None
    """HF directory whose safetensors are version 0; None: random init from `seed`."""
    tokenizer_name: str
    """"byte" or the HF directory holding tokenizer.json (see arlo.model.tokenizer.get_tokenizer)."""
    seed: int
    name: str = ""
    """What GetModelInfo reports: the preset's name or the checkpoint's directory."""
    param_dtype: str = "float32"
    """Dtype of the stored (served and published) parameters; the trainer's master copy is float32."""

    @classmethod
    def from_config(cls, cfg: ModelConfig, *, seed: int = 0, param_dtype: str = "float32") -> ModelSource:
        """A random init of `cfg` from `seed` with the byte tokenizer (tests and benches)."""
        return cls(cfg=cfg, checkpoint=None, tokenizer_name="byte", seed=seed, param_dtype=param_dtype)

    @property
    def tokenizer_dir(self) -> Path | None:
        return None if self.tokenizer_name == "byte" else Path(self.tokenizer_name)

    def tokenizer(self) -> Tokenizer:
        return get_tokenizer(self.tokenizer_name)

    def base_config(self) -> dict[str, Any] | None:
        """The checkpoint's own config.json (export keeps its token ids and names)."""
        return read_hf_config(self.checkpoint) if self.checkpoint is not None else None

    def abstract_state(self, dtype: str | None = None) -> nnx.State:
        """Shapes and dtypes of the parameters, floats in `dtype` (default: param_dtype)."""
        return cast_state(nnx.split(abstract_model(self.cfg))[1], dtype or self.param_dtype)

    def initial_state(self, shardings: Any = None, *, dtype: str | None = None) -> nnx.State:
        """Version 0's parameters in `dtype` (default: param_dtype), placed by `shardings` (a
        state-shaped tree of shardings, or a device) if given. A checkpoint is read tensor by
        tensor straight into that placement, so a process never holds a second full copy and
        each device receives only its shard."""
        dtype = dtype or self.param_dtype
        if self.checkpoint is None:
            state = cast_state(nnx.split(create_model(self.cfg, self.seed))[1], dtype)
            return state if shardings is None else jax.device_put(state, shardings)
        like = self.abstract_state(dtype)
        if shardings is not None:
            like = _with_shardings(like, shardings)
        if self.cfg.lora is None:
            return load_hf_state(self.checkpoint, self.cfg, like)
        # The checkpoint holds the base; the adapters start fresh (B = 0: the base's function).
        like_adapters, like_base = split_adapters(like)
        adapters = initial_adapters(self.cfg, self.seed, dtype)
        if shardings is not None:
            adapters = jax.device_put(adapters, jax.tree.map(lambda x: x.sharding, like_adapters))
        return merge_states(load_hf_state(self.checkpoint, self.cfg, like_base), adapters)


def initial_adapters(cfg: ModelConfig, seed: int, dtype: str) -> nnx.State:
    """The adapters `create_model(cfg, seed)` would make, without materialising the base: under
    jit, the base's initialisers feed no output and XLA drops them."""

    @jax.jit
    def make() -> nnx.State:
        return cast_state(split_adapters(nnx.split(create_model(cfg, seed))[1])[0], dtype)

    return make()


def cast_state(state: nnx.State, dtype: str) -> nnx.State:
    """`state` with its floating arrays (or ShapeDtypeStructs) in `dtype`; others unchanged.
    float32 -> bfloat16 rounds to nearest even, on the device as on the host (ml_dtypes), so
    the trainer's cast of its master copy and inference's load of the checkpoint agree bit for bit."""
    target = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
        return x.astype(target)

    return jax.tree.map(cast, state)


def preset_source(name: str = "tiny", *, seed: int = 0, dtype: str = "float32",
                  param_dtype: str = "float32", tokenizer: str = "byte") -> ModelSource:
    """A preset's source (tests and benches): `resolve_model` without a checkpoint."""
    return resolve_model(name=name, path="", tokenizer=tokenizer, seed=seed, dtype=dtype, param_dtype=param_dtype)


def resolve_model(*, name: str, path: str, tokenizer: str, seed: int, dtype: str = "float32",
                  param_dtype: str = "float32", max_seq_len: int = 0, lora: LoraShape | None = None) -> ModelSource:
    """`path` (an HF directory) wins over the preset `name`; its tokenizer is the directory's
    own unless `tokenizer` names another. `max_seq_len` > 0 sets a preset's sequence length
    (raising it too: a preset is a random init with RoPE positions, so a run may give it a longer
    context than its table's) and caps a checkpoint's (an HF config's max_position_embeddings is
    often far longer than a run needs, and is never raised: the weights were trained up to it)."""
    root: Path | None = None
    if path:
        root = Path(path)
        check_model_dir(root)
        cfg = ModelConfig.from_hf_dir(root, dtype=dtype)
    else:
        cfg = dataclasses.replace(ModelConfig.named(name), dtype=dtype)
    tok = tokenizer_name(path=str(root) if root is not None else "", tokenizer=tokenizer)
    if max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=sequence_length(cfg.max_seq_len, max_seq_len,
                                                                   checkpoint=root is not None))
    if lora is not None:
        cfg = dataclasses.replace(cfg, lora=lora)
    return ModelSource(cfg=cfg, checkpoint=root, tokenizer_name=tok, seed=seed, param_dtype=param_dtype,
                       name=str(root) if root is not None else name)


def check_model_dir(root: Path) -> None:
    """Raises ValueError naming the file for anything a service would fail on later: a missing
    config, weights or tokenizer file, an unsupported architecture or field, no chat template."""
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory (expected a Hugging Face model directory)")
    try:
        hf = read_hf_config(root)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    # model_type and every field the decoder must implement first: a multimodal or quantised
    # checkpoint's error then names the field (vision_config, ...), not just its architecture.
    ModelConfig.from_hf_dir(root)
    architectures = hf.get("architectures") or []
    unknown = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unknown:
        raise ValueError(f"{root / CONFIG_FILE} architectures: {unknown[0]!r} is not supported; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)} (model_type {list(SUPPORTED_MODEL_TYPES)})")
    if not (root / SINGLE_FILE).is_file() and not (root / INDEX_FILE).is_file() \
            and not any(root.glob("*.safetensors")):
        hint = "; PyTorch .bin weights are not read, save with safe_serialization" if any(root.glob("*.bin")) else ""
        raise ValueError(f"{root}: missing {SINGLE_FILE} (or {INDEX_FILE} with its shards){hint}")
    if (root / INDEX_FILE).is_file():
        _check_index(root / INDEX_FILE)
    if not (root / TOKENIZER_FILE).is_file():
        raise ValueError(f"{root / TOKENIZER_FILE}: missing; the run's tokenizer is read from it")
    template = (root / TEMPLATE_FILE).is_file() or _has_template(root / TOKENIZER_CONFIG_FILE)
    if not template:
        raise ValueError(f"{root / TOKENIZER_CONFIG_FILE}: no chat_template (nor {TEMPLATE_FILE}); rollouts "
                         f"render conversations with the model's own template")


def _check_index(index: Path) -> None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
    for shard in sorted(set(weight_map.values())):
        if not (index.parent / shard).is_file():
            raise ValueError(f"{index.parent / shard}: missing; {index.name} lists it as a shard")


def _has_template(file: Path) -> bool:
    if not file.is_file():
        return False
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    return isinstance(data, dict) and bool(data.get("chat_template"))


def _with_shardings(like: nnx.State, shardings: Any) -> nnx.State:
    if isinstance(shardings, jax.Device):
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(shardings), like)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)
