"""SIGTERM (and SIGHUP: the terminal closed) stops a command as Ctrl-C does, wherever it arrives.

The handler raises `Stop`, a BaseException like KeyboardInterrupt, so no `except Exception` on
the way swallows it (the driver's retries ride out outages by catching errors: a stop raised as
an Exception inside one could be taken for a failed call; a repro's `arlo train` once went on
past a SIGTERM, hung).
Inside an event loop the signal raises nothing at an arbitrary bytecode, in asyncio's or gRPC's
own machinery, which could leave them unable to shut down (CI saw `arlo train` abort, SIGABRT, on
a SIGTERM): `run` cancels the main task, as asyncio does for Ctrl-C, and raises Stop once it has
unwound. Nor inside native code that calls back into Python: a SIGTERM while `arlo train`
imported tensorboardX (and torch under it) raised in a pybind11 callback, and the process
aborted ("terminate called after throwing an instance of 'pybind11::error_already_set'"):
such work runs in `deferred()`, where a stop waits for the block's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Stop(BaseException):
    """SIGTERM or SIGHUP: stop as Ctrl-C would."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""What stops a command as Ctrl-C does: a supervisor's or Kubernetes' stop, a closed terminal
(SIGHUP's default ended `arlo demo` at once, 129, its report unwritten). A signal the process
was started ignoring stays ignored: `nohup arlo up` keeps running when its terminal closes."""


def _stop_signals() -> list[signal.Signals]:
    return [s for s in STOP_SIGNALS if s == signal.SIGTERM or signal.getsignal(s) is not signal.SIG_IGN]


_deferring = 0
_pending = False


def _raise_stop(signum: int, frame: object) -> None:
    global _pending
    if _deferring:
        _pending = True  # raised when the deferred block ends
        return
    raise Stop()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A SIGTERM inside the block raises Stop at its end, not in the middle of it (for native
    code that calls Python back, or work that must not be cut in half)."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _pending:
        _pending = False
        raise Stop()


def stop_on_sigterm() -> None:
    """From now on SIGTERM and SIGHUP raise Stop (in the main thread, outside `run`'s event loop)."""
    for signum in _stop_signals():
        signal.signal(signum, _raise_stop)


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`; a SIGTERM or SIGHUP meanwhile cancels `main` and raises Stop once it unwound."""
    return asyncio.run(_until_stopped(main))


async def _until_stopped(main: Coroutine[Any, Any, T]) -> T:
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        task.cancel()

    outside = {signum: signal.getsignal(signum) for signum in _stop_signals()}
    for signum in outside:
        loop.add_signal_handler(signum, stop)
    try:
        result = await main
    except asyncio.CancelledError:
        if stopped:
            raise Stop() from None
        raise
    finally:
        for signum, handler in outside.items():
            loop.remove_signal_handler(signum)  # leaves SIG_DFL: the handler from before the loop again
            signal.signal(signum, handler)
    if stopped:  # `main` swallowed its cancellation: the stop stands all the same
        raise Stop()
    return result


class Shield:
    """What `shielded` noted: whether a SIGINT, SIGTERM or SIGHUP arrived inside its block."""

    signalled = False


@contextlib.contextmanager
def shielded() -> Iterator[Shield]:
    """Ctrl-C, SIGTERM and SIGHUP inside the block are noted (`Shield.signalled`), not raised: short work
    that must not be cut (closing a run's record, writing its report before the services stop,
    killing them); the handlers from before come back at its end, and the caller decides what a
    noted stop means. Off the main thread, where handlers cannot be set, the block runs as it is."""
    shield = Shield()

    def note(signum: int, frame: object) -> None:
        shield.signalled = True

    try:
        before = {signum: signal.signal(signum, note) for signum in (signal.SIGINT, *_stop_signals())}
    except ValueError:  # not the main thread
        yield shield
        return
    try:
        yield shield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
