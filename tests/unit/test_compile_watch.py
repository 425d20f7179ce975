"""CompileWatch tells a late compile (a stall) from one made ahead of use, on a real jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arlo.compile_watch import CompileWatch, ahead_of_use


def test_compiles_after_warm_up_are_late_unless_made_ahead_of_use_and_still_ahead() -> None:
    watch = CompileWatch().install()
    try:
        f = jax.jit(lambda x: x * 3 + 1)
        x7 = jnp.zeros(7)
        watch.mark_warm()
        with ahead_of_use():
            f.lower(jax.ShapeDtypeStruct((5,), jnp.float32)).compile()  # made ahead: nothing waited for it
        assert (watch.late, watch.ahead) == (0, 1)
        with ahead_of_use(lambda: False):  # a request needed it meanwhile: it waited, a stall
            f.lower(jax.ShapeDtypeStruct((6,), jnp.float32)).compile()
        assert (watch.late, watch.ahead) == (1, 1)
        f(x7)  # compiled on use, outside any block
        assert (watch.late, watch.ahead) == (2, 1) and watch.metrics()["ahead_compiles"] == 1
    finally:
        watch.close()


def test_a_long_compile_is_followed_by_a_heap_trim_and_a_short_one_is_not(monkeypatch) -> None:
    """The trim gives back what a compile freed before the program runs (arlo/heap_trim.py)."""
    import sys

    import arlo.compile_watch as compile_watch
    from arlo.heap_trim import trim_heap

    if sys.platform.startswith("linux"):
        assert trim_heap()  # glibc here: the real call, which must not fail
    monkeypatch.setattr(compile_watch, "TRIM_AFTER_S", 0.0)
    watch = CompileWatch().install()
    try:
        jax.jit(lambda x: x * 5 - 2).lower(jax.ShapeDtypeStruct((9,), jnp.float32)).compile()
        assert watch.heap_trims == (1 if trim_heap() else 0)
        monkeypatch.setattr(compile_watch, "TRIM_AFTER_S", 3600.0)
        jax.jit(lambda x: x * 7 - 2).lower(jax.ShapeDtypeStruct((9,), jnp.float32)).compile()
        assert watch.heap_trims == (1 if trim_heap() else 0)
    finally:
        watch.close()
