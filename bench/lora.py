"""LoRA against full fine-tuning at a real model's shape (issue 35's bars).

The checkpoint is bench/real_model.py's: Qwen2.5-0.5B's shape, random weights written by
transformers in bfloat16 (`--model small` for a quick run, `--smoke` for a test's tiny one).
LoRA is rank --rank (16) on all 7 projections (q, k, v, o, gate, up, down), alpha 2 x rank.

- `publish_bytes_ratio`: `state_to_bytes(learner.serving_state())` of a Learner with LoRA over
  the same of one without (param_dtype bfloat16: the adapters alone against the whole model).
- `trainer_rss_ratio`: peak RSS (VmHWM) of a trainer process that loads the checkpoint and runs
  one GRPO step at bench/real_model.py's step shape (--groups 8 x --group-size 4 rows of
  --prompt 32 + --step-tokens 128 tokens, param_dtype bfloat16, remat full, micro-batch 0,
  logprob chunk 32) with LoRA, over the same with full fine-tuning; each in its own subprocess,
  started only once the memory it needs is available (a shared machine); `qlora_rss_ratio` the
  same with trainer.lora.quantize nf4. The rows are random tokens (a step's cost does not depend
  on what was sampled). Part `rss`.
- `planned_rss_ratio` (part `plan`): XLA's peak bytes of the same step (arguments + temporaries +
  outputs - what the donated arguments give back), the learner's own step compiled over abstract
  arrays, nothing run: what `arlo plan` computes (equal to the real step's XLA peak,
  docs/plan.md), for full fine-tuning, LoRA, QLoRA int8 and nf4. Process RSS on XLA:CPU adds the
  runtime and malloc's kept pages to both sides; this is the step's own memory, and at the 0.5B
  shape it takes a minute where running the step takes an hour on a loaded 2-core machine.
- `lora_logprob_mismatch`: float32 weights; a Learner with LoRA trains one step, publishes its
  adapters (`state_to_bytes(serving_state())`), the real Engine installs them over its own base
  (`state_from_bytes` + `Engine.swap`), samples 2 groups (temperature 1), and the trainer's next
  step reports mean |trainer - engine| logprob over the sampled tokens.
- `lora_sync_ratio`: publish-to-served seconds with LoRA over full weights, bfloat16: what the
  trainer does (`gather.state_bytes` of the Learner's state: cast, finiteness check, pack), the
  transport (bench/weight_sync.py: hashing at publish + a real PullWeights stream of a payload of
  that size from a trainer servicer in a subprocess), and what a replica does
  (`weights._checked_state`: unpack, place, finiteness check; then `Engine.swap`). Medians of
  --sync-repeats (after one warm-up), --pulls pulls. The Learner's state is `initial_params`'
  (what a Learner holds before its first step: the same shapes and bytes as after).

`python -m bench.lora [--model qwen2.5-0.5b|small|tiny] [--smoke] [--parts plan,rss,mismatch,sync]
[--pulls 3] [--sync-repeats 3] [--dir DIR] [--json PATH]`

Measured 2026-12-06 on the shared 2-core, 24 GiB machine (load average 3-30: other agents'
jobs), Qwen2.5-0.5B shape (494.0M parameters), rank 16 on all 7 projections (8.80M adapter
parameters), `python -m bench.lora --parts plan,sync,mismatch --pulls 1 --sync-repeats 2`:

| bar | value | needs | |
| --- | --- | --- | --- |
| publish_bytes_ratio | 0.0178 (17.6 MB of 988.1 MB) | <= 0.05 | met |
| trainer_rss_ratio, process peak RSS (`--parts rss`) | 0.437 (5,561 of 12,740 MB) | <= 0.45 | met |
| qlora_rss_ratio, process peak RSS, nf4 | 0.303 (3,864 MB) | < LoRA's | met |
| trainer_rss_ratio, XLA step peak (planned_rss_ratio) | 0.405 (4,635 of 11,457 MiB) | <= 0.45 | met |
| qlora_rss_ratio, XLA step peak, nf4 / int8 | 0.259 / 0.289 (2,971 / 3,313 MiB) | < LoRA's | met |
| lora_logprob_mismatch (float32, 128 sampled tokens) | 9.1e-7 | < 1e-5 | met |
| lora_sync_ratio | 0.035 (0.232 s of 6.63 s) | <= 0.10 | met |

The step's XLA peak, full fine-tuning: arguments 5,654 MiB (float32 master, AdamW's two moments,
the batch; donated, so the outputs reuse them) + temporaries 5,803 MiB; LoRA: arguments 1,043
MiB (the bfloat16 base, the adapters and their moments) + temporaries 3,592 MiB; QLoRA's base
is 723 (int8) / 553 (nf4) MiB of arguments and its temporaries are lower still (2,589 / 2,419
MiB). XLA:CPU computes in float32 where the program says bfloat16 (docs/plan.md), so LoRA's
temporaries hold float32 copies an accelerator would not: read the ratio as an upper bound.
Publish to served, LoRA / full in seconds: trainer cast + check + pack 0.077 / 2.18, hash +
PullWeights 0.062 / 2.97, replica unpack + check + swap 0.094 / 1.48.

Process RSS (`python -m bench.lora --parts rss --json PATH`, load average ~2: a test run beside
it): above the imports (~210 MB) 5,349 / 12,530 MB (0.427); first steps 142 s (LoRA) and 111 s
(full), compiles included. Before the heap trim after compiles (arlo/heap_trim.py) it was 0.467
(6,190 / 13,240 MB, QLoRA 5,180): RSS over XLA's peak was 1.26 GB on the LoRA side, of which a
phase-by-phase probe found ~570 MB freed by the compiles but kept by glibc mid-heap (given back
by `malloc_trim`), ~210 MB the runtime, ~360 MB compiled programs and jit caches still in use,
~125 MB the execution's own; the peak is reached in the step, not in the checkpoint's load.
At `--model small` (4 layers, hidden 256, vocab 16384: activations, not weights, dominate), the same machine measured trainer_rss_ratio 0.965
(1,162 / 1,203 MB, of which ~230 MB is the imported runtime), publish_bytes_ratio 0.044,
lora_logprob_mismatch 4.4e-7, lora_sync_ratio 0.18 (0.056 / 0.309 s: fixed costs dominate a
16 MB payload).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import check_json_arg, int_at_least, name_list, print_table, run_main, write_json
from bench.lora_plan import PLANS, planned_step
from bench.real_model import SHAPES as REAL_SHAPES
from bench.real_model import checkpoint_bytes, prompts, write_checkpoint

SHAPES = {"qwen2.5-0.5b": REAL_SHAPES["qwen2.5-0.5b"],
          # A quick run: the same family, minutes instead of an hour on 2 cores.
          "small": {**REAL_SHAPES["qwen2.5-0.5b"], "vocab_size": 16384, "hidden_size": 256, "intermediate_size": 1024,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
          "tiny": REAL_SHAPES["tiny"]}
PARTS = ("plan", "rss", "mismatch", "sync")
BARS = {"publish_bytes_ratio": 0.05, "trainer_rss_ratio": 0.45, "lora_logprob_mismatch": 1e-5,
        "lora_sync_ratio": 0.10}
MISMATCH_GROUPS = 2


def run_config(args: argparse.Namespace, *, rank: int, param_dtype: str, seq: int, quantize: str = "none") -> Any:
    """The run's config as a trainer would load it: the checkpoint, LoRA at `rank` (0: none)."""
    from arlo.config import ModelSpec, RolloutConfig, RunConfig, TrainerConfig
    from arlo.config.trainer import LoraConfig

    tc = TrainerConfig(groups_per_step=args.groups, remat="full", micro_batch_size=args.micro_batch,
                       logprob_chunk=args.logprob_chunk, learning_rate=1e-4 if rank else 1e-5,
                       lora=LoraConfig(rank=rank, quantize=quantize if rank else "none"))
    run = RunConfig(model=ModelSpec(path=str(args.dir), param_dtype=param_dtype, max_seq_len=seq), trainer=tc,
                    rollout=RolloutConfig(max_episode_tokens=seq))
    run.validate()
    return run


def random_batch(args: argparse.Namespace, vocab: int, *, groups: int, tokens: int, pad_id: int) -> Any:
    """`groups` x --group-size rows of random prompt and response tokens, as build_batch gets them."""
    import numpy as np

    from arlo.proto.v1 import common_pb2
    from services.trainer.batching import build_batch

    rng = np.random.default_rng(0)
    group_prompts = prompts(groups, args.prompt, min(vocab, 2000), 7)
    rows = [[common_pb2.Trajectory(
        id=f"{g}-{i}", group_id=str(g), group_size=args.group_size, token_ids=[*p, *map(int, response)],
        logprobs=[0.0] * len(p) + [-float(np.log(vocab))] * tokens, loss_mask=[0] * len(p) + [1] * tokens,
        policy_versions=[-1] * len(p) + [0] * tokens, prompt_length=len(p), reward=float(rng.random()),
        status=common_pb2.TRAJECTORY_STATUS_OK)
        for i, response in enumerate(rng.integers(10, min(vocab, 2000), (args.group_size, tokens)))]
        for g, p in enumerate(group_prompts)]
    return build_batch(rows, args.prompt + tokens, pad_id)


def memory() -> dict[str, int]:
    """This process's resident set now and at its peak (VmRSS, VmHWM), bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


def trainer_step(args: argparse.Namespace, rank: int, quantize: str) -> dict[str, Any]:
    """The trainer side of one GRPO step (run in a subprocess of its own): load, step, publish bytes."""
    import numpy as np

    from arlo.compile_watch import CompileWatch
    from arlo.model import state_to_bytes
    from services.trainer.learner import Learner

    CompileWatch().install()  # as the trainer service runs: its heap trims after compiles count here
    import_rss = memory()["VmRSS"]
    run = run_config(args, rank=rank, param_dtype="bfloat16", seq=args.prompt + args.step_tokens, quantize=quantize)
    source = run.model_source()
    learner = Learner(source, cfg=run.trainer)
    batch = random_batch(args, source.cfg.vocab_size, groups=args.groups, tokens=args.step_tokens,
                         pad_id=source.tokenizer().pad_id)
    started = time.perf_counter()
    metrics = learner.step(batch)
    step_s = time.perf_counter() - started
    peak = memory()["VmHWM"]  # before the publish's bytes: the step's peak, not the serialisation's
    return {"peak_rss_bytes": peak, "import_rss_bytes": import_rss, "peak_over_import_bytes": peak - import_rss,
            "step_s": step_s, "loss_finite": bool(np.isfinite(metrics.loss)),
            "publish_bytes": len(state_to_bytes(learner.serving_state()))}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def wait_for_memory(need: int, wait_s: float) -> str | None:
    """None once `need` bytes are available (polling up to `wait_s`), else why the step is not run:
    on a machine shared with other jobs, a step that cannot fit would be killed for memory, or
    have another job killed."""
    deadline = time.monotonic() + wait_s
    while (have := mem_available()) < need:
        if time.monotonic() > deadline:
            return f"not run: needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available after {wait_s:.0f}s"
        print(f"waiting for {need / 2**30:.1f} GiB ({have / 2**30:.1f} available)", file=sys.stderr, flush=True)
        time.sleep(15)
    return None


def in_subprocess(args: argparse.Namespace, rank: int, need: int, quantize: str = "none") -> dict[str, Any]:
    if why := wait_for_memory(need, args.wait_memory_s):
        return {"error": why}
    argv = [sys.executable, "-m", "bench.lora", "--step-child", str(rank), "--step-quantize", quantize,
            *args.child_argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if out.returncode:  # killed for memory (-9) at the big shape, say: the other figures still stand
        print(out.stderr[-4000:], file=sys.stderr)
        return {"error": f"exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def logprob_mismatch(args: argparse.Namespace) -> dict[str, Any]:
    """Engine (published adapters, unmerged) vs trainer logprobs on the engine's samples, float32."""
    import numpy as np

    from arlo.config import InferenceConfig
    from arlo.model import state_from_bytes, state_to_bytes
    from arlo.proto.v1 import common_pb2
    from services.inference.engine import Engine, SamplingRequest
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner

    tokens = min(args.step_tokens, 16)
    seq = args.prompt + tokens
    run = run_config(args, rank=args.rank, param_dtype="float32", seq=seq)
    source = run.model_source()
    learner = Learner(source, cfg=run.trainer)
    pad_id = source.tokenizer().pad_id
    trained = learner.step(random_batch(args, source.cfg.vocab_size, groups=MISMATCH_GROUPS, tokens=tokens,
                                        pad_id=pad_id))
    rows = MISMATCH_GROUPS * args.group_size
    engine = Engine(source, config=InferenceConfig(max_n=args.group_size, max_batch=rows, max_tokens=tokens,
                                                   max_prompt_tokens=args.prompt, max_seq_len=seq, decode_steps=8,
                                                   prefill_tokens=rows * args.prompt))
    try:
        payload = state_to_bytes(learner.serving_state())
        engine.swap(state_from_bytes(payload, engine.published_state), 1)
        group_prompts = prompts(MISMATCH_GROUPS, args.prompt, min(source.cfg.vocab_size, 2000), 11)
        handles = engine.submit_many([SamplingRequest(prompt=tuple(p), n=args.group_size, max_tokens=tokens,
                                                      temperature=1.0, ignore_eos=True, seed=g)
                                      for g, p in enumerate(group_prompts)])
        samples = [h.result(3600) for h in handles]
    finally:
        engine.close()
    groups = [[common_pb2.Trajectory(
        id=f"{g}-{i}", group_id=str(g), group_size=args.group_size, token_ids=[*p, *s.token_ids],
        logprobs=[0.0] * len(p) + list(s.logprobs), loss_mask=[0] * len(p) + [1] * len(s.token_ids),
        policy_versions=[-1] * len(p) + list(s.policy_versions), prompt_length=len(p), reward=float(i % 2),
        status=common_pb2.TRAJECTORY_STATUS_OK) for i, s in enumerate(group)]
        for g, (p, group) in enumerate(zip(group_prompts, samples, strict=True))]
    assert all(v == 1 for g in groups for t in g for v in t.policy_versions[args.prompt:]), "served another version"
    metrics = learner.step(build_batch(groups, seq, pad_id))
    return {"lora_logprob_mismatch": metrics.extra["logprob_mismatch"], "adapter_payload_bytes": len(payload),
            "trained_loss_finite": bool(np.isfinite(trained.loss)), "sampled_tokens": rows * tokens}


def publish_to_served(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Seconds of the trainer's serialisation and a replica's restore + swap (medians), bfloat16."""
    import jax

    from arlo.config import InferenceConfig
    from services.inference.engine import Engine
    from services.inference.weights import _checked_state
    from services.trainer.gather import state_bytes
    from services.trainer.learner import initial_params

    run = run_config(args, rank=rank, param_dtype="bfloat16", seq=args.prompt + 8)
    source = run.model_source()
    state, _frozen = initial_params(source, None)  # what the Learner holds and publishes
    engine = Engine(source, config=InferenceConfig(max_n=1, max_batch=1, max_tokens=8, max_prompt_tokens=args.prompt,
                                                   max_seq_len=args.prompt + 8, prefill_tokens=args.prompt))
    serialise, restore = [], []
    try:
        for version in range(1, args.sync_repeats + 2):  # the first compiles the casts: not counted
            started = time.perf_counter()
            data = state_bytes(state, "bfloat16")
            serialised = time.perf_counter()
            served, bad = _checked_state(bytearray(data), engine.published_state)
            assert bad is None, bad
            engine.swap(served, version)
            jax.block_until_ready(engine.published_state)
            if version > 1:
                serialise.append(serialised - started)
                restore.append(time.perf_counter() - serialised)
    finally:
        engine.close()
    return {"payload_bytes": len(data), "serialise_s": statistics.median(serialise),
            "restore_and_swap_s": statistics.median(restore)}


def transport(size: int, pulls: int) -> dict[str, float]:
    """bench/weight_sync.py's publish (hashing) + PullWeights of `size` bytes, medians."""
    import asyncio

    from bench.weight_sync import measure

    return asyncio.run(measure(size, pulls))["at publish"]


def sync_figures(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, rank in (("lora", args.rank), ("full", 0)):
        f = publish_to_served(args, rank)
        if args.pulls:
            moved = transport(f["payload_bytes"], args.pulls)
            f["hash_and_pull_s"] = moved["publish_and_pull_ms"] / 1e3
        f["publish_to_served_s"] = f["serialise_s"] + f.get("hash_and_pull_s", 0.0) + f["restore_and_swap_s"]
        out[mode] = f
    out["lora_sync_ratio"] = out["lora"]["publish_to_served_s"] / out["full"]["publish_to_served_s"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="the checkpoint's shape")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny shape, a 2x2x8 step, one sync repeat, no pull: the code path in a test")
    parser.add_argument("--dir", help="where the checkpoint is (written if absent; default .arlo/bench/MODEL-shape)")
    parser.add_argument("--parts", type=name_list(PARTS), default=list(PARTS), help="what to measure")
    parser.add_argument("--rank", type=int_at_least(1), default=16)
    parser.add_argument("--groups", type=int_at_least(1), default=8)
    parser.add_argument("--group-size", type=int_at_least(1), default=4)
    parser.add_argument("--prompt", type=int_at_least(1), default=32)
    parser.add_argument("--step-tokens", type=int_at_least(1), default=128)
    parser.add_argument("--micro-batch", type=int_at_least(0), default=0)
    parser.add_argument("--logprob-chunk", type=int_at_least(0), default=32)
    parser.add_argument("--sync-repeats", type=int_at_least(1), default=3)
    parser.add_argument("--pulls", type=int_at_least(0), default=3, help="PullWeights per payload, 0: no transport")
    parser.add_argument("--wait-memory-s", type=int_at_least(0), default=1200,
                        help="how long a trainer step waits for the memory it needs before it is reported as not run")
    parser.add_argument("--json")
    parser.add_argument("--step-child", type=int, help=argparse.SUPPRESS)  # one trainer step (a subprocess)
    parser.add_argument("--step-quantize", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # What a child needs to rebuild the same run (all but --json, --parts and the smoke switch).
    args.child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    if args.smoke:
        args.model, args.groups, args.group_size, args.prompt, args.step_tokens = "tiny", 2, 2, 8, 8
        args.sync_repeats, args.pulls = 1, 0  # the transport is bench/weight_sync.py's, tested there
    args.dir = Path(args.dir or (".arlo/bench/qwen2.5-0.5b-shape" if args.model == "qwen2.5-0.5b"
                                 else f".arlo/bench/{args.model}-shape"))
    if args.step_child is None:
        check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_checkpoint(args.dir, SHAPES[args.model])
    if args.step_child is not None:
        print(json.dumps(trainer_step(args, args.step_child, args.step_quantize)))
        return
    args.child_argv = [*strip_flag(args.child_argv, "--json"), "--dir", str(args.dir)]
    figures: dict[str, Any] = {"model": args.model, "rank": args.rank, "step_shape": {
        "groups": args.groups, "group_size": args.group_size, "prompt": args.prompt, "step_tokens": args.step_tokens,
        "micro_batch": args.micro_batch, "logprob_chunk": args.logprob_chunk}}
    params = checkpoint_bytes(args.dir) // 2  # bfloat16 on disk
    if "plan" in args.parts:
        plans = {mode: planned_step(args, *how, run_config=run_config) for mode, how in PLANS.items()}
        figures["xla_step_peak"] = plans
        figures["planned_rss_ratio"] = plans["lora"]["peak_bytes"] / plans["full"]["peak_bytes"]
        figures["planned_qlora_ratio"] = {k: plans[k]["peak_bytes"] / plans["full"]["peak_bytes"]
                                          for k in ("qlora_int8", "qlora_nf4")}
    if "rss" in args.parts:  # LoRA first: its peak sizes the full step's wait
        lora = in_subprocess(args, args.rank, need=4 * params + 2**30)
        qlora = in_subprocess(args, args.rank, need=4 * params + 2**30, quantize="nf4")
    # Float32 base in the learner and in the engine; then a float32 master, its bfloat16 payload
    # and the replica's copies of it (the parts run in this process: the step's RSS is not theirs).
    if "mismatch" in args.parts and (why := wait_for_memory(10 * params + 2**30, args.wait_memory_s)):
        figures["mismatch"] = {"error": why}
    elif "mismatch" in args.parts:
        figures["mismatch"] = logprob_mismatch(args)
        figures["lora_logprob_mismatch"] = figures["mismatch"]["lora_logprob_mismatch"]
    if "sync" in args.parts and (why := wait_for_memory(12 * params + 2**30, args.wait_memory_s)):
        figures["sync"] = {"error": why}
    elif "sync" in args.parts:
        figures["sync"] = sync_figures(args)
        figures["lora_sync_ratio"] = figures["sync"]["lora_sync_ratio"]
        # The same bytes as the steps' serving_state() (the test checks): replaced by theirs when they run.
        figures["publish_bytes_ratio"] = (figures["sync"]["lora"]["payload_bytes"]
                                          / figures["sync"]["full"]["payload_bytes"])
    if "rss" in args.parts:  # last, when the smaller parts are done: full fine-tuning's peak is the largest
        # The LoRA step's peak, plus the float32 master, its gradient and Adam's two moments.
        full = in_subprocess(args, 0, need=lora.get("peak_rss_bytes", 4 * params) + 16 * params + 2**30)
        figures["trainer_step"] = {"lora": lora, "qlora_nf4": qlora, "full": full}
        if not ("error" in qlora or "error" in full):
            figures["qlora_rss_ratio"] = qlora["peak_rss_bytes"] / full["peak_rss_bytes"]
        if not ("error" in lora or "error" in full):
            figures["publish_bytes_ratio"] = lora["publish_bytes"] / full["publish_bytes"]
            figures["trainer_rss_ratio"] = lora["peak_rss_bytes"] / full["peak_rss_bytes"]
            figures["trainer_rss_over_import_ratio"] = (lora["peak_over_import_bytes"]
                                                        / full["peak_over_import_bytes"])
    write_json(args.json, figures)
    print_figures(figures)


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (either `--flag V` or `--flag=V`), nor --dir / --parts."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in (flag, "--dir", "--parts"):
            skip = True
        elif not a.startswith((f"{flag}=", "--dir=", "--parts=")):
            out.append(a)
    return out


def print_figures(f: dict[str, Any]) -> None:
    rows = []
    for mode, step in f.get("trainer_step", {}).items():
        if "error" in step:
            rows.append([f"trainer step, {mode}", step["error"], "", "", "failed"])
    if "trainer_rss_ratio" in f:
        lora, full = f["trainer_step"]["lora"], f["trainer_step"]["full"]
        rows.append(["publish bytes (MB)", lora["publish_bytes"] / 1e6, full["publish_bytes"] / 1e6,
                     f["publish_bytes_ratio"], "publish_bytes_ratio"])
        rows.append(["trainer peak RSS, one GRPO step (MB)", lora["peak_rss_bytes"] / 1e6,
                     full["peak_rss_bytes"] / 1e6, f["trainer_rss_ratio"], "trainer_rss_ratio"])
        rows.append(["  the same above the imports (MB)", lora["peak_over_import_bytes"] / 1e6,
                     full["peak_over_import_bytes"] / 1e6, f["trainer_rss_over_import_ratio"], ""])
        rows.append(["  step seconds (first: compiles)", lora["step_s"], full["step_s"],
                     lora["step_s"] / full["step_s"], ""])
        if "qlora_rss_ratio" in f:
            q = f["trainer_step"]["qlora_nf4"]
            rows.append(["QLoRA nf4: trainer peak RSS (MB)", q["peak_rss_bytes"] / 1e6, full["peak_rss_bytes"] / 1e6,
                         f["qlora_rss_ratio"], "qlora_rss_ratio"])
    for mode, plan in f.get("xla_step_peak", {}).items():
        if mode != "full":
            full = f["xla_step_peak"]["full"]
            rows.append([f"XLA step peak, {mode}, compiled not run (MB)", plan["peak_bytes"] / 1e6,
                         full["peak_bytes"] / 1e6, plan["peak_bytes"] / full["peak_bytes"],
                         "planned_rss_ratio" if mode == "lora" else ""])
    for part in ("mismatch", "sync"):
        if "error" in f.get(part, {}):
            rows.append([part, f[part]["error"], "", "", "failed"])
    if "lora_sync_ratio" in f:
        lora, full = f["sync"]["lora"], f["sync"]["full"]
        for key, label in (("serialise_s", "trainer: cast + check + pack (s)"),
                           ("hash_and_pull_s", "hash + PullWeights (s)"),
                           ("restore_and_swap_s", "replica: unpack + check + swap (s)")):
            if key in lora:
                rows.append([label, lora[key], full[key], lora[key] / full[key], ""])
        rows.append(["publish -> served (s)", lora["publish_to_served_s"], full["publish_to_served_s"],
                     f["lora_sync_ratio"], "lora_sync_ratio"])
    print_table(f"LoRA rank {f['rank']} (all 7 projections) vs full fine-tuning, {f['model']} shape, bfloat16",
                ["figure", "LoRA", "full", "LoRA / full", "bar"], rows)
    bars = [[name, f[name], f"{'<' if name == 'lora_logprob_mismatch' else '<='} {bar:g}",
             "met" if (f[name] < bar if name == "lora_logprob_mismatch" else f[name] <= bar) else "NOT met"]
            for name, bar in BARS.items() if name in f]
    if "planned_rss_ratio" in f:
        bars.append(["trainer_rss_ratio, XLA step peak (planned)", f["planned_rss_ratio"], "<= 0.45",
                     "met" if f["planned_rss_ratio"] <= 0.45 else "NOT met"])
        nf4 = f["planned_qlora_ratio"]["qlora_nf4"]
        bars.append(["qlora_rss_ratio, XLA step peak (planned), nf4", nf4, f"< {f['planned_rss_ratio']:.4g} (LoRA's)",
                     "met" if nf4 < f["planned_rss_ratio"] else "NOT met"])
    if "qlora_rss_ratio" in f and "trainer_rss_ratio" in f:
        bars.append(["qlora_rss_ratio", f["qlora_rss_ratio"], f"< {f['trainer_rss_ratio']:.4g} (LoRA's)",
                     "met" if f["qlora_rss_ratio"] < f["trainer_rss_ratio"] else "NOT met"])
    print_table("issue 35's bars", ["bar", "value", "needs", "status"], bars)


if __name__ == "__main__":
    run_main(main)
