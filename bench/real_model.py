"""A checkpoint of a real model's size through arlo: load, decode against transformers, one GRPO step.

The checkpoint has Qwen2.5-0.5B's published shape (24 layers, hidden 896, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied embeddings, rope theta 1e6), random weights written by
transformers itself in bfloat16 (no hub here), plus a small BPE tokenizer with Qwen's ChatML
template (the model's vocabulary is wider than the tokenizer's, as real checkpoints pad theirs).

Measured, each in a fresh subprocess where memory matters:
- load: seconds and peak RSS above the process baseline for what inference loads (the serving
  dtype) and what the trainer loads (its float32 master copy), against the checkpoint's bytes;
- decode tokens/s at each --batches size, arlo's engine (float32 compute) against transformers
  `generate` (greedy, fixed length, the same prompts) in its faster dtype at each batch (float32 and
  bfloat16 both run): `decode_over_hf_b16`, `decode_over_hf_b64`; beside them the
  weight-matmul floor of the same requests (every weight matrix multiplied by the prefill's
  tokens, then once per decode step, in float32 jitted calls): how far arlo is from it, and how
  far ahead of transformers any engine could be on this CPU;
- GRPO steps of --groups x --group-size samples x up to --step-tokens new tokens:
  - through the services (the default, `--step-through-services`; bench/real_model_services.py):
    the checkpoint as `model.path` of a synchronous run of the local services, --rl-steps RL steps
    (the first carries the compiles), each split from what the services record into generation
    (and the engine's share), intake, batch, train step, publish, pull + verify + swap, publish-to-
    serving latency, bytes per publish, with each service's peak RSS (`service_step` in the JSON);
  - in process (`--step-in-process`, for comparison: the same calls without the services):
    generation, intake (batch building), train step, publish (serialise + sha256) and swap
    (deserialise + engine swap), with bytes per publish in the serving dtype (`grpo_step`).

`python -m bench.real_model [--json PATH] [--dir DIR] [--batches 1,16,64] [--new-tokens 64]
[--skip-load] [--skip-decode] [--step-in-process | --skip-step] [--rl-steps 2]`. Expect several
minutes on 2 CPU cores for each part (a GRPO step trains a 0.5B model on 32 sequences).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import check_json_arg, int_at_least, int_list, print_table, run_main, write_json
from bench.real_model_services import check_step_args, print_service_step, service_step

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# The same code path at a size a test runs in seconds.
SHAPES = {"qwen2.5-0.5b": QWEN25_05B,
          "tiny": {**QWEN25_05B, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_checkpoint(path: Path, shape: str | dict[str, Any] = "qwen2.5-0.5b") -> Path:
    """The random-weight checkpoint at `path` (kept: a second run reuses it); `shape`: a name in
    SHAPES or a Qwen2Config's shape fields (bench/lora.py adds its own)."""
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([f"What is {a}*{b}? The answer is {a * b}." for a in range(40) for b in range(40)],
                            trainers.BpeTrainer(vocab_size=2000, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None}))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**(SHAPES[shape] if isinstance(shape, str) else shape), eos_token_id=tok.token_to_id("<|im_end|>"),
                                      pad_token_id=tok.token_to_id("<|endoftext|>"))
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="500MB")
    return path


_LOAD = """
import json, sys, time
from arlo.model.source import resolve_model
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith(('VmHWM', 'VmRSS')):
            yield line.split(':')[0], int(line.split()[1]) * 1024
base = dict(hwm())['VmRSS']
t0 = time.perf_counter()
source = resolve_model(name='', path=sys.argv[1], tokenizer='', seed=0, max_seq_len=512, param_dtype=sys.argv[2])
state = source.initial_state(dtype=sys.argv[2])
import jax; jax.block_until_ready(state)
print(json.dumps({'load_s': time.perf_counter() - t0, 'peak_over_base_bytes': dict(hwm())['VmHWM'] - base}))
"""


def measure_load(path: Path, dtype: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _LOAD, str(path), dtype], capture_output=True, text=True,
                         check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, vocab, length)] for _ in range(batch)]


def arlo_decode(engine: Any, batch_prompts: list[list[int]], new_tokens: int) -> float:
    from services.inference.engine import SamplingRequest

    reqs = [SamplingRequest(prompt=tuple(p), max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            for p in batch_prompts]
    t0 = time.perf_counter()
    for handle in engine.submit_many(reqs):
        handle.result(3600)
    return len(reqs) * new_tokens / (time.perf_counter() - t0)


def hf_decode(model: Any, batch_prompts: list[list[int]], new_tokens: int) -> float:
    import torch

    ids = torch.tensor(batch_prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return ids.shape[0] * new_tokens / (time.perf_counter() - t0)


def request_floor_s(shape: dict[str, int], batch: int, prompt: int, new_tokens: int) -> float:
    """The weight-matmul floor of what a decode measurement times: the prefill (every layer over
    batch x prompt tokens, the lm_head over the last one per row) then `new_tokens` - 1 decode
    steps of `batch` rows (the prefill samples the first). Both arlo's and transformers' tokens/s
    include their prefill, so the floor must too: at 32-token prompts and 16 new tokens the
    prefill is two thirds of the matmul work, so a floor of decode steps alone understated how
    close arlo runs to the hardware."""
    prefill = weight_matmul_floor_s(shape, batch * prompt, head_rows=batch)
    return prefill + (new_tokens - 1) * weight_matmul_floor_s(shape, batch)


def weight_matmul_floor_s(shape: dict[str, int], batch: int, repeats: int = 3, *, head_rows: int = 0) -> float:
    """Seconds for the model's weight matmuls alone over `batch` token rows, in float32, one
    jitted call (the lm_head over `head_rows` of them; 0 = all, as in a decode step).

    One token per row multiplies every weight matrix once (q, k, v, o, gate, up, down per layer,
    then the lm_head), so no implementation built on the same GEMM kernels does that work faster:
    tokens/s at this floor over transformers' tokens/s is the most any engine can be ahead of it
    on this CPU (attention over a short cache and the sampling add to both sides).
    """
    import jax
    import jax.numpy as jnp

    h, inter, heads, kv = (shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"],
                           shape["num_key_value_heads"])
    kv_width = h // heads * kv
    layer = [(h, h), (h, kv_width), (h, kv_width), (h, h), (h, inter), (h, inter), (inter, h)]
    dims = layer * shape["num_hidden_layers"] + [(h, shape["vocab_size"])]
    keys = jax.random.split(jax.random.key(0), len(dims))
    weights = [jax.random.normal(k, d, jnp.float32) * 0.02 for k, d in zip(keys, dims, strict=True)]
    xs = {d_in: jnp.ones((batch, d_in), jnp.float32) for d_in, _ in dims}
    head_x = jnp.ones((head_rows or batch, h), jnp.float32)

    @jax.jit
    def step(xs: dict[int, jax.Array], head_x: jax.Array, weights: list[jax.Array]) -> jax.Array:
        body = sum(jnp.sum(xs[w.shape[0]] @ w) for w in weights[:-1])  # summed: nothing is dead code
        return body + jnp.sum(head_x @ weights[-1])

    step(xs, head_x, weights).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(xs, head_x, weights).block_until_ready()
    return (time.perf_counter() - t0) / repeats


def decode_figures(path: Path, args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    import torch
    import transformers

    from arlo.config import InferenceConfig
    from arlo.model.source import resolve_model
    from services.inference.engine import Engine

    torch.set_num_threads(max(1, torch.get_num_threads()))
    # Both dtypes stay loaded: bf16 is transformers' faster one at batch 1 on some CPUs and far
    # slower at batch 16+ on CPUs without bf16 arithmetic (AVX2), so each batch takes its faster.
    hf_models = {name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
                 for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    for model in hf_models.values():
        hf_decode(model, prompts(1, args.prompt, 2000, 0), 4)  # warm up
    source = resolve_model(name="", path=str(path), tokenizer="", seed=0, max_seq_len=args.prompt + args.new_tokens)
    engine = Engine(source, config=InferenceConfig(
        max_n=1, max_batch=max(batches), max_tokens=args.new_tokens, max_prompt_tokens=args.prompt,
        max_seq_len=args.prompt + args.new_tokens, decode_steps=8, prefill_tokens=max(batches) * args.prompt,
        max_prefill_rows=min(max(batches), 64)))
    rows = {}
    try:
        for b in batches:
            batch_prompts = prompts(b, args.prompt, 2000, b)
            arlo_decode(engine, batch_prompts, args.new_tokens)  # compile every window bucket of this length
            ours = arlo_decode(engine, batch_prompts, args.new_tokens)
            by_dtype = {name: hf_decode(model, batch_prompts, args.new_tokens) for name, model in hf_models.items()}
            hf_dtype = max(by_dtype, key=by_dtype.__getitem__)
            theirs = by_dtype[hf_dtype]
            floor = b * args.new_tokens / request_floor_s(SHAPES[args.shape], b, args.prompt, args.new_tokens)
            rows[b] = {"arlo_tokens_per_s": ours, "hf_tokens_per_s": theirs, "hf_dtype": hf_dtype,
                       "hf_tokens_per_s_by_dtype": by_dtype, "over_hf": ours / theirs,
                       "matmul_floor_tokens_per_s": floor, "arlo_of_floor": ours / floor,
                       "ceiling_over_hf": floor / theirs}
    finally:
        engine.close()
    return {"decode": rows}


def grpo_step(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One GRPO step in process, timed phase by phase (the services run these same calls)."""
    import numpy as np

    from arlo.config import InferenceConfig, TrainerConfig
    from arlo.model import state_from_bytes, state_to_bytes
    from arlo.model.source import resolve_model
    from arlo.proto.v1 import common_pb2
    from services.inference.engine import Engine, SamplingRequest
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner

    seq = args.prompt + args.step_tokens
    source = resolve_model(name="", path=str(path), tokenizer="", seed=0, max_seq_len=seq,
                           param_dtype=args.param_dtype)
    rows = args.groups * args.group_size
    engine = Engine(source, config=InferenceConfig(max_n=args.group_size, max_batch=rows, max_tokens=args.step_tokens,
                                                   max_prompt_tokens=args.prompt, max_seq_len=seq, decode_steps=8,
                                                   prefill_tokens=rows * args.prompt))
    learner = Learner(source, cfg=TrainerConfig(groups_per_step=args.groups, remat="full",
                                                micro_batch_size=args.micro_batch, logprob_chunk=args.logprob_chunk))
    figures: dict[str, float] = {}
    try:
        group_prompts = prompts(args.groups, args.prompt, 2000, 7)
        t0 = time.perf_counter()
        handles = engine.submit_many([SamplingRequest(prompt=tuple(p), n=args.group_size, max_tokens=args.step_tokens,
                                                      temperature=1.0, ignore_eos=True) for p in group_prompts])
        samples = [h.result(3600) for h in handles]
        figures["generation_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rng = np.random.default_rng(0)
        groups = [[common_pb2.Trajectory(
            id=f"{g}-{i}", group_id=str(g), group_size=args.group_size, token_ids=[*p, *s.token_ids],
            logprobs=[0.0] * len(p) + list(s.logprobs), loss_mask=[0] * len(p) + [1] * len(s.token_ids),
            policy_versions=[-1] * len(p) + list(s.policy_versions), prompt_length=len(p), reward=float(rng.random()),
            status=common_pb2.TRAJECTORY_STATUS_OK) for i, s in enumerate(group)]
            for g, (p, group) in enumerate(zip(group_prompts, samples, strict=True))]
        batch = build_batch(groups, seq, source.tokenizer().pad_id)
        figures["intake_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = learner.step(batch)  # includes its first compile; a second step shows the steady state
        figures["train_step_first_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        learner.step(batch)
        figures["train_step_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        data = state_to_bytes(learner.serving_state())
        import hashlib

        hashlib.sha256(data).hexdigest()
        figures["publish_s"] = time.perf_counter() - t0
        figures["bytes_per_publish"] = len(data)
        t0 = time.perf_counter()
        engine.swap(state_from_bytes(data, engine.state), 1)
        figures["swap_s"] = time.perf_counter() - t0
        figures["loss_finite"] = float(np.isfinite(metrics.loss))
    finally:
        engine.close()
    return figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".arlo/bench/qwen2.5-0.5b-shape", help="where the checkpoint is written")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,16,64", type=int_list(1))
    parser.add_argument("--prompt", type=int_at_least(1), default=32)
    parser.add_argument("--new-tokens", type=int_at_least(1), default=64)
    parser.add_argument("--groups", type=int_at_least(1), default=8)
    parser.add_argument("--group-size", type=int_at_least(1), default=4)
    parser.add_argument("--step-tokens", type=int_at_least(1), default=128)
    parser.add_argument("--param-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--micro-batch", type=int_at_least(0), default=0,
                        help="trainer rows per micro-batch, 0 = the whole batch (remat is full)")
    parser.add_argument("--logprob-chunk", type=int_at_least(0), default=32,
                        help="trainer.logprob_chunk: at 0.5B, 8x4 rows of 160 tokens, the step's XLA temporaries are "
                             "5.7 GiB with micro-batch 0 and chunk 32, 6.9 with micro-batch 8 and no chunk, 9.8 with neither")
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--step-through-services", dest="step", action="store_const", const="services",
                      default="services", help="the GRPO step through the local services (the default)")
    step.add_argument("--step-in-process", dest="step", action="store_const", const="in-process",
                      help="the GRPO step in this process, no services (for comparison)")
    step.add_argument("--skip-step", dest="step", action="store_const", const="none", help="no GRPO step")
    parser.add_argument("--rl-steps", type=int_at_least(1), default=2,
                        help="RL steps through the services (the first compiles)")
    parser.add_argument("--step-cpus", default="off", help="local.cpus of the step's services (off: the OS schedules)")
    parser.add_argument("--step-home", default=".arlo/bench/real-model-step", help="the services' logs and state")
    parser.add_argument("--skip-load", action="store_true", help="no load figures")
    parser.add_argument("--skip-decode", action="store_true", help="no decode figures")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.step == "services":
        check_step_args(parser, args)
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = write_checkpoint(Path(args.dir), args.shape)
    on_disk = checkpoint_bytes(path)
    figures: dict[str, Any] = {"checkpoint_bytes": on_disk}
    for role, dtype in (("inference_bf16", "bfloat16"), ("trainer_f32_master", "float32"))[:0 if args.skip_load else 2]:
        load = measure_load(path, dtype)
        model_bytes = on_disk * (2 if dtype == "float32" else 1)  # the checkpoint is bf16 on disk
        figures[f"load_{role}"] = {**load, "model_bytes": model_bytes,
                                   "peak_over_model": load["peak_over_base_bytes"] / model_bytes}
    if not args.skip_decode:
        figures.update(decode_figures(path, args, args.batches))
        for b in (16, 64):
            if b in figures["decode"]:
                figures[f"decode_over_hf_b{b}"] = figures["decode"][b]["over_hf"]
    if args.step == "in-process":
        figures["grpo_step"] = grpo_step(path, args)
    elif args.step == "services":
        figures["service_step"] = service_step(path, args)
    print_figures(figures, args)
    write_json(args.json, figures)


def print_figures(figures: dict[str, Any], args: argparse.Namespace) -> None:
    if any(k.startswith("load_") for k in figures):
        print_table("load", ["role", "seconds", "peak RSS over base (MB)", "model (MB)", "ratio"],
                    [[r, figures[f"load_{r}"]["load_s"], figures[f"load_{r}"]["peak_over_base_bytes"] / 1e6,
                      figures[f"load_{r}"]["model_bytes"] / 1e6, figures[f"load_{r}"]["peak_over_model"]]
                     for r in ("inference_bf16", "trainer_f32_master") if f"load_{r}" in figures])
    if "decode" in figures:
        print_table(f"decode, {args.new_tokens} new tokens (transformers in its faster dtype at each batch)",
                    ["batch", "arlo tok/s", "transformers tok/s", "its dtype", "arlo / transformers",
                     "matmul floor tok/s", "arlo / floor", "floor / transformers"],
                    [[b, r["arlo_tokens_per_s"], r["hf_tokens_per_s"], r["hf_dtype"], r["over_hf"],
                      r["matmul_floor_tokens_per_s"], r["arlo_of_floor"], r["ceiling_over_hf"]]
                     for b, r in figures["decode"].items()])
    shape = f"{args.groups}x{args.group_size}x{args.step_tokens}, params {args.param_dtype}"
    if "grpo_step" in figures:
        print_table(f"one GRPO step in process ({shape})", ["phase", "value"],
                    [[k, v] for k, v in figures["grpo_step"].items()])
    if "service_step" in figures:
        print_service_step(figures["service_step"], f"GRPO steps through the services ({shape}, sync)")


if __name__ == "__main__":
    run_main(main)
