"""One inference replica's weight path without the engine, for bench/weight_fanout.py and the
weight-sync fault tests: the real WeightSync follows the pointer, fetches (deltas onto the payload
held, shared storage, or the trainer's full payload), checks the sha256 against the pointer, and
swaps the version into a bare parameter tree (views into the verified payload, which no delta
rewrites: the fetcher applies deltas onto a copy of it).

    python -m bench.weight_replica --redis URL --run RUN [--check]

Prints one JSON line per installed version: {"version", "served_at", "fetched_bytes", "kind",
"deltas"} and, with --check, "sha256" of the tree's bytes as installed (the fault tests compare
it with the version's), so a half-applied version would show.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

from arlo.model.weight_delta import payload_regions


class ParameterTree:
    """The served arrays (raw bytes, in payload order) and the payload's framing, enough to
    rebuild its exact bytes for --check; swapped by one reference assignment, as the engine does."""

    def __init__(self) -> None:
        self._served: tuple[int, Any] = (0, None)

    @property
    def version(self) -> int:
        return self._served[0]

    @property
    def state(self) -> Any:
        return self._served[1]

    @property
    def published_state(self) -> Any:
        """What a publish carries: here the whole tree (the engine's, with LoRA, is the adapters)."""
        return self._served[1]

    @property
    def published_scope(self) -> str:
        return "model"

    def swap(self, state: Any, version: int) -> None:
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the served {self.version}")
        self._served = (version, state)


def restore(data: bytearray, like: Any) -> tuple[Any, str | None]:
    """The payload's arrays as views into it, plus its framing: the fetcher holds the payload
    copy-on-write (a delta applies onto a copy), so the served tree's bytes never change under it,
    and a replica holds one copy of the weights, not two (four 0.5B replicas on a 23 GB machine)."""
    regions = payload_regions(data)
    arrays = [np.frombuffer(data, np.uint8, r.nbytes, r.offset) for r in regions]
    framing, at = [], 0
    for r in regions:
        framing.append(bytes(data[at : r.offset]))
        at = r.offset + r.nbytes
    framing.append(bytes(data[at:]))
    return (framing, arrays), None


def tree_sha256(state: Any) -> str:
    framing, arrays = state
    digest = hashlib.sha256()
    for head, array in zip(framing, [*arrays, None], strict=True):
        digest.update(head)
        if array is not None:
            digest.update(array.data)
    return digest.hexdigest()


async def follow(redis_url: str, run: str, check: bool) -> None:
    from arlo.config import RedisConfig
    from arlo.coord import WeightPointer, connect
    from services.inference.versions import VersionFetcher
    from services.inference.weights import WeightSync

    redis = await connect(RedisConfig(url=redis_url))
    tree = ParameterTree()
    sync = WeightSync(tree, WeightPointer(redis, run), token=None, poll_s=0.2, max_message_bytes=64 << 20,
                      restore=restore, versions=VersionFetcher(copy_on_write=True))
    original_swap = tree.swap

    def swap(state: Any, version: int) -> None:
        original_swap(state, version)
        line = {"version": version, "served_at": time.time()}
        if check:
            line["sha256"] = tree_sha256(state)
        print(json.dumps(line), flush=True)

    tree.swap = swap  # type: ignore[method-assign]
    print(json.dumps({"ready": True}), flush=True)
    try:
        await sync.run()
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--check", action="store_true", help="print each installed tree's sha256")
    args = parser.parse_args(argv)
    try:
        asyncio.run(follow(args.redis, args.run, args.check))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
