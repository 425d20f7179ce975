"""Python's cyclic garbage collector, kept off the critical path of a step.

After imports and model load a service holds ~250k objects that the collector tracks (JAX,
flax, protobuf, gRPC). A full, generation-2 collection walks every one of them: ~100 ms in the
inference process on the 2-core dev machine. That process runs nothing else meanwhile (the
collector holds the GIL). In a 15-step sync run at 596k, one such pause held the GetModelInfo
RPC of the rollout's admission check for 114 ms; its usual time is 1.5 ms.

`freeze_startup` moves what start-up made into the permanent generation, which collections
skip: a full collection then walks only what came after, ~0 ms right after the freeze.
Reference counting still frees frozen objects. Only cyclic garbage among them would stay, and
nearly all start-up objects live as long as the process (a review checked the per-version
states: the weights, the optimizer state, the KV cache are freed by reference counting). `GcPauses` times every collection, per
generation, for `/metrics` and the service's last log line. ARLO_GC_FREEZE=0 leaves the freeze
out, for A/B runs.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter

FREEZE_ENV = "ARLO_GC_FREEZE"
_freezing = False
"""Set while `freeze_startup` collects: a deliberate collection, off the path, is not a pause."""


def freeze_startup() -> int:
    """Collects once, then freezes every object left; returns how many are frozen (0: ARLO_GC_FREEZE=0)."""
    global _freezing
    if os.environ.get(FREEZE_ENV, "1").strip() == "0":
        return 0
    _freezing = True
    try:
        gc.collect()
    finally:
        _freezing = False
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times the collector's runs through `gc.callbacks` until `close`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self.longest_s = 0.0
        self._started = 0.0
        counter = Counter("arlo_gc_pause_seconds", "Time Python's cyclic garbage collector held the process, "
                          "by generation.", ["generation"],
                          registry=registry if registry is not None else CollectorRegistry())
        # Made here, not in the callback: `labels()` takes the counter's lock, which a /metrics
        # scrape holds while it allocates, and so may start a collection on its own thread; the
        # callback would then wait for that lock forever, and no collection would run again.
        self._counter = counter
        self._children = [counter.labels(str(generation)) for generation in range(3)]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if _freezing:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        generation = int(info.get("generation", 2))
        self.seconds[generation] += elapsed
        self.counts[generation] += 1
        self.longest_s = max(self.longest_s, elapsed)
        self._children[generation].inc(elapsed)

    def summary(self) -> str:
        return (f"gc: {self.counts[2]} full collections ({1e3 * self.seconds[2]:.0f} ms), "
                f"{self.counts[0] + self.counts[1]} young ({1e3 * (self.seconds[0] + self.seconds[1]):.0f} ms), "
                f"longest {1e3 * self.longest_s:.1f} ms")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
