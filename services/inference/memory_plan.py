"""The inference side of `arlo plan`: the engine's largest programs compiled abstractly, per device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m services.inference.memory_plan [--config RUN.yaml] [--hf-config config.json] --devices 8

prints one JSON object. KV pages, sequences and buckets are the engine's own (`kv_budget.kv_layout`,
`programs.Buckets`), the KV pool is laid out and sharded as the runner lays it out
(`paged_kv.pool_shardings`: pages over the data axes, kv heads over `tensor`), and the programs
are the runner's jitted prefill and decode chunk (services/inference/device_programs.py; the
in-place decode with `inference.attention_kernel: pallas`),
lowered over ShapeDtypeStructs: neither the weights nor the cache are allocated. Two programs
bound the engine's peak: the decode chunk over every sequence at the longest window, and the
prefill of the most prompt rows at the longest prompt bucket. The plan is the larger of their
XLA peaks (arguments, among them the weights in model.param_dtype and the donated cache, +
temporaries + outputs - aliased). The pallas decode is lowered for the planning machine's
platform: on a CPU that is the kernel in interpret mode, whose temporaries include a copy of each
layer's pages (on a GPU or TPU the kernel reads them in place), so plan it on the target's kind.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from arlo.config import RunConfig
from arlo.distributed import make_mesh
from arlo.filter_replay import serving_inference
from arlo.memory_plan import compiled_figures, per_device_bytes, placed, plan_main, plan_source
from arlo.model import abstract_model
from arlo.model.kv_budget import kv_layout
from arlo.model.paged_kv import init_pool, pool_shardings
from arlo.model.sharding import BATCH_AXES, fitted_state_shardings
from services.inference.device_programs import decode_jit, decode_kernel, decode_paged_jit, prefill_jit
from services.inference.programs import MIN_ROWS, MIN_TOKEN_BUCKET, Buckets, pow2
from services.inference.runner import _decode_batch, _prefill_batch


def engine_plan(cfg: RunConfig, hf_config: str = "", devices: int = 1) -> dict[str, Any]:
    ic = serving_inference(cfg)  # top logprobs wide enough for the run's kept sets (filter replay)
    source = plan_source(cfg, hf_config)
    base = source.cfg
    slot_len = min(base.max_seq_len, ic.max_seq_len or base.max_seq_len)
    model_cfg = dataclasses.replace(base, max_seq_len=slot_len)
    kv = kv_layout(ic, model_cfg)
    # As the service: a mesh only over several devices (services/inference/__main__.py).
    mesh = make_mesh(ic.mesh, jax.devices()[:devices], path="inference.mesh") if devices > 1 else None
    one = SingleDeviceSharding(jax.devices()[0])
    abstract = source.abstract_state()
    state = placed(abstract, fitted_state_shardings(abstract, mesh) if mesh is not None
                   else jax.tree.map(lambda _: one, abstract))
    graphdef = nnx.split(abstract_model(base))[0]
    # The runner's pool: the pages + the null page, rounded up to split over the data axes
    # (runner.Runner.__init__).
    ways = 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)
    pages, cache_len = -(-(kv.pages + 1) // ways) * ways, kv.cache_len
    kernel = decode_kernel(ic.attention_kernel, model_cfg, mesh)
    sharding = None if mesh is None else pool_shardings(model_cfg, mesh, pages=pages, page_size=kv.page_size,
                                                        kernel_layout=kernel is not None)
    cache = jax.eval_shape(lambda: init_pool(model_cfg, pages=pages, page_size=kv.page_size,
                                             kernel_layout=kernel is not None))
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                         sharding if sharding is not None else jax.tree.map(lambda _: one, cache))
    buckets = Buckets(num_slots=kv.max_seqs, cache_len=cache_len, max_prefill_rows=ic.max_prefill_rows,
                      max_n=ic.max_n, min_rows=ic.min_rows or MIN_ROWS, in_place_decode=kernel is not None)
    b = buckets.decode_rows(kv.max_seqs)
    w = buckets.decode_window(min(ic.max_prompt_tokens + ic.max_tokens, slot_len))
    batch = _decode_batch([], b, kv.table_len)
    lowered = (decode_paged_jit.lower(graphdef, ic.decode_steps, kernel, sharding, state, cache, batch,
                                      top=ic.max_top_logprobs)
               if kernel is not None else
               decode_jit.lower(graphdef, ic.decode_steps, w, sharding, state, cache, batch, top=ic.max_top_logprobs))
    decode = compiled_figures(lowered.compile())
    # The longest prefill row: a prompt, or where samples can be preempted (partial rollouts, or
    # fewer pages than every sequence at full length: Engine.preemptible) a resumed sample's
    # prompt and tokens, up to max_prompt_tokens + max_tokens - 1.
    longest = min(ic.max_prompt_tokens, slot_len)
    if cfg.rollout.partial or pages - 1 < kv.max_seqs * kv.table_len:
        longest = max(longest, min(ic.max_prompt_tokens + ic.max_tokens - 1, slot_len - 1))
    t = min(pow2(longest, MIN_TOKEN_BUCKET), cache_len)
    m = buckets.prefill_rows(buckets.prefill_rows_cap(), t)
    span = -(-t // kv.page_size)
    prefill = compiled_figures(prefill_jit.lower(graphdef, buckets.window(t), span, sharding, state, cache,
                                                  _prefill_batch([], m, t, buckets.samples, kv.table_len),
                                                  top=ic.max_top_logprobs).compile())
    worst = max(("decode", decode), ("prefill", prefill), key=lambda kv: kv[1]["peak_bytes"])
    return {"devices": devices, "mesh": dict(mesh.shape) if mesh is not None else {}, "num_slots": kv.max_seqs,
            "kv_pages": kv.pages, "page_size": kv.page_size,
            "slot_len": slot_len, "param_dtype": source.param_dtype, "dtype": base.dtype,
            "parameters_bytes": per_device_bytes(state), "kv_cache_bytes": per_device_bytes(cache),
            "decode": {"rows": b, "window": w, **decode},
            "prefill": {"rows": m, "tokens": t, "window": buckets.window(t), "samples": buckets.samples, **prefill},
            "largest_program": worst[0], "temporaries_bytes": worst[1]["temporaries_bytes"],
            "total_bytes": worst[1]["peak_bytes"]}


if __name__ == "__main__":
    sys.exit(plan_main(__doc__.split("\n\n")[0], engine_plan))
