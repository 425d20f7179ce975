"""The trainer's side of weight sync without a learner, for bench/weight_fanout.py and the
weight-sync fault tests: a float32 master copy of a model's parameters moved as Adam's first steps
move them (every element by exactly +-lr), published as the trainer publishes (the serving copy
in bfloat16, `hashed_payload`, the real VersionEncoder: a delta or a full, written once to shared
storage, the pointer moved with its kind), and the real TrainerServicer over the version store for
full pulls and deltas over PullWeights.

    python -m bench.weight_trainer --redis URL --run RUN --model tiny [--storage file:///dir]
        [--full-every 16] [--lr 1e-6]

Reads commands on stdin, one a line, answers one JSON line each:
    publish            a step, then its publish: {"version", "kind", "sha256", "started_at",
                       "pointer_at", "published_bytes", "full_bytes", "changed_fraction", "sent_bytes"}
    publish stall      the same, but the storage write stops after its first part and says
                       {"stalled": version}: the fault tests kill -9 it there
    publish corrupt    the version's delta file written with one byte of its body flipped
    publish forge      a delta whose values are wrong but whose envelope checks out (its body
                       sha256 recomputed): only the result's sha256 against the pointer can tell
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
import types
from typing import Any

SHAPES = ("tiny", "qwen2.5-0.5b")


def jax_jit_lazy(fn: Any, **jit_kw: Any) -> Any:
    """`jax.jit(fn, **jit_kw)`, built on the first call (the module imports without JAX)."""
    jitted = None

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        nonlocal jitted
        if jitted is None:
            import jax

            jitted = jax.jit(fn, **jit_kw)
        return jitted(*args)

    return call


def model_state(shape: str) -> Any:
    """The shape's parameters in float32 at a trained model's scale (normal, std 0.02; norms 1)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from arlo.model.config import ModelConfig
    from arlo.model.transformer import abstract_model
    from bench.real_model import SHAPES as HF_SHAPES

    cfg = ModelConfig.from_hf_config({"model_type": "qwen2", **HF_SHAPES[shape]})
    _, abstract = nnx.split(abstract_model(cfg))
    flat = list(nnx.to_flat_state(abstract))
    keys = jax.random.split(jax.random.key(0), len(flat))

    def init(key: jax.Array, path: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        if any("norm" in str(part) for part in path):
            return jnp.ones(shape, jnp.float32)
        return _normal(key, shape)

    return nnx.from_flat_state([(path, var.replace(init(k, path, var.get_value().shape)))
                                for (path, var), k in zip(flat, keys, strict=True)])


@functools.partial(jax_jit_lazy, static_argnums=1)
def _normal(key: Any, shape: tuple[int, ...]) -> Any:
    import jax
    import jax.numpy as jnp

    return 0.02 * jax.random.normal(key, shape, jnp.float32)


@functools.partial(jax_jit_lazy, donate_argnums=0)
def _adam_first_step(w: Any, key: Any, lr: float) -> Any:
    """Adam's first update is lr * m/sqrt(v) = lr * sign(g) for every element: the most an element
    moves per step, so the changed fraction here bounds a real run's from above. Jitted per array
    (a handful of distinct shapes): one program over every array took minutes to compile."""
    import jax
    import jax.numpy as jnp

    return w + lr * (2.0 * (jax.random.bits(key, w.shape, jnp.uint8) & 1) - 1.0).astype(w.dtype)


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        import jax

        from arlo.config.trainer import WeightPublishConfig
        from services.trainer.publish import VersionEncoder, VersionStore

        self.args = args
        self.state = model_state(args.model)
        self.leaves, self.treedef = jax.tree.flatten(self.state)
        # One version held: a delta is taken before the next put evicts its base, and a replica's
        # fallback pulls the newest (a trainer keeps two, for a replica mid-pull of the older one).
        self.store = VersionStore(keep=1)
        self.encoder = VersionEncoder(self.store, WeightPublishConfig(
            full_every=args.full_every, storage=args.storage))
        self.key = jax.random.key(1)
        self.source = ""
        self.pointer: Any = None
        self.warm_up()

    def warm_up(self) -> None:
        """Compiles the step and the serving copy before any publish is timed (a trainer's warm-up does)."""
        from arlo.model.weights import serving_copy

        self.train_step()
        serving_copy(self.state, "bfloat16")

    def train_step(self) -> None:
        import jax

        self.key, sub = jax.random.split(self.key)
        keys = jax.random.split(sub, len(self.leaves))
        self.leaves = [_adam_first_step(w, k, self.args.lr) for w, k in zip(self.leaves, keys, strict=True)]
        self.state = jax.tree.unflatten(self.treedef, self.leaves)

    async def publish(self, mode: str) -> dict[str, Any]:
        from arlo.model.weights import serving_copy
        from services.trainer.publish import hashed_payload

        self.train_step()
        version = self.store.newest_version + 1
        if version == 1:
            current = await self.pointer.get()
            version = (current.version if current else 0) + 1  # numbered above the pointer, as a trainer is
        started_at = time.time()
        data = await asyncio.to_thread(serving_copy(self.state, "bfloat16").to_bytes)
        digests = await asyncio.to_thread(hashed_payload, data)
        with self._faults(mode, version):
            published = await self.encoder.put(version, data, sha256=digests.sha256, chunk_digests=digests.chunks)
        moved = await self.pointer.publish(version, source=self.source, sha256=published.sha256,
                                           payload=published.kind, full_version=published.full_version,
                                           base_version=version - 1 if published.kind == "delta" else 0,
                                           storage=self.encoder.storage)
        assert moved, f"the pointer refused version {version}"
        return {"version": version, "kind": published.kind, "sha256": published.sha256, "started_at": started_at,
                "pointer_at": time.time(), "published_bytes": published.published_bytes, "full_bytes": len(data),
                "changed_fraction": published.changed_fraction, "sent_bytes": self.store.sent_bytes}

    def _faults(self, mode: str, version: int) -> Any:
        """Swaps the storage writer for one that fails as `mode` says, for this publish."""
        import contextlib

        from arlo.model import weight_delta

        files = self.encoder.files
        if mode == "" or files is None:
            return contextlib.nullcontext()
        write = files.write

        def faulty(v: int, kind: str, *parts: bytes) -> Any:
            if mode == "stall":
                tmp = files.root / f"{v:012d}.{kind}.{files.tag}.tmp"  # named as its own write names it
                tmp.write_bytes(bytes(parts[0])[: max(1, len(parts[0]) // 2)])
                print(json.dumps({"stalled": v}), flush=True)
                time.sleep(3600)
            if kind == "delta" and mode == "corrupt":
                body = bytearray(parts[-1])
                body[-1] ^= 0xFF
                parts = (bytes(body),)
            elif kind == "delta" and mode == "forge":
                env = weight_delta.unpack(parts[-1])
                raw = bytearray(weight_delta.zlib.decompress(env.body))
                raw[-1] ^= 0x01  # one value's last bit: a well-formed delta of the wrong weights
                forged = weight_delta.Envelope(**{**{f: getattr(env, f) for f in env.__dataclass_fields__},
                                                  "body": weight_delta.zlib.compress(bytes(raw)), "body_sha256": ""})
                parts = (weight_delta.pack(forged),)
            return write(v, kind, *parts)

        @contextlib.contextmanager
        def patched() -> Any:
            files.write = faulty  # type: ignore[method-assign]
            try:
                yield
            finally:
                files.write = write  # type: ignore[method-assign]

        return patched()


async def serve(args: argparse.Namespace) -> None:
    from arlo.config import AuthConfig, RedisConfig, ServerConfig
    from arlo.coord import WeightPointer, connect
    from arlo.proto.v1 import trainer_pb2_grpc
    from arlo.rpc.server import ServiceBinding, start_server
    from services.trainer.server import TrainerServicer

    harness = Harness(args)
    redis = await connect(RedisConfig(url=args.redis))
    harness.pointer = WeightPointer(redis, args.run)
    loop = types.SimpleNamespace(store=harness.store, source="",
                                 state=types.SimpleNamespace(checkpoint_version=0, checkpoint_uri=""))
    running = await start_server("trainer", ServerConfig(metrics_port=-1, grace_s=0.1), AuthConfig(disabled=True),
                                 [ServiceBinding("arlo.v1.Trainer", trainer_pb2_grpc.add_TrainerServicer_to_server,
                                                 TrainerServicer(loop))])  # type: ignore[arg-type]
    harness.source = loop.source = f"grpc://127.0.0.1:{running.port}"
    print(json.dumps({"ready": running.port}), flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode().split():
            if line[0] != "publish":
                raise ValueError(f"unknown command {line!r}")
            print(json.dumps(await harness.publish(line[1] if len(line) > 1 else "")), flush=True)
    finally:
        await running.stop(None)
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--model", choices=SHAPES, default="tiny")
    parser.add_argument("--storage", default="", help="file:///dir, as trainer.weights.storage")
    parser.add_argument("--full-every", type=int, default=16, help="as trainer.weights.full_every")
    parser.add_argument("--lr", type=float, default=1e-6)
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
