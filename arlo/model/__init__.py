"""Flax NNX decoder-only transformer (Llama 3 / Qwen2 / Qwen3), tokenizers, sampling,
weight bytes, and Hugging Face checkpoint loading (`load_hf_model`). Generation is the
inference service's (`services/inference`: continuous batching over `prefill`/`decode_step`).

Typical use: `model = create_model(ModelConfig.named("tiny"), seed=0)`, then
`graphdef, state = nnx.split(model)` once; jit functional code over `state` and pass
`graphdef` as a static argument.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers (at run time they load lazily, below)
    from arlo.model.config import ModelConfig
    from arlo.model.hf import load_hf_model, load_hf_state
    from arlo.model.hf_tokenizer import HFTokenizer
    from arlo.model.kv_cache import KVCache, init_cache
    from arlo.model.logprobs import token_logprobs
    from arlo.model.rope import RopeScaling
    from arlo.model.sampling import sample, sampling_logprobs
    from arlo.model.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer
    from arlo.model.transformer import Transformer, abstract_model, create_model
    from arlo.model.weights import sha256_hex, state_from_bytes, state_to_bytes

# Loaded on first use (PEP 562): a process that needs only the tokenizer (rollout, env, reward
# tools) must not pay for importing JAX and Flax, seconds on its critical path at start.
_EXPORTS = {
    "ModelConfig": "config", "load_hf_model": "hf", "load_hf_state": "hf", "HFTokenizer": "hf_tokenizer",
    "KVCache": "kv_cache", "init_cache": "kv_cache", "token_logprobs": "logprobs", "RopeScaling": "rope",
    "sample": "sampling", "sampling_logprobs": "sampling", "ByteTokenizer": "tokenizer", "Tokenizer": "tokenizer",
    "get_tokenizer": "tokenizer", "Transformer": "transformer", "abstract_model": "transformer",
    "create_model": "transformer", "sha256_hex": "weights", "state_from_bytes": "weights",
    "state_to_bytes": "weights",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'arlo.model' has no attribute {name!r}")
    return getattr(import_module(f"arlo.model.{_EXPORTS[name]}"), name)


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "Transformer",
    "abstract_model",
    "create_model",
    "get_tokenizer",
    "init_cache",
    "load_hf_model",
    "load_hf_state",
    "sample",
    "sampling_logprobs",
    "sha256_hex",
    "state_from_bytes",
    "state_to_bytes",
    "token_logprobs",
]
