"""The persistent compilation cache: where it lives, and that a small program lands in it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arlo.compile_cache import ENV, cache_dir


def test_cache_dir_follows_the_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ARLO_HOME", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    assert cache_dir() == tmp_path.resolve() / "jax-cache"
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    monkeypatch.setenv(ENV, "off")
    assert cache_dir() is None


def test_a_small_program_is_cached(tmp_path: Path) -> None:
    # JAX by default caches only programs that took >= 1 s to compile; arlo's are mostly
    # faster than that, and together they are the start-up. A fresh process, so the setting
    # applies before its first compile, as in a service.
    code = ("from arlo.compile_cache import enable_compile_cache; import jax, jax.numpy as jnp; "
            "enable_compile_cache(); print(jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).sum())")
    env = {**os.environ, ENV: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert any((tmp_path / "cache").iterdir()), "nothing was written to the cache"
