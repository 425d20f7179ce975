"""Every XLA compile in this process, counted and timed, and those after warm-up reported.

A service compiles its programs while it comes up (its warm-up); a compile after that is a
stall on the critical path (seconds on a small CPU host), and a run should have none. JAX
announces each backend compile (a persistent-cache hit included) through `jax.monitoring`;
`CompileWatch` listens, counts, and from `mark_warm()` on logs each compile with its name and
turns on `jax_log_compiles`, so the service's log says which shapes came in late. After a
compile of a second or more it also trims the C heap (arlo/heap_trim.py): what the compile freed
would otherwise stay in the process and add to the next step's peak.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from arlo.heap_trim import trim_heap

log = logging.getLogger(__name__)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
TRIM_AFTER_S = 1.0
"""Compiles at least this long are followed by a heap trim (short ones free little)."""
RECENT = 16
"""Late compiles remembered by name (the newest), for the heartbeat and tests."""

_thread = threading.local()


@contextlib.contextmanager
def ahead_of_use(still_ahead: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """Compiles on this thread inside the block are made ahead of any use (a warm-up that goes
    on in the background after the service is up): counted as `ahead`, not as late, unless
    `still_ahead()` is False when one ends (a request needed the program meanwhile and waited
    for it: a stall, counted late)."""
    _thread.ahead = still_ahead
    try:
        yield
    finally:
        _thread.ahead = None


class CompileWatch:
    """Counts this process's XLA compiles; `install()` once per process, `close()` to stop."""

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_s = 0.0
        self.cache_hits = 0
        self.warm_at: float | None = None
        self.late = 0
        """Compiles after `mark_warm()`: the number a run should keep at 0."""
        self.late_s = 0.0
        self.late_names: deque[str] = deque(maxlen=RECENT)
        self.ahead = 0
        """Compiles after `mark_warm()` made ahead of use (`ahead_of_use`): not stalls."""
        self.heap_trims = 0
        self._lock = threading.Lock()  # compiles happen on any thread (the engine's, to_thread's)
        self._installed = False
        self._log_compiles: bool | None = None  # jax_log_compiles before mark_warm, restored by close

    def install(self) -> CompileWatch:
        import jax.monitoring

        if not self._installed:
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._installed = True
        return self

    def close(self) -> None:
        import jax.monitoring

        if self._installed:
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._installed = False
        if self._log_compiles is not None:
            jax.config.update("jax_log_compiles", self._log_compiles)
            self._log_compiles = None

    def mark_warm(self) -> None:
        """Warm-up is over: from now on every compile is a late one (logged, with its shapes)."""
        import jax

        with self._lock:
            self.warm_at = time.monotonic()
        if self._log_compiles is None:
            self._log_compiles = bool(jax.config.jax_log_compiles)
        jax.config.update("jax_log_compiles", True)  # JAX then logs each compile's shapes at WARNING
        # Every compile of the start counts (loading weights, small helpers), not only the warm-up's
        # programs: with the warm-up skipped, "warm-up done: 23 programs" read as a contradiction.
        log.info("start done: %d XLA programs compiled or loaded so far, in %.1fs (%d from the persistent "
                 "cache); later compiles are logged as late",
                 self.compiles, self.compile_s, self.cache_hits,
                 extra={"compiles": self.compiles, "compile_s": round(self.compile_s, 3),
                        "cache_hits": self.cache_hits})

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event != COMPILE_EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        still_ahead = getattr(_thread, "ahead", None)
        ahead = still_ahead is not None and still_ahead()
        with self._lock:
            self.compiles += 1
            self.compile_s += duration
            late = self.warm_at is not None and not ahead
            self.ahead += self.warm_at is not None and ahead
            if late:
                self.late += 1
                self.late_s += duration
                self.late_names.append(name)
        if duration >= TRIM_AFTER_S and trim_heap():  # on the compiling thread, before the program runs
            with self._lock:
                self.heap_trims += 1
        if late:
            log.warning("compiled %s after warm-up (%.2fs): a shape the warm-up did not cover", name, duration,
                        extra={"late_compiles": self.late, "program": name, "compile_s": round(duration, 3)})

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def metrics(self) -> dict[str, int | float]:
        """For heartbeats and /metrics: plain numbers."""
        with self._lock:
            return {"compiles": self.compiles, "compile_s": round(self.compile_s, 3), "compile_cache_hits": self.cache_hits,
                    "late_compiles": self.late, "late_compile_s": round(self.late_s, 3),
                    "ahead_compiles": self.ahead}
