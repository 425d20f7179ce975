"""`arlo status` as a table: per-service health, versions, rates, KV cache and errors; the
trainer's last step; the latest evaluation (`arlo status --json` prints the same dict whole)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from arlo.app.live import eval_text


def print_status(status: dict[str, Any], source: str | Path) -> None:
    """`status` (arlo/app/status.py `collect_status`), of the run whose config is `source`."""
    staleness = "-" if status["staleness"] is None else f"{status['staleness']:.2f}"
    table = Table(title=f"run '{status['run_id']}' ({source}): trainer v{status['trainer_version']}, pointer "
                        f"v{status['pointer_version']}, queue depth {status['queue_depth']}, staleness {staleness}")
    for col in ("service", "address", "healthy", "weight version", "instances", "throughput", "KV cache", "errors"):
        table.add_column(col)
    for s in status["services"]:
        rates = ", ".join(f"{v:.1f} {unit}" for unit, v in s.get("throughput", {}).items()) or "-"
        errors = ", ".join(f"{k} {v}" for k, v in {**s.get("errors", {}),
                                                   "late_compiles": s.get("compiles", {}).get("late_compiles")}.items()
                           if v) or "-"
        table.add_row(s["name"], s["address"], "yes" if s["healthy"] else "[red]no",
                      "-" if s["weight_version"] is None else str(s["weight_version"]),
                      str(s.get("instances", "-")), rates, kv_text(s.get("kv", {})), errors)
    Console().print(table)
    if status.get("trainer_lease"):  # the one trainer of the run (arlo/coord/lease.py)
        Console().print(f"trainer lease held by {status['trainer_lease']}")
    if status.get("trainer_waiting_on"):  # why no step is taken now, in the core's words
        Console().print(f"trainer waiting: {status['trainer_waiting_on']}")
    if status.get("trainer_diagnostics"):
        Console().print(diagnostics_line(status["trainer_diagnostics"]))
    if status.get("latest_eval"):
        Console().print(eval_text(f"{status['latest_eval']['tag']!r} (latest)", status["latest_eval"]))


def kv_text(kv: dict) -> str:
    """Inference's paged KV cache: pages in use, the prefix cache's hit rate, preemptions."""
    if not kv.get("kv_pages"):
        return "-"
    hit = f", prefix hits {kv['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in kv else ""
    preempted = f", {kv['preemptions']} preempted" if kv.get("preemptions") else ""
    return f"{kv.get('kv_pages_used', 0)}/{kv['kv_pages']} pages{hit}{preempted}"


DIAGNOSTICS_SHOWN = ("loss", "reward_mean", "kl_ref", "approx_kl", "clip_fraction", "entropy", "grad_norm",
                     "logprob_mismatch", "logprob_outside", "is_weight", "staleness_mean", "staleness_max", "response_length_mean")


def diagnostics_line(d: dict) -> str:
    """The trainer's last step record, as one line (`arlo status --json` has all of it)."""
    shown = ", ".join(f"{k} {d[k]:.4g}" for k in DIAGNOSTICS_SHOWN if isinstance(d.get(k), int | float))
    components = ", ".join(f"{k} {v:.3f}" for k, v in d.get("reward_components", {}).items())
    by_env = d.get("reward_by_env", {})
    envs = ", ".join(f"{k} {v:.3f} ({d.get('trajectories_by_env', {}).get(k, '?')})" for k, v in by_env.items())
    line = f"trainer step {d['step']} ({d['phase']}, v{d['version']}): {shown}"
    line += f"; reward components: {components}" if components else ""
    return line + (f"; reward by environment (trajectories): {envs}" if len(by_env) > 1 else "")


