"""Logical axis names on parameters -> mesh axes (MaxText style): one table, in config terms.

Model code names axes by meaning ("embed", "heads", "mlp", ...); this table decides which
mesh axis shards each, so the same model runs on one CPU and across a TPU slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),  # routed experts (moe.py) over a mesh axis named "expert": expert parallel
    ("kv", None),
    ("norm", None),
)
BATCH_AXES = ("data", "fsdp")


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> Any:
    """A NamedSharding per parameter, from its logical axis names; axes the mesh lacks stay replicated."""
    present = set(mesh.axis_names)
    usable = tuple((name, axis if axis in present else None) for name, axis in rules)
    specs = nnx.get_partition_spec(state)
    return jax.tree.map(lambda p: NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(p), usable)), specs,
                        is_leaf=_is_spec)


def shard_state(state: nnx.State, mesh: Mesh, rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> nnx.State:
    return jax.device_put(state, state_shardings(state, mesh, rules))


def fit_spec(mesh: Mesh, shape: Sequence[int], spec: PartitionSpec) -> PartitionSpec:
    """`spec` with every dimension the mesh axes do not divide left replicated.

    A preset's sizes are not chosen for every mesh (tiny: 2 kv heads on a tensor axis of
    4): replicating that one dimension serves the model correctly where device_put would
    refuse it.
    """
    out: list[Any] = []
    for size, axes in zip(shape, (*spec, *([None] * (len(shape) - len(spec)))), strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        ways = 1
        for a in names:
            ways *= mesh.shape[a]
        out.append(axes if names and size % ways == 0 else None)
    return PartitionSpec(*out)


def fitted_state_shardings(state: nnx.State, mesh: Mesh,
                           rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> Any:
    """`state_shardings`, each spec fitted to its parameter's shape (see `fit_spec`)."""
    named = state_shardings(state, mesh, rules)
    return jax.tree.map(lambda x, s: NamedSharding(mesh, fit_spec(mesh, x.shape, s.spec)), state, named)


def batch_sharding(mesh: Mesh, rows: int, *, rows_dim: int = 1, ndim: int = 3) -> NamedSharding:
    """Rows split over the data-parallel axes when they divide evenly, else replicated."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    ways = 1
    for a in axes:
        ways *= mesh.shape[a]
    spec: list[Any] = [None] * ndim
    if axes and rows % ways == 0:
        spec[rows_dim] = axes
    return NamedSharding(mesh, PartitionSpec(*spec))
