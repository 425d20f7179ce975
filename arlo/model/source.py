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
from flax import nnx

from arlo.model.config import ModelConfig
from arlo.model.hf import INDEX_FILE, SINGLE_FILE, load_hf_state
from arlo.model.hf_config import CONFIG_FILE, SUPPORTED_MODEL_TYPES, read_hf_config
from arlo.model.tokenizer import Tokenizer, get_tokenizer
from arlo.model.transformer import abstract_model, create_model

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    cfg: ModelConfig
    """The decoder's shape, with the run's compute dtype and sequence cap applied."""
    checkpoint: Path | None
    """HF directory whose safetensors are version 0; None: random init from `seed`."""
    tokenizer_name: str
    """"byte" or the HF directory holding tokenizer.json (see arlo.model.tokenizer.get_tokenizer)."""
    seed: int

    @property
    def tokenizer_dir(self) -> Path | None:
        return None if self.tokenizer_name == "byte" else Path(self.tokenizer_name)

    def tokenizer(self) -> Tokenizer:
        return get_tokenizer(self.tokenizer_name)

    def base_config(self) -> dict[str, Any] | None:
        """The checkpoint's own config.json (export keeps its token ids and names)."""
        return read_hf_config(self.checkpoint) if self.checkpoint is not None else None

    def initial_state(self, shardings: Any = None) -> nnx.State:
        """Version 0's parameters, placed by `shardings` (a state-shaped tree of shardings, or
        a device) if given. A checkpoint is read tensor by tensor straight into that placement,
        so a process never holds a second full copy and each device receives only its shard."""
        if self.checkpoint is None:
            state = nnx.split(create_model(self.cfg, self.seed))[1]
            return state if shardings is None else jax.device_put(state, shardings)
        like = nnx.split(abstract_model(self.cfg))[1]
        if shardings is not None:
            like = _with_shardings(like, shardings)
        return load_hf_state(self.checkpoint, self.cfg, like)


def resolve_model(*, name: str, path: str, tokenizer: str, seed: int, dtype: str = "float32",
                  max_seq_len: int = 0) -> ModelSource:
    """`path` (an HF directory) wins over the preset `name`; its tokenizer is the directory's
    own unless `tokenizer` names another. `max_seq_len` > 0 caps the sequence length (an HF
    config's max_position_embeddings is often far longer than a run needs)."""
    if path:
        root = Path(path)
        check_model_dir(root)
        cfg = ModelConfig.from_hf_dir(root, dtype=dtype)
        tok = str(root) if tokenizer in ("", "byte") else tokenizer
    else:
        cfg = dataclasses.replace(ModelConfig.named(name), dtype=dtype)
        tok, root = tokenizer or "byte", None
    if max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=min(cfg.max_seq_len, max_seq_len))
    return ModelSource(cfg=cfg, checkpoint=root, tokenizer_name=tok, seed=seed)


def check_model_dir(root: Path) -> None:
    """Raises ValueError naming the file for anything a service would fail on later: a missing
    config, weights or tokenizer file, an unsupported architecture or field, no chat template."""
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory (expected a Hugging Face model directory)")
    try:
        hf = read_hf_config(root)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    architectures = hf.get("architectures") or []
    unknown = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unknown:
        raise ValueError(f"{root / CONFIG_FILE} architectures: {unknown[0]!r} is not supported; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)} (model_type {list(SUPPORTED_MODEL_TYPES)})")
    ModelConfig.from_hf_config(hf)  # model_type and every field the decoder must implement
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
