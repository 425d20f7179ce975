"""`arlo export`: a run's policy -> a Hugging Face model directory (arlo.model.export).

The weights come from one of three places: the running trainer's newest published version
(or `version`, while the trainer still holds it), pulled over PullWeights as inference pulls
them; or an Orbax checkpoint the trainer wrote (`checkpoint`, or with no trainer answering,
the newest one under trainer.checkpoint_dir). The tokenizer files come from the model's own
directory (model.path), or are the byte tokenizer's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import grpc
import jax
import orbax.checkpoint as ocp
from flax import nnx

from arlo.config import RunConfig
from arlo.coord import WeightPointer, connect
from arlo.model.export import ExportResult, export_hf
from arlo.model.source import ModelSource, cast_state
from arlo.model.weights import sha256_hex, state_from_bytes, state_to_bytes
from arlo.proto.v1 import trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel


class ExportError(RuntimeError):
    """Nothing to export from (no trainer answering, no such version or checkpoint)."""


def export_run(cfg: RunConfig, out: str | Path, *, token: str | None, version: int = 0,
               checkpoint: str = "") -> ExportResult:
    """Writes the policy to `out`; see the module docstring for where it comes from."""
    source = cfg.model.source()
    if checkpoint:
        state = read_checkpoint(Path(checkpoint.removeprefix("file://")), source)
    else:
        try:
            state = asyncio.run(pull_published(cfg, source, token=token, version=version))
        except ExportError:
            if version or not cfg.trainer.checkpoint_dir:
                raise
            state = read_checkpoint(newest_checkpoint(Path(cfg.trainer.checkpoint_dir)), source)
    return export_hf(state, source.cfg, out, tokenizer=source.tokenizer(), tokenizer_dir=source.tokenizer_dir,
                     dtype=source.param_dtype, base_config=source.base_config())


async def pull_published(cfg: RunConfig, source: ModelSource, *, token: str | None, version: int = 0) -> nnx.State:
    """`version` (0: the newest published) from the trainer the weight pointer names."""
    redis = await connect(cfg.redis)
    try:
        pointer = await WeightPointer(redis, cfg.run_id).get()
    finally:
        await redis.aclose()
    if pointer is None or pointer.version == 0 or not pointer.source.startswith("grpc://"):
        raise ExportError(f"run {cfg.run_id!r}: no version published yet (is the trainer running?)")
    want = version or pointer.version
    data = await _pull(pointer.source.removeprefix("grpc://"), want, token=token, cfg=cfg)
    if want == pointer.version and sha256_hex(data) != pointer.sha256:
        raise ExportError(f"version {want}: the payload's sha256 does not match the pointer's")
    return state_from_bytes(data, source.abstract_state())


async def _pull(target: str, version: int, *, token: str | None, cfg: RunConfig) -> bytes:
    buf = bytearray()
    async with make_channel(target, token=token, tls=cfg.auth.tls,
                            max_message_bytes=cfg.inference.server.max_message_bytes) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        try:
            async for chunk in stub.PullWeights(trainer_pb2.PullWeightsRequest(version=version), timeout=300):
                if chunk.offset != len(buf) or hashlib.sha256(chunk.data).hexdigest() != chunk.chunk_sha256:
                    raise ExportError(f"version {version}: chunk at offset {chunk.offset} is out of order or corrupt")
                buf += chunk.data
        except grpc.aio.AioRpcError as e:
            raise ExportError(f"trainer at {target}: version {version}: {e.code().name} {e.details()}") from e
    return bytes(buf)


def newest_checkpoint(directory: Path) -> Path:
    steps = sorted(p for p in directory.glob("[0-9]*") if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []
    if not steps:
        raise ExportError(f"no trainer answers and {directory} holds no checkpoint")
    return steps[-1]


def read_checkpoint(path: Path, source: ModelSource) -> nnx.State:
    """The params of the trainer's Orbax checkpoint at `path` (`<checkpoint_dir>/<version>`),
    checked against the sha256 recorded with them, in the source's param_dtype."""
    if not path.is_dir() or not path.name.isdigit():
        raise ExportError(f"{path}: not a trainer checkpoint (expected <trainer.checkpoint_dir>/<version>)")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        source.abstract_state("float32"))
    options = ocp.CheckpointManagerOptions(step_format_fixed_length=len(path.name), read_only=True)
    with ocp.CheckpointManager(path.parent, options=options) as manager:
        restored = manager.restore(int(path.name), args=ocp.args.Composite(
            params=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore()))
    meta: dict[str, Any] = dict(restored.meta)
    if sha256_hex(state_to_bytes(restored.params)) != meta.get("params_sha256"):
        raise ExportError(f"{path}: params do not match the sha256 recorded with them ({json.dumps(meta)[:200]})")
    return cast_state(restored.params, source.param_dtype)
