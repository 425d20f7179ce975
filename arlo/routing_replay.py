"""Routing replay's wire format: the experts chosen per generated token and routed layer, as bytes.

Used by inference (Completion.routed_experts), the rollout (Trajectory.routed_experts) and the
trainer; NumPy only, so the rollout never imports JAX. A token's record is [routed layers, top_k]
expert ids, tokens in order, row-major ([tokens, routed_layers, top_k]): uint8 when the model has
at most 256 experts, else uint16 little-endian.

Semantics (docs/architecture.md, "Routing replay"): the record of generated token t is what every
routed layer chose at the position whose output sampled t (the last prompt token for a turn's
first token, the previous generated token for the others), so the trainer replays it at input
position t - 1 of its forward.
"""

from __future__ import annotations

import numpy as np


def expert_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def bytes_per_token(*, routed_layers: int, top_k: int, num_experts: int) -> int:
    return routed_layers * top_k * expert_dtype(num_experts).itemsize


def pack_experts(experts: np.ndarray, num_experts: int) -> bytes:
    """int [tokens, routed_layers, top_k] -> bytes (the module's encoding)."""
    experts = np.asarray(experts)
    if experts.size and (experts.min() < 0 or experts.max() >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts})")
    return np.ascontiguousarray(experts, dtype=expert_dtype(num_experts)).tobytes()


def pack_recorded(experts: np.ndarray | None, routing: tuple[int, int, int] | None) -> bytes:
    """A sample's record packed (`routing`: the model's `routing_shape`), or b"" when it has none
    (not asked for, or a model without routed experts)."""
    return b"" if experts is None or routing is None else pack_experts(experts, routing[2])


def unpack_experts(data: bytes, *, tokens: int, routed_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """bytes -> int32 [tokens, routed_layers, top_k]; ValueError when the length is not that shape's."""
    want = tokens * bytes_per_token(routed_layers=routed_layers, top_k=top_k, num_experts=num_experts)
    if len(data) != want:
        raise ValueError(f"routed_experts has {len(data)} bytes; {tokens} tokens x {routed_layers} routed layers x "
                         f"top_k {top_k} x {expert_dtype(num_experts).itemsize} byte(s) is {want}")
    flat = np.frombuffer(data, dtype=expert_dtype(num_experts)).astype(np.int32)
    return flat.reshape(tokens, routed_layers, top_k)


def routing_shape(cfg) -> tuple[int, int, int] | None:  # noqa: ANN001 (arlo.model.config.ModelConfig; no JAX import)
    """(routed_layers, top_k, num_experts) of a model config, or None for a model without routed experts."""
    moe = cfg.moe
    if moe is None:
        return None
    layers = sum(moe.routed(i) for i in range(cfg.num_layers))
    return (layers, moe.top_k, moe.num_experts) if layers else None


def routing_bytes(cfg) -> int:  # noqa: ANN001 (arlo.model.config.ModelConfig)
    """Bytes of routed_experts per generated token for this model; 0 without routed experts."""
    shape = routing_shape(cfg)
    return 0 if shape is None else bytes_per_token(routed_layers=shape[0], top_k=shape[1], num_experts=shape[2])
