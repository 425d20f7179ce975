"""Processes that do not run a model never import JAX: the CLI, config loading, rollout, the env
gateway and reward. Importing it took 3-8 s of each one's start on a busy 2-core host, on the
path from `arlo demo` to the first RL step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CODE = """
import sys
import arlo.app.cli, services.rollout.__main__, services.env_gateway.__main__, services.reward.__main__
from arlo.config import load_config
from arlo.data import resource_path
from arlo.model.tokenizer import get_tokenizer, tokenizer_name
cfg = load_config(resource_path("demo.yaml"))
get_tokenizer(tokenizer_name(path=cfg.model.path, tokenizer=cfg.model.tokenizer))
print(sorted(m for m in ("jax", "flax", "optax", "orbax") if m in sys.modules))
"""

ROOT = Path(__file__).resolve().parents[2]


def test_light_processes_do_not_import_jax() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip().splitlines()[-1] == "[]"
