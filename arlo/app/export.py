"""`arlo export`: a run's policy -> a Hugging Face model directory (arlo.model.export).

The weights come from one of four places: the running trainer's newest published version
(or `version`, while the trainer still holds it), pulled over PullWeights as inference pulls
them; an Orbax checkpoint the trainer wrote (`checkpoint`; with no trainer answering, the
newest one under trainer.checkpoint_dir, or `version`'s there); or, for version 0, the model
source itself (the initial weights every service loads). The tokenizer files come from the model's own
directory (model.path), or are the byte tokenizer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from arlo.model import lora
from arlo.model.export import ExportResult, export_hf
from arlo.model.lora_export import ADAPTER_WEIGHTS, NORMS_REFUSED, export_peft_adapter
from arlo.model.quantize import dequantized, quantize_base
from arlo.model.source import ModelSource, cast_state
from arlo.model.weights import sha256_hex, state_from_bytes, state_to_bytes
from arlo.proto.v1 import trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel


class ExportError(RuntimeError):
    """Nothing to export from (no trainer answering, no such version or checkpoint)."""


def export_run(cfg: RunConfig, out: str | Path, *, token: str | None, version: int | None = None,
               checkpoint: str = "", adapter: bool = False) -> ExportResult:
    """Writes the policy to `out`; see the module docstring for where it comes from. A LoRA run
    (trainer.lora) exports the base with its adapters merged in, or with `adapter` the adapters
    alone as a PEFT adapter directory for the base at model.path."""
    source = cfg.model_source()
    published = policy_state(cfg, source, token=token, version=version, checkpoint=checkpoint)
    if adapter:
        if source.cfg.lora is None:
            raise ExportError("--adapter: this run trains no adapters (trainer.lora.rank is 0)")
        if source.cfg.lora.train_norms:
            raise ExportError(f"--adapter: {NORMS_REFUSED}")
        root = export_peft_adapter(published, source.cfg, out, base_model=cfg.model.path or cfg.model.name)
        files = tuple(sorted(p.name for p in root.iterdir()))
        return ExportResult(out=root, files=files, num_bytes=(root / ADAPTER_WEIGHTS).stat().st_size)
    model_cfg, state = source.cfg, published
    if model_cfg.lora is not None:
        state = lora.merged_weights(lora.merge_states(_base(source), published), model_cfg)
        model_cfg = dataclasses.replace(model_cfg, lora=None)
    return export_hf(state, model_cfg, out, tokenizer=source.tokenizer(), tokenizer_dir=source.tokenizer_dir,
                     dtype=source.param_dtype, base_config=source.base_config())


def _base(source: ModelSource) -> nnx.State:
    """A LoRA run's frozen base: the model source's own weights, which no publish carries. With
    QLoRA, quantised and dequantised as trainer and inference hold it, so the merged export is the
    function the run served; a PEFT adapter (--adapter) goes onto the original base instead, as
    QLoRA adapters are used, which differs by the quantisation error."""
    base = lora.split_adapters(source.initial_state())[1]
    shape = source.cfg.lora
    if shape is None or shape.quantize == "none":
        return base
    return dequantized(quantize_base(base, shape.quantize, shape.quant_block))


def published_like(source: ModelSource, dtype: str | None = None) -> nnx.State:
    """The shape of what a publish and a checkpoint hold: the whole policy, or with LoRA the adapters."""
    like = source.abstract_state(dtype)
    return lora.split_adapters(like)[0] if source.cfg.lora is not None else like


def policy_state(cfg: RunConfig, source: ModelSource, *, token: str | None, version: int | None,
                 checkpoint: str) -> nnx.State:
    """The weights to export, as a publish carries them (with LoRA, the adapters): `checkpoint`; version 0 (the model source itself: the checkpoint at
    model.path or the preset's seeded init, what inference and the trainer load, so it needs no
    trainer); another version from the trainer while it holds it, else its checkpoint; None, the
    newest published, else the newest checkpoint."""
    if checkpoint:
        return read_checkpoint(Path(checkpoint.removeprefix("file://")), source)
    if version == 0:
        initial = source.initial_state()
        return lora.split_adapters(initial)[0] if source.cfg.lora is not None else initial
    directory = Path(cfg.trainer.checkpoint_dir) if cfg.trainer.checkpoint_dir else None
    try:
        return asyncio.run(pull_published(cfg, source, token=token, version=version or 0))
    except ExportError as e:
        if version is None:
            try:
                if directory is None:
                    raise ExportError("no trainer.checkpoint_dir") from None
                return read_checkpoint(newest_checkpoint(directory), source)
            except ExportError as none:
                raise ExportError(f"{e}; {none}. Version 0, the initial weights, exports with --version 0") from None
        if directory is None:
            raise
        held = [p for p in directory.glob("[0-9]*") if p.is_dir() and p.name.isdigit() and int(p.name) == version]
        if not held:
            raise ExportError(f"{e}; and {directory} holds no checkpoint of version {version}") from None
        return read_checkpoint(held[0], source)


async def pull_published(cfg: RunConfig, source: ModelSource, *, token: str | None, version: int = 0) -> nnx.State:
    """`version` (0: the newest published) from the trainer the weight pointer names."""
    redis = await connect(cfg.redis)
    try:
        pointer = await WeightPointer(redis, cfg.run_id).get()
    finally:
        await redis.aclose()
    if pointer is None or pointer.version == 0 or not pointer.source.startswith("grpc://"):
        raise ExportError(f"run {cfg.run_id!r}: no version published yet (the trainer publishes its first "
                          f"after its first step)")
    if version > pointer.version:
        raise ExportError(f"version {version}: the newest published is {pointer.version}")
    want = version or pointer.version
    data = await _pull(pointer.source.removeprefix("grpc://"), want, token=token, cfg=cfg)
    if want == pointer.version and sha256_hex(data) != pointer.sha256:
        raise ExportError(f"version {want}: the payload's sha256 does not match the pointer's")
    return state_from_bytes(data, published_like(source))


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
                        published_like(source, "float32"))
    options = ocp.CheckpointManagerOptions(step_format_fixed_length=len(path.name), read_only=True)
    with ocp.CheckpointManager(path.parent, options=options) as manager:
        restored = manager.restore(int(path.name), args=ocp.args.Composite(
            params=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore()))
    meta: dict[str, Any] = dict(restored.meta)
    if sha256_hex(state_to_bytes(restored.params)) != meta.get("params_sha256"):
        raise ExportError(f"{path}: params do not match the sha256 recorded with them ({json.dumps(meta)[:200]})")
    return cast_state(restored.params, source.param_dtype)
