"""What the engine serves: one immutable (state, versions) value, and the pure steps that make
the next one. The engine holds a reference to a `Policy` and replaces it whole between two
steps (`Engine.swap`), so a chunk runs under one policy, never a mix.

With LoRA the state is the engine's own frozen base plus adapters: a publish carries adapters
alone and `replaced` joins them to the base (unmerged). With several adapter slots (several runs
over one base, `LoraShape.slots`) each slot is published, swapped and versioned on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model.config import ModelConfig
from arlo.model.lora import AdapterRows, merge_states, slot_of, split_adapters, stacked, with_slot
from arlo.model.quantize import quantize_base
from arlo.model.source import ModelSource


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    state: nnx.State
    versions: tuple[int, ...]
    """The version served per adapter slot (one entry unless the engine holds several adapters)."""

    @property
    def version(self) -> int:
        return self.versions[0]


def initial_policy(source: ModelSource, abstract: nnx.State, placement: Any, *, slots: int) -> Policy:
    """Version 0 of every slot. `abstract`: the served model's state shapes (stacked adapters when
    `slots` > 1); `placement`: a device or a state-shaped tree of shardings for it."""
    one = placement if slots <= 1 or isinstance(placement, jax.Device) else None
    state = _served_base(source, one if one is not None else jax.devices()[0])
    if slots > 1:
        state = jax.device_put(_stacked_state(state, abstract, slots), placement)
    return Policy(state=state, versions=(0,) * max(slots, 1))


def published(policy: Policy, model_cfg: ModelConfig, adapter: int) -> nnx.State:
    """What a publish carries for slot `adapter`: the whole policy, or with LoRA that slot's adapters."""
    if model_cfg.lora is None:
        return policy.state
    adapters = split_adapters(policy.state)[0]
    return slot_of(adapters, adapter) if model_cfg.lora.slots else adapters


def replaced(policy: Policy, model_cfg: ModelConfig, state: nnx.State, version: int, adapter: int) -> Policy:
    """The policy with slot `adapter` at `version` serving `state` (the whole policy, or with LoRA
    that slot's adapters alone). Raises ValueError for a version not newer than the slot's, or a
    state whose tree, shapes or dtypes differ from the served one (it would recompile every program)."""
    served = policy.versions[adapter]
    if version <= served:
        raise ValueError(f"version {version} is not newer than the served {served}")
    if model_cfg.lora is not None and not _has_base(state):
        held, base = split_adapters(policy.state)
        if model_cfg.lora.slots:
            check_like(slot_of(held, adapter), state)
            state = with_slot(held, adapter, state)
        state = merge_states(base, state)
    check_like(policy.state, state)
    # A no-op for arrays already placed like the served ones (state_from_bytes does that).
    state = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), state, policy.state)
    versions = list(policy.versions)
    versions[adapter] = version
    return Policy(state=state, versions=tuple(versions))


def check_like(old: nnx.State, new: nnx.State) -> None:
    old_leaves, old_tree = jax.tree.flatten(old)
    new_leaves, new_tree = jax.tree.flatten(new)
    if old_tree != new_tree:
        raise ValueError("swap: the new state's tree differs from the served one")
    for a, b in zip(old_leaves, new_leaves, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"swap: a parameter of {a.dtype}{list(a.shape)} came as {b.dtype}{list(b.shape)}")


def _served_base(source: ModelSource, placement: Any) -> nnx.State:
    """Version 0's weights; with QLoRA the base's projections quantised as the trainer's are
    (arlo/model/quantize.py), so engine and trainer run the same function."""
    state = source.initial_state(placement)
    lora = source.cfg.lora
    if lora is None or lora.quantize == "none":
        return state
    adapters, base = split_adapters(state)
    return merge_states(quantize_base(base, lora.quantize, lora.quant_block), adapters)


def _stacked_state(state: nnx.State, abstract: nnx.State, slots: int) -> nnx.State:
    """One adapter's served state as `slots` stacked copies, with the batch-row selectors."""
    adapters, base = split_adapters(state)
    rows = [(p, v.copy(jnp.zeros((1,), jnp.int32))) for p, v in nnx.to_flat_state(abstract)
            if isinstance(v, AdapterRows)]
    return merge_states(base, stacked(adapters, slots), nnx.from_flat_state(rows))


def _has_base(state: nnx.State) -> bool:
    return any(not isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state))
