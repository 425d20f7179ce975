"""The engine's programs past its start-up warm-up, compiled while it is idle.

Why: the limits of a run (prompt and completion lengths, slots, prefill rows) may allow more
programs than `inference.warmup_programs` lets the start-up compile (the built-in demo's allow
50: about a minute on a 2-core host), and each then compiled on first use, seconds of stall on
the path of the requests that needed it; the demo's RL steps met some of them after its SFT
warm start, during which inference sat idle for minutes. With `inference.compile_when_idle`
those programs compile on a thread of their own, one at a time, whenever the engine has served
nothing for `IDLE_S`: a program a later request needs is then ready, and one needed before its
turn compiles on first use, as it would have anyway. Nothing runs: the compile sees only the
shapes of the weights and the cache (`runner.abstract`), never the buffers the engine donates.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from services.inference.programs import Key

log = logging.getLogger(__name__)

IDLE_S = 0.5
"""How long the engine must have been idle before the next program compiles: a pause between
two requests of a burst is not idleness."""
POLL_S = 0.1
NICE = 19
IN_FLIGHT_WAIT_S = 300.0
"""How long `stop` waits for the compile in flight (seconds on a CPU; an accelerator's autotuning
can take tens)."""


def idle_order(keys: Iterable[Key]) -> list[Key]:
    """Small windows first (short sequences: every run's first turns, and all of a run whose
    episodes are short), within a window decode before prefill (every request decodes), then by
    token bucket and rows, small first. A key's window: decode ("decode", rows, w); prefill
    ("prefill", rows, tokens, w, samples)."""
    def order(key: Key) -> tuple[int, bool, int, int]:
        if key[0] == "decode":
            return int(key[2]), False, 0, int(key[1])
        return int(key[3]), True, int(key[2]), int(key[1])
    return sorted(keys, key=order)


class IdleCompiler:
    """Compiles `keys` in order, each once the engine has been idle for `IDLE_S`."""

    def __init__(self, keys: Iterable[Key], *, idle_s: Callable[[], float], compile_one: Callable[[Key], bool]) -> None:
        """`idle_s`: how long the engine has been idle (0 while it works); `compile_one(key)`:
        compiles it, False when there was nothing to do (already compiled by a request)."""
        self.keys = idle_order(keys)
        self.idle_s = idle_s
        self.compile_one = compile_one
        self.compiled = 0
        self.failed = 0
        self.compiling: Key | None = None
        """The program being compiled now."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.keys:
            self._thread = threading.Thread(target=self._run, name="inference-idle-compile", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = IN_FLIGHT_WAIT_S) -> None:
        """Compiles no further program, and waits for the one in flight: the thread is a daemon,
        and XLA still compiling on it while the interpreter exits aborts the process ("pure
        virtual method called", SIGABRT: CI saw an inference service die so on SIGTERM)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("a program compiled while idle is still compiling after %.0fs; stopping anyway", timeout_s)

    def _run(self) -> None:
        _lower_this_threads_priority()
        started, spent = time.monotonic(), 0.0
        for key in self.keys:
            while self.idle_s() < IDLE_S:
                if self._stop.wait(POLL_S):
                    return
            if self._stop.is_set():
                return
            begun = time.monotonic()
            self.compiling = key
            try:
                if self.compile_one(key):
                    self.compiled += 1
                    spent += time.monotonic() - begun
            except Exception:  # the program compiles on first use instead
                self.failed += 1
                log.exception("compiling program %s while idle failed; it compiles on first use", key)
            finally:
                self.compiling = None
        log.info("idle-time warm-up done: %d programs compiled in %.1fs of idle time (over %.0fs), %d failed",
                 self.compiled, spent, time.monotonic() - started, self.failed, extra={"programs": self.compiled})


def _lower_this_threads_priority() -> None:
    """The compiles yield the CPU to anything else (Linux nice values are per thread): on a small
    host a request, the trainer beside it or a test's processes come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compiles at the usual priority
        pass
