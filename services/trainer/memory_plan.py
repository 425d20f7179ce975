"""The trainer's side of `arlo plan`: the RL step compiled abstractly, and its per-device bytes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m services.trainer.memory_plan [--config RUN.yaml] [--hf-config config.json] --devices 8

prints one JSON object. The step is the learner's own (`learner._rl_step`, with the learner's
optimizer, parameter shardings and batch layout), lowered over ShapeDtypeStructs: no parameter
is allocated, so a 7B plan runs on a laptop. `arlo plan` (arlo/app/plan.py) starts this module
with CPU devices faked to the mesh's size (the flag above, read when JAX starts).

From XLA (`compiled.memory_analysis()`, one device of the SPMD program): the step's arguments
(float32 master parameters, AdamW state, the KL reference, the batch), its temporaries
(activations kept for the backward, gradients, logits) and outputs, less what they reuse of the
donated arguments. One figure is a formula: the serving copy a publish casts to
`model.param_dtype` (sharded as the parameters), which an overlapped publish keeps beside the
next step, so `total_bytes` counts it.

Not planned: the GAE critic (`algorithm.advantage: gae`: a second backbone and its AdamW) and
the SFT warm start's step (its own AdamW state, made before RL's and dropped when RL starts).
With `trainer.lora` the trained parameters, AdamW and the publish are the adapters' and the
frozen base (model.param_dtype) is one more argument; a quantised base (QLoRA) is refused.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from arlo.config import RunConfig, TrainerConfig
from arlo.distributed import make_mesh
from arlo.filter_replay import run_kept_width
from arlo.memory_plan import compiled_figures, per_device_bytes, placed, plan_main, plan_source
from arlo.model import abstract_model
from arlo.model.lora import split_adapters
from arlo.model.sharding import batch_sharding
from arlo.model.source import ModelSource, cast_state
from services.trainer.batching import bucket_length
from services.trainer.learner import _rl_step, fitted_shardings
from services.trainer.optimizers import rl_optimizer


def _replicated(mesh: Mesh | None) -> Any:
    return NamedSharding(mesh, PartitionSpec()) if mesh is not None else SingleDeviceSharding(jax.devices()[0])


def batch_rows(tc: TrainerConfig, *, rows: int, length: int, mesh: Mesh | None,
               kept: int = 0) -> tuple[dict[str, Any], int]:
    """The step's rows as `Learner._on_device` lays them out ([micro-batches, size, length],
    padded to whole micro-batches per mini-batch, rows over the data axes), abstract; and the
    number of mini-batches. `kept`: filter replay's K (the kept sets ride along, [..., K] int32)."""
    mini = min(tc.mini_batches, rows)
    mini_rows = -(-rows // mini)
    size = tc.micro_batch_size or mini_rows
    padded = mini * size * -(-mini_rows // size)
    sharding = batch_sharding(mesh, size, ndim=3) if mesh is not None else _replicated(None)
    dtypes = {"tokens_bt": np.int32, "behaviour_logprobs_bt": np.float32, "mask_bt": np.float32}
    out = {name: jax.ShapeDtypeStruct((padded // size, size, length), dtype, sharding=sharding)
           for name, dtype in dtypes.items()}
    if kept:
        out["kept_btk"] = jax.ShapeDtypeStruct(
            (padded // size, size, length, kept), np.int32,
            sharding=batch_sharding(mesh, size, ndim=4) if mesh is not None else _replicated(None))
    return out, mini


def train_step_plan(source: ModelSource, cfg: RunConfig, *, mesh: Mesh | None, groups: int, group_size: int,
                    length: int) -> dict[str, Any]:
    """Per-device bytes of one RL step over `groups` x `group_size` rows of `length` tokens."""
    tc = cfg.trainer
    graphdef = nnx.split(abstract_model(source.cfg))[0]
    abstract = source.abstract_state("float32")
    shardings = (fitted_shardings(abstract, mesh) if mesh is not None
                 else jax.tree.map(lambda _: _replicated(None), abstract))
    # As `learner.initial_params`: the whole model in float32, or with LoRA the adapters in
    # float32 and the frozen base in param_dtype (a never-donated argument of every step).
    state, frozen = placed(abstract, shardings), None
    if source.cfg.lora is not None:
        adapters, frozen = split_adapters(state)
        state, frozen = adapters, cast_state(frozen, source.param_dtype)
        shardings = jax.tree.map(lambda x: x.sharding, state)
    tx = rl_optimizer(tc)
    # The optimizer state placed as the learner's eager `tx.init` places it: moments as their
    # parameters, scalars (Adam's count, uncommitted there) replicated.
    opt_state = optax.tree_utils.tree_map_params(
        tx, lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(tx.init, state),
        shardings, transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_replicated(mesh)))
    ref = cast_state(state, source.param_dtype) if tc.algorithm.kl_coef else None
    rows, mini = batch_rows(tc, rows=groups * group_size, length=length, mesh=mesh, kept=run_kept_width(cfg))
    rewards = jax.ShapeDtypeStruct((groups, group_size), np.float32, sharding=_replicated(mesh))
    key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=_replicated(mesh))
    step = jax.jit(functools.partial(_rl_step, graphdef, tx, tc, source.param_dtype, cfg.rollout.sampling),
                   donate_argnums=(0, 1), static_argnums=(6,))
    kwargs = {} if frozen is None else {"frozen": frozen}
    xla = compiled_figures(step.lower(state, opt_state, ref, rows, rewards, key, mini, **kwargs).compile())
    serving = per_device_bytes(cast_state(state, source.param_dtype))
    return {"parameters_bytes": per_device_bytes(state), "frozen_base_bytes": per_device_bytes(frozen),
            "optimizer_bytes": per_device_bytes(opt_state),
            "reference_bytes": per_device_bytes(ref) if ref is not None else 0, "batch_bytes": per_device_bytes(rows),
            **{k: v for k, v in xla.items() if k != "peak_bytes"}, "step_peak_bytes": xla["peak_bytes"],
            "publish_copy_bytes": serving, "total_bytes": xla["peak_bytes"] + serving}


def trainer_plan(cfg: RunConfig, hf_config: str = "", devices: int = 1) -> dict[str, Any]:
    """`arlo plan`'s trainer figures for the run's batch: groups_per_step x group_size rows of
    the length bucket rollout.max_episode_tokens takes (within the model's context), the longest
    the trainer compiles."""
    tc = cfg.trainer
    source = plan_source(cfg, hf_config)
    # As the service builds it: a mesh only over several devices (services/trainer/__main__.py).
    mesh = make_mesh(tc.mesh, jax.devices()[:devices], path="trainer.mesh") if devices > 1 else None
    top = cfg.rollout.max_episode_tokens
    length = min(bucket_length(min(top, source.cfg.max_seq_len), longest_episode=top), source.cfg.max_seq_len)
    figures = train_step_plan(source, cfg, mesh=mesh, groups=tc.groups_per_step, group_size=cfg.rollout.group_size,
                              length=length)
    return {"devices": devices, "mesh": dict(mesh.shape) if mesh is not None else {},
            "rows": tc.groups_per_step * cfg.rollout.group_size, "length": length,
            "num_params": source.cfg.num_params(), "lora_rank": tc.lora.rank, "remat": tc.remat, "logprob_chunk": tc.logprob_chunk,
            "micro_batch_size": tc.micro_batch_size, "param_dtype": source.param_dtype, "dtype": source.cfg.dtype,
            **figures}


if __name__ == "__main__":
    sys.exit(plan_main(__doc__.split("\n\n")[0], trainer_plan))
