"""A script run on N fake CPU devices (`--xla_force_host_platform_device_count`): the device
count is fixed when JAX starts, so a sharding test runs its body in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_on_fake_devices(script: str, *args: str, devices: int = 8, timeout_s: float) -> str:
    """Runs `python -c script args...` from the repository root on `devices` CPU devices; asserts
    it exits 0 and returns its stdout. `timeout_s` has no default: a literal at the call is what
    tests/unit/test_timeout_budgets.py checks against the test's own pytest timeout."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
