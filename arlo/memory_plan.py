"""What the trainer's and inference's memory plans share (`arlo plan`; their halves are
services/trainer/memory_plan.py and services/inference/memory_plan.py, each started as a
subprocess whose CPU devices are faked to its mesh's size).

Both build the run's model from its shapes alone, lower their service's own jitted programs over
ShapeDtypeStructs (nothing is allocated) and read XLA's figures for one device of the SPMD
program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from arlo.config import ConfigError, RunConfig, load_config
from arlo.model import ModelConfig
from arlo.model.source import ModelSource

FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"
"""XLA:CPU's flag for N host devices: a mesh of N on a laptop (read once, when JAX starts)."""


def plan_source(cfg: RunConfig, hf_config: str = "") -> ModelSource:
    """The run's model as the services build it (`model.path` or the preset, with
    `trainer.lora`'s adapters), or, with `hf_config` (a Hugging Face config.json alone, no
    weights), that shape with the run's dtypes, sequence cap and adapters. Only shapes are used."""
    if cfg.trainer.lora.rank and cfg.trainer.lora.quantize != "none":
        raise ValueError(f"trainer.lora.quantize: {cfg.trainer.lora.quantize!r} is not planned yet "
                         "(plan with 'none': the base then counts in model.param_dtype, an upper bound)")
    source = cfg.model_source()
    if not hf_config:
        return source
    try:
        with open(hf_config) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--hf-config {hf_config}: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"--hf-config {hf_config}: expected a JSON object")
    model_cfg = ModelConfig.from_hf_config(hf, dtype=cfg.model.dtype)
    if cfg.model.max_seq_len:
        model_cfg = ModelConfig.from_hf_config(hf, dtype=cfg.model.dtype,
                                               max_seq_len=min(model_cfg.max_seq_len, cfg.model.max_seq_len))
    # The run's adapters (the LoraShape the services build) on the config.json's shape.
    model_cfg = dataclasses.replace(model_cfg, lora=source.cfg.lora)
    return ModelSource.from_config(model_cfg, param_dtype=cfg.model.param_dtype)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs (each leaf's shard; a leaf without
    a sharding counts whole)."""
    import jax
    import jax.numpy as jnp

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape if getattr(x, "sharding", None) is None else x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def placed(tree: Any, shardings: Any) -> Any:
    """`tree`'s shapes and dtypes with `shardings` (a tree of the same structure)."""
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compiled_figures(compiled: Any) -> dict[str, int]:
    """XLA's per-device figures of a compiled program; `peak_bytes` = arguments + outputs -
    what the outputs reuse of the donated arguments + temporaries."""
    mem = compiled.memory_analysis()
    return {"arguments_bytes": mem.argument_size_in_bytes, "temporaries_bytes": mem.temp_size_in_bytes,
            "outputs_bytes": mem.output_size_in_bytes, "aliased_bytes": mem.alias_size_in_bytes,
            "peak_bytes": (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                           + mem.temp_size_in_bytes)}


def plan_main(description: str, plan: Callable[[RunConfig, str, int], dict[str, Any]],
              argv: list[str] | None = None) -> int:
    """A service's plan module's command line: `--config`, `--hf-config`, `--devices`; prints the
    plan as one JSON line, or the error on stderr with exit status 2."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="run config YAML (default: the built-in one)")
    parser.add_argument("--hf-config", default="", help="a Hugging Face config.json: the model's shape, no weights")
    parser.add_argument("--devices", type=int, default=1, help="devices of the service's mesh")
    args = parser.parse_args(argv)
    import jax

    if not 1 <= args.devices <= len(jax.devices()):
        print(f"--devices {args.devices}: must be in [1, {len(jax.devices())}] here (more CPU devices need "
              f"XLA_FLAGS={FAKE_DEVICES_FLAG}={args.devices} before JAX starts)", file=sys.stderr)
        return 2
    try:
        figures = plan(load_config(args.config), args.hf_config, args.devices)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(figures))
    return 0
