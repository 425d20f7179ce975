"""This machine's ceilings, measured in the same run as the thing they judge.

floor time = max(FLOPs / GEMM FLOP/s, bytes / memory bandwidth); roofline_fraction =
floor time / measured time. Both ceilings come from jitted kernels on the default device:
a large float32 (or bf16) GEMM, and a large in-place array update (read + write).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True, kw_only=True, slots=True)
class Ceilings:
    gemm_flops_per_s: float
    mem_bytes_per_s: float
    device: str

    def floor_s(self, flops: float, bytes_moved: float) -> float:
        return max(flops / self.gemm_flops_per_s, bytes_moved / self.mem_bytes_per_s)


def best_time(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Fastest of `repeats` runs (after warmup): the least noisy estimate on a shared machine."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(*, gemm_dim: int = 2048, mem_mib: int = 256, dtype: str = "float32") -> Ceilings:
    dt = jnp.dtype(dtype)
    a = jnp.ones((gemm_dim, gemm_dim), dt)
    b = jnp.ones((gemm_dim, gemm_dim), dt)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dt))
    gemm_s = best_time(lambda: matmul(a, b))
    n = mem_mib * (1 << 20) // 4
    update = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    buf = [jnp.zeros((n,), jnp.float32)]

    def step() -> jax.Array:
        buf[0] = update(buf[0])
        return buf[0]

    mem_s = best_time(step)
    return Ceilings(gemm_flops_per_s=2 * gemm_dim**3 / gemm_s, mem_bytes_per_s=2 * n * 4 / mem_s,
                    device=str(jax.devices()[0].device_kind))
