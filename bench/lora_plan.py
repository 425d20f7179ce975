"""bench/lora.py's `plan` part: XLA's peak bytes of the learner's RL step with full fine-tuning,
LoRA and QLoRA, compiled over abstract arrays (nothing allocated, nothing run)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

PLANS = {"full": (False, "none"), "lora": (True, "none"), "qlora_int8": (True, "int8"), "qlora_nf4": (True, "nf4")}


def planned_step(args: argparse.Namespace, lora: bool, quantize: str, run_config: Callable[..., Any]) -> dict[str, int]:
    """XLA's peak bytes of the learner's own RL step at the step shape, compiled over abstract
    arrays (nothing allocated: what `arlo plan` does, whose figures equal the real step's XLA
    peak, docs/plan.md), with the trained state, the frozen base and AdamW as the Learner holds
    them (learner.initial_params): also for QLoRA, which `arlo plan` does not plan yet.
    `run_config`: bench/lora.py's, the run as its trainer steps load it (passed: no import cycle)."""
    import functools

    import jax
    import numpy as np
    from flax import nnx

    from arlo.memory_plan import compiled_figures
    from arlo.model import abstract_model
    from arlo.model.lora import split_adapters
    from arlo.model.quantize import quantize_base
    from arlo.model.source import cast_state
    from services.trainer.learner import _rl_step
    from services.trainer.memory_plan import batch_rows
    from services.trainer.optimizers import rl_optimizer

    seq = args.prompt + args.step_tokens
    run = run_config(args, rank=args.rank if lora else 0, param_dtype="bfloat16", seq=seq, quantize=quantize)
    source, tc = run.model_source(), run.trainer
    state, frozen = source.abstract_state("float32"), None
    if source.cfg.lora is not None:
        state, base = split_adapters(state)
        shape = source.cfg.lora
        frozen = jax.eval_shape(lambda b: quantize_base(cast_state(b, source.param_dtype), shape.quantize,
                                                        shape.quant_block), base)
    tx = rl_optimizer(tc)
    rows, mini = batch_rows(tc, rows=args.groups * args.group_size, length=seq, mesh=None)
    step = jax.jit(functools.partial(_rl_step, nnx.split(abstract_model(source.cfg))[0], tx, tc,
                                     source.param_dtype, run.rollout.sampling), donate_argnums=(0, 1),
                   static_argnums=(6,))
    lowered = step.lower(state, jax.eval_shape(tx.init, state), None, rows,
                         jax.ShapeDtypeStruct((args.groups, args.group_size), np.float32),
                         jax.ShapeDtypeStruct((2,), np.uint32), mini, **({} if frozen is None else {"frozen": frozen}))
    return compiled_figures(lowered.compile())
