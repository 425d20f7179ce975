"""arlo/compile_parallel.py: warm-up programs compiled side by side, in order, failures after all."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlo.compile_parallel import compile_all


def test_real_programs_compile_on_threads_and_come_back_in_order() -> None:
    fns = [jax.jit(lambda x, k=k: jnp.tanh(x) * k + jnp.sum(x)) for k in range(4)]
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    compiled = compile_all([lambda f=f: f.lower(x) for f in fns], threads=3)
    for k, (program, f) in enumerate(zip(compiled, fns, strict=True)):
        np.testing.assert_allclose(np.asarray(program(x)), np.asarray(f(x)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(program(x)), np.tanh(x) * k + x.sum(), rtol=1e-5)


class _Slow:
    """A lowered program's compile that takes a while and says on which thread it ran."""

    def __init__(self, seen: list[str], fail: bool = False) -> None:
        self.seen, self.fail = seen, fail

    def compile(self) -> str:
        time.sleep(0.2)
        self.seen.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("XLA said no")
        return "ok"


def test_compiles_overlap_and_a_failure_is_raised_only_after_every_compile_ran() -> None:
    seen: list[str] = []
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="XLA said no"):
        compile_all([lambda: _Slow(seen, fail=True), *[lambda: _Slow(seen)] * 3], threads=4)
    assert len(seen) == 4  # none abandoned behind the exception
    assert len(set(seen)) == 4 and time.perf_counter() - started < 0.7  # side by side, not 0.8 s in a row
    assert compile_all([lambda: _Slow([])], threads=8) == ["ok"]  # one program: no pool
