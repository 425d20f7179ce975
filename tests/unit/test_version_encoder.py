"""Which kind each version goes out as (services/trainer/publish.py VersionEncoder): full every
trainer.weights.full_every, deltas between, full after a gap in the numbering (a re-numbered
version) or when a delta would not be smaller than max_delta_ratio of a copy; with storage each
version is written once and the files older than the previous full pruned."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.config.trainer import WeightPublishConfig
from arlo.model.weight_delta import apply_delta, sha256_hex, unpack
from arlo.model.weight_files import read_version
from arlo.model.weights import state_to_bytes
from services.trainer.publish import VersionEncoder, VersionStore


def _payload(step: int, lr: float = 1e-3) -> bytes:
    w = jnp.linspace(-0.05, 0.05, 20_000, dtype=jnp.float32) + step * lr
    return state_to_bytes(nnx.State({"w": nnx.Param(w)}), "bfloat16")


async def _put(encoder: VersionEncoder, version: int, data: bytes, **kw):
    return await encoder.put(version, data, sha256=sha256_hex(data), **kw)


async def test_full_every_k_and_deltas_between(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}"
    encoder = VersionEncoder(VersionStore(keep=2), WeightPublishConfig(full_every=3, storage=uri))
    kinds = []
    for v in range(1, 8):
        published = await _put(encoder, v, _payload(v, lr=1e-5))
        kinds.append(published.kind)
        assert published.full_version == (1 if v < 4 else 4 if v < 7 else 7)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    # Each delta file takes the version before it to its own bytes.
    held = bytearray(_payload(5, lr=1e-5))
    apply_delta(held, unpack(read_version(uri, 6, "delta")))
    assert bytes(held) == _payload(6, lr=1e-5)
    assert 0 < published.changed_fraction <= 1 and encoder.store.get(6).published_bytes < len(held) / 2
    # Pruned behind the previous full (4): a replica one chain behind still finds its deltas.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "000000000004.full", "000000000005.delta", "000000000006.delta", "000000000007.full"]


async def test_a_gap_in_the_numbering_or_a_dense_change_goes_out_full() -> None:
    encoder = VersionEncoder(VersionStore(keep=2), WeightPublishConfig(full_every=100))
    await _put(encoder, 1, _payload(1, lr=1e-5))
    assert (await _put(encoder, 3, _payload(2, lr=1e-5))).kind == "full"  # re-numbered above a pointer
    assert (await _put(encoder, 4, _payload(3, lr=1e-5))).kind == "delta"
    assert (await _put(encoder, 5, _payload(3, lr=1e-5), full=True)).kind == "full"
    # A large step changes almost every element: an index each would cost more than the copy.
    dense = state_to_bytes(nnx.State({"w": nnx.Param(jax.random.normal(jax.random.key(7), (20_000,)))}), "bfloat16")
    assert (await _put(encoder, 6, dense)).kind == "full"


async def test_full_every_one_publishes_every_version_full() -> None:
    encoder = VersionEncoder(VersionStore(keep=2), WeightPublishConfig())
    for v in range(1, 4):
        assert (await _put(encoder, v, _payload(v))).kind == "full"
