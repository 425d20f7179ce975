"""`arlo plan`: does this run fit, per device, before renting the devices?

    arlo plan -c run.yaml --devices 8 --device-gb 80 [--hf-config qwen7b/config.json] [--json PATH]

The trainer's RL step and the inference engine's largest programs are compiled abstractly,
each by its own service's code in a subprocess (services/trainer/memory_plan.py,
services/inference/memory_plan.py: the application never imports a service), over as many CPU
devices as the mesh has (`--xla_force_host_platform_device_count`, read when JAX starts, hence
the subprocess). Nothing is allocated: the figures are XLA's own for one device of the SPMD
program (`compiled.memory_analysis()`), plus the one formula the trainer's module names (the
publish's serving copy). XLA:CPU compiles them, not the accelerator's compiler: fusion and
layouts differ there, so read a plan within a few percent of the budget as a "maybe".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
DEFAULT_USABLE = 0.9
"""Share of a device's memory JAX may take: the GPU overlay's XLA_PYTHON_CLIENT_MEM_FRACTION
(deploy/overlays/gpu), the rest left to CUDA's own context and libraries."""
PLAN_TIMEOUT_S = 3600.0
"""Qwen2.5-32B's plan took 23 minutes on 2 busy CPU cores (docs/plan.md); past an hour something is wrong."""

TRAINER_ROWS = (("trained parameters (float32)", "parameters_bytes"), ("frozen base (LoRA)", "frozen_base_bytes"),
                ("optimizer state (AdamW)", "optimizer_bytes"),
                ("KL reference", "reference_bytes"), ("batch", "batch_bytes"),
                ("activations / temporaries", "temporaries_bytes"), ("step peak (XLA)", "step_peak_bytes"),
                ("publish copy (formula)", "publish_copy_bytes"), ("total", "total_bytes"))
INFERENCE_ROWS = (("parameters (serving dtype)", "parameters_bytes"), ("KV cache", "kv_cache_bytes"),
                  ("activations / temporaries", "temporaries_bytes"), ("total", "total_bytes"))


class PlanError(RuntimeError):
    """A plan's subprocess failed; the message is its error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    config: Path
    hf_config: str = ""
    trainer_devices: int = 1
    inference_devices: int = 1
    device_gb: float = 80.0
    """Memory of one device, GiB."""
    usable: float = DEFAULT_USABLE


def _start(module: str, req: PlanRequest, devices: int) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    cmd = [sys.executable, "-m", module, "--config", str(req.config), "--devices", str(devices)]
    if req.hf_config:
        cmd += ["--hf-config", req.hf_config]
    # From the checkout's root, where `services` is importable, wherever arlo was started.
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(name: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=PLAN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise PlanError(f"{name}: no plan after {PLAN_TIMEOUT_S:.0f}s") from None
    if proc.returncode != 0:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        raise PlanError(f"{name}: {lines[-1] if lines else f'exit status {proc.returncode}'}")
    return json.loads(out.strip().splitlines()[-1])


def make_plan(req: PlanRequest) -> dict[str, Any]:
    """Both services' figures, each against the device, and the verdict."""
    procs = {"trainer": _start("services.trainer.memory_plan", req, req.trainer_devices),
             "inference": _start("services.inference.memory_plan", req, req.inference_devices)}
    try:
        figures = {name: _finish(name, proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    budget = int(req.device_gb * GIB * req.usable)
    for part in figures.values():
        part["fits"] = part["total_bytes"] <= budget
    return {"config": str(req.config), "hf_config": req.hf_config, "device_gb": req.device_gb, "usable": req.usable,
            "budget_bytes": budget, **figures, "fits": all(p["fits"] for p in figures.values())}


def size_text(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def plan_tables(plan: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) of the terminal's tables."""
    budget = plan["budget_bytes"]

    def rows(part: dict[str, Any], names: tuple[tuple[str, str], ...]) -> list[list[str]]:
        out = [[label, size_text(part[key]), f"{part[key] / budget:.1%}"] for label, key in names]
        return [*out, ["fits", "yes" if part["fits"] else "NO", ""]]

    t, i = plan["trainer"], plan["inference"]
    mesh = lambda p: ", ".join(f"{k} {v}" for k, v in p["mesh"].items()) or "one device"  # noqa: E731
    budget_text = f"{plan['device_gb']:g} GiB x {plan['usable']:g} usable"
    return [
        (f"trainer, per device ({t['devices']} devices: {mesh(t)}; {t['num_params'] / 1e6:,.1f}M params; "
         f"{'LoRA rank ' + str(t['lora_rank']) + '; ' if t['lora_rank'] else ''}"
         f"{t['rows']} rows x {t['length']} tokens; remat {t['remat']}, logprob_chunk {t['logprob_chunk']}; "
         f"against {budget_text})", ["", "per device", "of budget"], rows(t, TRAINER_ROWS)),
        (f"inference, per device ({i['devices']} devices: {mesh(i)}; {i['num_slots']} slots x {i['slot_len']} "
         f"tokens; largest program: {i['largest_program']}; against {budget_text})", ["", "per device", "of budget"],
         rows(i, INFERENCE_ROWS)),
    ]


PLAN_EXAMPLE = """example: Qwen2.5-7B full fine-tuning on 8 x 80 GB (its config.json alone, no weights):
  arlo plan -c run.yaml --hf-config qwen2.5-7b/config.json --devices 8 --device-gb 80 --json plan.json
with run.yaml's trainer.mesh.axis_sizes [1, 8, 1] (fsdp 8) and the run's batch, remat and logprob_chunk
(docs/deploy.md, "What fits where")."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str, high: float = float("inf")) -> float:
    value = float(text)
    if not 0 < value <= high:
        raise argparse.ArgumentTypeError(f"must be in (0, {high:g}], got {value}")
    return value


def add_parser(sub: Any) -> None:
    """`arlo plan`'s arguments, on the `arlo` command's subparsers."""
    plan = sub.add_parser("plan", help="per-device memory of the run's trainer and inference, before renting devices",
                          description=__doc__.split("\n\n")[0], epilog=PLAN_EXAMPLE,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("-c", "--config", help="run config YAML (default: the built-in demo's)")
    plan.add_argument("--hf-config", help="a Hugging Face config.json: the model's shape instead of model.path or "
                                          "the preset (no weights needed)")
    plan.add_argument("--devices", type=_positive_int, default=1, help="devices of the trainer's mesh (default 1)")
    plan.add_argument("--inference-devices", type=_positive_int,
                      help="devices of one inference replica's mesh (default: --devices)")
    plan.add_argument("--device-gb", type=_positive_float, default=80.0,
                      help="memory of one device in GiB (default 80: an H100 or A100 80GB)")
    plan.add_argument("--usable", type=lambda text: _positive_float(text, 1.0), default=DEFAULT_USABLE,
                      help=f"share of it JAX may take (default {DEFAULT_USABLE}, the GPU overlay's "
                           "XLA_PYTHON_CLIENT_MEM_FRACTION)")
    plan.add_argument("--json", help="write the figures to this file")


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from arlo.config import load_config
    from arlo.data import resource_path
    from arlo.report_file import report_path_problem, write_report

    err = Console(stderr=True)
    config = Path(args.config) if args.config else resource_path("demo.yaml")
    load_config(config)  # a bad config fails here, naming its field, before anything compiles
    if args.hf_config and not Path(args.hf_config).is_file():
        err.print(f"arlo plan: --hf-config {args.hf_config}: no such file")
        return 2
    if args.json is not None and (problem := report_path_problem(args.json)):
        err.print(f"[red]arlo plan: {problem}")
        return 2
    req = PlanRequest(config=config, hf_config=args.hf_config or "", trainer_devices=args.devices,
                      inference_devices=args.inference_devices or args.devices, device_gb=args.device_gb,
                      usable=args.usable)
    with err.status("compiling the train step and the engine's programs abstractly..."):
        plan = make_plan(req)
    out = Console()
    for title, columns, rows in plan_tables(plan):
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="right" if col else "left")
        for row in rows:
            table.add_row(*row)
        out.print(table)
    out.print(f"verdict: {'fits' if plan['fits'] else 'does NOT fit'} in {args.device_gb:g} GiB per device "
              f"({args.usable:g} usable)")
    if args.json:
        write_report(args.json, json.dumps(plan, indent=2))
    return 0
