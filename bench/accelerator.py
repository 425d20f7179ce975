"""The prepared accelerator run: decode against HBM bandwidth and transformers, one GRPO step through the services.

    python -m bench.accelerator [--json PATH] [--peak-bw BYTES_PER_S] [--budget-s 480] [--smoke] [--no-pallas]

At Qwen2.5-1.5B's shape (random weights, bfloat16 parameters and compute), on the default JAX
device, in one command of at most --budget-s seconds (each part is skipped, said so, when too
little of it is left):

- decode: arlo's engine, `--batches` concurrent requests of --prompt tokens and --new-tokens new
  ones each (bench/decode.py's requests: sampled at temperature 1 on the device, ignore_eos, so
  every row runs the whole way). tokens/s over the decode
  chunks' span (bench/decode.py's timeline figures), and the share of HBM bandwidth used:
  bytes a step must read (the weights it multiplies, as stored, + each row's cached keys and
  values) / step time / the device's peak (`PEAK_BYTES_PER_S` by device kind, --peak-bw to
  override; on a CPU, the copy bandwidth bench/roofline.py measures); then the same again with
  `inference.attention_kernel: pallas` (JAX's paged-attention kernel read in place; issue 36's
  tokens/s and HBM fraction at batch 64; --no-pallas skips it; on a CPU it runs in interpret mode);
- transformers `generate` (greedy) on the same device in the same run, the same lengths:
  eager (dynamic cache) at every batch, and static cache at --hf-static-batches (on CUDA
  transformers compiles its forward with torch.compile for a static cache; on a CPU it runs
  eager, and the table says so). `arlo_over_hf_b64` is arlo's tokens/s over the faster of the two;
- one GRPO step (--groups x --group-size samples x --step-tokens new tokens) through the local
  services (bench/real_model_services.py, synchronous, --rl-steps steps: the first compiles),
  its split (generation, the engine's part, train step, publish, pull + verify + swap) and
  publish-to-serving seconds, and the services' fixed share: the step less the engine's
  generation and the train step, over the step.

Each part runs in its own process (`--part`), so a part's device memory (JAX preallocates 75%
of a GPU; torch caches its own) is given back before the next one starts. `--smoke` runs the
same code at a tiny shape on a CPU in seconds, without the GRPO step (the services alone take
longer to start), for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    check_json_arg,
    float_above,
    int_at_least,
    int_list,
    print_table,
    run_main,
    write_json,
)
from bench.real_model import SHAPES
from bench.real_model import prompts as random_prompts

SHAPE = {**SHAPES["qwen2.5-0.5b"], "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
         "num_attention_heads": 12, "num_key_value_heads": 2}
"""Qwen2.5-1.5B's published shape (bench/qwen_shapes.py), on bench/real_model.py's 0.5B fields."""
SMOKE_SHAPE = SHAPES["tiny"]
PEAK_BYTES_PER_S = (("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H200", 4.8e12), ("A100", 2.0e12),
                    ("TPU v5 lite", 8.19e11), ("TPU v6", 1.64e12))
"""Datasheet HBM bandwidth by a substring of `device_kind`, first match wins (H100 PCIe before H100)."""
PROMPT_VOCAB = 2000
"""Prompt token ids come from the bench tokenizer's range, as bench/real_model.py's do."""


def peak_bandwidth(kind: str, override: float) -> tuple[float, str]:
    """(bytes/s, where the figure came from) for a device of `kind`."""
    if override:
        return override, "--peak-bw"
    for name, peak in PEAK_BYTES_PER_S:
        if name.lower() in kind.lower():
            return peak, f"datasheet ({name})"
    from bench.roofline import measure_ceilings

    # Small kernels: a CPU has no datasheet figure here, and the smoke run must stay short.
    return measure_ceilings(gemm_dim=256, mem_mib=64).mem_bytes_per_s, "measured copy bandwidth (bench/roofline.py)"


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    return SMOKE_SHAPE if args.smoke else SHAPE


# ----- part "decode": arlo's engine (JAX) -----

def step_bytes(cfg: Any, chunk: Any, param_bytes: int) -> float:
    """Bytes a decode chunk's steps must read: the weights each step multiplies (all of them, the
    embedding table only when it is also the lm_head) and every row's cached keys and values."""
    read_params = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.compute_dtype.itemsize
    return sum(read_params * param_bytes + (chunk.positions + chunk.rows * i) * kv_per_token
               for i in range(chunk.steps))


def decode_part(args: argparse.Namespace, kernel: str = "xla") -> dict[str, Any]:
    import jax

    from arlo.config import InferenceConfig
    from arlo.model import ModelConfig
    from arlo.model.source import ModelSource
    from bench.decode import requests, run_batch
    from services.inference.engine import Engine

    seq = args.prompt + args.new_tokens
    cfg = ModelConfig.from_hf_config({"model_type": "qwen2", **shape_of(args)}, dtype="bfloat16", max_seq_len=seq)
    top = max(args.batches)
    engine = Engine(ModelSource.from_config(cfg, param_dtype="bfloat16"), config=InferenceConfig(
        max_n=1, max_batch=top, max_tokens=args.new_tokens, max_prompt_tokens=args.prompt, max_seq_len=seq,
        decode_steps=args.decode_steps, prefill_tokens=max(2048, top * args.prompt), max_prefill_rows=min(top, 64),
        attention_kernel=kernel))
    kind = str(jax.devices()[0].device_kind)
    peak, peak_from = peak_bandwidth(kind, args.peak_bw)
    out: dict[str, Any] = {}
    try:
        for b in args.batches:
            run_batch(engine, requests(args, b, 0))  # compiles this batch's programs
            wall, tokens, chunks = run_batch(engine, requests(args, b, 1))
            span = chunks[-1].end - chunks[0].start
            steps = sum(c.steps for c in chunks)
            read = sum(step_bytes(cfg, c, 2) for c in chunks)
            out[str(b)] = {"decode_tokens_per_s": (tokens - b) / span, "e2e_tokens_per_s": tokens / wall,
                           "step_ms": 1e3 * span / steps, "bytes_per_step": read / steps,
                           "hbm_fraction": read / span / peak}
    finally:
        engine.close()
    return {"device": kind, "num_params": cfg.num_params(), "peak_bytes_per_s": peak, "peak_from": peak_from,
            "attention_kernel": kernel, "per_batch": out}


# ----- part "hf": transformers generate (torch), same device kind -----

def hf_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.Qwen2Config(**shape_of(args))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"

    def tokens_per_s(batch: int, cache: str | None) -> float:
        ids = torch.tensor(random_prompts(batch, args.prompt, PROMPT_VOCAB, batch), device=device)
        kwargs = {"cache_implementation": cache} if cache else {}

        def run() -> None:
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()

        run()  # warm-up: the static cache's torch.compile happens here
        t0 = time.perf_counter()
        run()
        return batch * args.new_tokens / (time.perf_counter() - t0)

    eager = {str(b): tokens_per_s(b, None) for b in args.batches}
    static = {str(b): tokens_per_s(b, "static") for b in args.hf_static_batches}
    return {"device": kind, "torch": torch.__version__, "transformers": transformers.__version__,
            "static_compiled": device == "cuda", "eager_tokens_per_s": eager, "static_tokens_per_s": static}


# ----- part "step": one GRPO step through the services -----

def step_part(args: argparse.Namespace) -> dict[str, Any]:
    from bench.real_model import write_checkpoint
    from bench.real_model_services import service_step

    path = write_checkpoint(Path(args.dir), dict(shape_of(args)))
    figures = service_step(path, args)
    last = figures["steps"][-1]  # the steady state: the first step carries the compiles
    fixed = last["step_s"] - last["generation_engine_s"] - last["train_step_s"]
    return {**figures, "split": {k: last.get(k) for k in (
        "step_s", "generation_s", "generation_engine_s", "train_step_s", "publish_s", "pull_s", "verify_s", "swap_s",
        "publish_to_serving_s", "pointer_to_serving_s")}, "services_fixed_share": fixed / last["step_s"]}


PARTS = {"decode": decode_part, "decode_pallas": lambda args: decode_part(args, "pallas"), "hf": hf_part,
         "step": step_part}


def run_part(name: str, argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Runs one part in a fresh process; its figures, or {"skipped": why}."""
    if timeout_s < 10:
        return {"skipped": f"budget spent ({timeout_s:.0f}s left)"}
    try:
        out = subprocess.run([sys.executable, "-m", "bench.accelerator", *argv, "--part", name],
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"past the budget ({timeout_s:.0f}s left when it started)"}
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return {"skipped": f"failed: {lines[-1] if lines else out.returncode}", "stderr_tail": out.stderr[-4000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(fig: dict[str, Any]) -> dict[str, Any]:
    """The issue's bars: HBM share and arlo / transformers at batch 64, the services' fixed share."""
    decode, hf = fig["decode"].get("per_batch", {}), fig["hf"]
    out: dict[str, Any] = {}
    if "64" in decode:
        out["hbm_fraction_b64"] = decode["64"]["hbm_fraction"]
        best_hf = max(hf.get(k, {}).get("64", 0.0) for k in ("eager_tokens_per_s", "static_tokens_per_s"))
        if best_hf:
            out["arlo_over_hf_b64"] = decode["64"]["e2e_tokens_per_s"] / best_hf
    pallas = fig.get("decode_pallas", {}).get("per_batch", {})
    if "64" in pallas:
        out["hbm_fraction_b64_pallas"] = pallas["64"]["hbm_fraction"]
        out["decode_tokens_per_s_b64_pallas"] = pallas["64"]["decode_tokens_per_s"]
        if "64" in decode:
            out["pallas_over_xla_b64"] = pallas["64"]["decode_tokens_per_s"] / decode["64"]["decode_tokens_per_s"]
    if "services_fixed_share" in fig["step"]:
        out["services_fixed_share"] = fig["step"]["services_fixed_share"]
        out["publish_to_serving_s"] = fig["step"]["split"]["publish_to_serving_s"]
    return out


def print_figures(fig: dict[str, Any], args: argparse.Namespace) -> None:
    decode, hf, pallas = fig["decode"], fig["hf"], fig["decode_pallas"].get("per_batch", {})
    rows = []
    for b in args.batches:
        d, p = decode.get("per_batch", {}).get(str(b), {}), pallas.get(str(b), {})
        rows.append([b, d.get("decode_tokens_per_s", ""), d.get("e2e_tokens_per_s", ""), d.get("step_ms", ""),
                     d.get("hbm_fraction", ""), p.get("decode_tokens_per_s", ""), p.get("hbm_fraction", ""),
                     hf.get("eager_tokens_per_s", {}).get(str(b), ""),
                     hf.get("static_tokens_per_s", {}).get(str(b), "")])
    static = "static cache, torch.compile" if hf.get("static_compiled") else "static cache (eager: no CUDA)"
    print_table(f"decode at {'the smoke' if args.smoke else 'Qwen2.5-1.5B'} shape, bf16, prompt {args.prompt} + "
                f"{args.new_tokens} new, on {decode.get('device', '?')} (peak {decode.get('peak_bytes_per_s', 0) / 1e9:.0f}"
                f" GB/s, {decode.get('peak_from', '?')})",
                ["batch", "arlo decode tok/s", "arlo e2e tok/s", "step ms", "HBM fraction", "pallas decode tok/s",
                 "pallas HBM fraction", "transformers eager tok/s",
                 f"transformers {static} tok/s"], rows)
    for part in ("decode", "decode_pallas", "hf", "step"):
        if "skipped" in fig[part]:
            print(f"{part}: skipped: {fig[part]['skipped']}")
    if "split" in fig["step"]:
        print_table(f"one GRPO step through the services ({args.groups}x{args.group_size}x{args.step_tokens}, sync; "
                    "the last of --rl-steps)", ["phase", "seconds"],
                    [[k, v] for k, v in fig["step"]["split"].items()]
                    + [["services' fixed share", fig["step"]["services_fixed_share"]]])
    print_table("the issue's bars (goals: hbm_fraction_b64 >= 0.5, arlo_over_hf_b64 >= 3, services_fixed_share "
                "<= 0.1)", ["figure", "value"], [[k, v] for k, v in fig["summary"].items()])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on a CPU in seconds, no GRPO step (CI)")
    parser.add_argument("--batches", type=int_list(1), help="decode batches (default 1,16,64,256; smoke 1,4)")
    parser.add_argument("--prompt", type=int_at_least(1), help="prompt tokens (default 128; smoke 16)")
    parser.add_argument("--new-tokens", type=int_at_least(2), help="new tokens per request (default 128; smoke 16)")
    parser.add_argument("--decode-steps", type=int_at_least(1), default=16, help="inference.decode_steps")
    parser.add_argument("--no-pallas", dest="pallas", action="store_false",
                        help="skip the second decode run with inference.attention_kernel: pallas")
    parser.add_argument("--hf-static-batches", type=int_list(1, allow_empty=True),
                        help="batches of transformers' static-cache run (each compiles; default 1,64; smoke 1)")
    parser.add_argument("--peak-bw", type=float_above(0), default=0.0,
                        help="the device's peak memory bandwidth, bytes/s (default: by device kind)")
    parser.add_argument("--groups", type=int_at_least(1), default=8)
    parser.add_argument("--group-size", type=int_at_least(1), default=8)
    parser.add_argument("--step-tokens", type=int_at_least(1), default=512)
    parser.add_argument("--micro-batch", type=int_at_least(0), default=0, help="trainer.micro_batch_size")
    parser.add_argument("--logprob-chunk", type=int_at_least(0), default=128, help="trainer.logprob_chunk")
    parser.add_argument("--rl-steps", type=int_at_least(1), default=2, help="RL steps (the first compiles)")
    parser.add_argument("--skip-step", action="store_true", help="no GRPO step (implied by --smoke)")
    parser.add_argument("--budget-s", type=float_above(0), default=480.0, help="the whole run's seconds")
    parser.add_argument("--dir", default=".arlo/bench/qwen2.5-1.5b-shape", help="the step's checkpoint")
    parser.add_argument("--step-home", default=".arlo/bench/accelerator-step", help="the services' logs and state")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batches = args.batches or ([1, 4] if args.smoke else [1, 16, 64, 256])
    args.prompt = args.prompt or (16 if args.smoke else 128)
    args.new_tokens = args.new_tokens or (16 if args.smoke else 128)
    if args.hf_static_batches is None:
        args.hf_static_batches = [1] if args.smoke else [b for b in (1, 64) if b in args.batches]
    # What real_model_services' step reads from its args.
    args.param_dtype, args.step_cpus = "bfloat16", "off"
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part:  # a child: one part's figures as the last line of stdout
        print(json.dumps(PARTS[args.part](args)))
        return
    started = time.monotonic()
    child = [a for a in (argv if argv is not None else sys.argv[1:])]
    child = [a for i, a in enumerate(child) if a != "--json" and (i == 0 or child[i - 1] != "--json")]
    left = lambda: args.budget_s - (time.monotonic() - started)  # noqa: E731
    fig: dict[str, Any] = {"decode": run_part("decode", child, left())}
    fig["decode_pallas"] = run_part("decode_pallas", child, left()) if args.pallas else {"skipped": "--no-pallas"}
    skip = "--smoke" if args.smoke else "--skip-step" if args.skip_step else ""
    # The step before transformers: it is the part the issue cares most about, and the longest.
    fig["step"] = {"skipped": skip} if skip else run_part("step", child, left())
    fig["hf"] = run_part("hf", child, left())
    fig["summary"] = summary(fig)
    fig["wall_s"] = time.monotonic() - started
    fig["workload"] = {k: getattr(args, k) for k in ("smoke", "batches", "prompt", "new_tokens", "decode_steps", "pallas",
                                                     "hf_static_batches", "groups", "group_size", "step_tokens",
                                                     "micro_batch", "logprob_chunk", "rl_steps", "budget_s")}
    print_figures(fig, args)
    write_json(args.json, fig)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)
