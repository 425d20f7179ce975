"""What a training run leaves behind: metrics as JSONL and TensorBoard events, and a PNG plot.

One row per trainer step (the trainer's own diagnostics record for that step, read from the
run's metrics stream, plus the driver's throughput) and one per evaluation, written as they
happen so a crash keeps what was seen.

One step axis for everything: the trainer's global optimizer step (SFT and RL steps counted
together, `step` in every row). Train scalars sit at the step that produced them; an evaluation
sits at the step that published the newest version its episodes were sampled from. SFT and RL
losses are different quantities (cross-entropy vs the policy objective) and go under separate
tags: `sft/loss` and `train/loss`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

THROUGHPUT_SCALARS = ("trajectories_per_s", "tokens_per_s")
EVAL_SCALARS = ("greedy_reward", "sampled_reward", "pass_at_k")
NESTED = ("reward_components", "dropped", "finish_reasons", "reward_by_env", "trajectories_by_env", "timing")
"""Per-name breakdowns in a step row, logged as `<group>/<name>`."""
NOT_SCALARS = frozenset({"step", "version", "phase", "time", "kind", "sft_steps", "until_step", "elapsed_s"})


class RunRecorder:
    def __init__(self, out_dir: Path, *, run_id: str = "") -> None:
        from tensorboardX import SummaryWriter  # imported here: only runs that record pay for it

        self.out_dir = out_dir
        self.run_id = run_id
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        self.plot_path = out_dir / "reward.png"
        self._jsonl = self.metrics_path.open("w")
        self._tb = SummaryWriter(logdir=str(out_dir / "tensorboard"))
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def step(self, row: dict[str, Any]) -> None:
        self.steps.append(row)
        self._write({"kind": "step", **row})
        for tag, value in tensorboard_scalars(row).items():
            self._tb.add_scalar(tag, value, global_step=row["step"], walltime=row["time"])

    def evaluation(self, tag: str, result: dict[str, Any], *, step: int, elapsed_s: float, time: float) -> None:
        row = {"tag": tag, "step": step, "elapsed_s": elapsed_s, "time": time, **result}
        self.evals.append(row)
        self._write({"kind": "eval", **row})
        for tag, value in eval_scalars(result).items():
            self._tb.add_scalar(tag, value, global_step=step, walltime=time)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
        if self.steps or self.evals:
            plot_run(self.steps, self.evals, self.plot_path, run_id=self.run_id)

    def _write(self, row: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def tensorboard_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """Tag -> value for one step row: `sft/*` for SFT steps, `train/*` for RL steps,
    `throughput/*`, and `<group>/<name>` for the per-name breakdowns (reward components, drops)."""
    phase = "sft" if row.get("phase") == "sft" else "train"
    out: dict[str, float] = {}
    for name, value in row.items():
        if name in NOT_SCALARS or not _number(value):
            continue
        out[f"throughput/{name}" if name in THROUGHPUT_SCALARS else f"{phase}/{name}"] = float(value)
    for group in NESTED:
        for name, value in (row.get(group) or {}).items():
            if _number(value):
                out[f"{group}/{name}"] = float(value)
    return out


def eval_scalars(result: Mapping[str, Any]) -> dict[str, float]:
    """Tag -> value for one evaluation: `eval/<name>` overall, `eval/<env>/<name>` per environment
    of the mixture (its label) when there are several."""
    out = {f"eval/{name}": float(result[name]) for name in EVAL_SCALARS if _number(result.get(name))}
    envs = result.get("envs") or {}
    if len(envs) > 1:  # one environment's figures are the overall ones
        for env, figures in envs.items():
            out.update({f"eval/{env}/{name}": float(figures[name]) for name in EVAL_SCALARS
                        if _number(figures.get(name))})
    return out


def _series(steps: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """x = step, y = the value or NaN where the row has none: matplotlib breaks the line there."""
    ys = [float(s[key]) if _number(s.get(key)) else math.nan for s in steps]
    return [s["step"] for s in steps], ys


def plot_run(steps: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, *, run_id: str = ""):
    """Reward (training and held-out) and throughput against the trainer step, one PNG; returns the
    figure (closed). Every line has a legend entry; a step without a value is a gap, never an
    interpolation; the SFT warm start is shaded and the start of RL marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    fig.suptitle(f"run {run_id}" if run_id else "run", fontsize=11)
    steps = sorted(steps, key=lambda s: s["step"])
    _mark_phases(steps, (top, bottom))
    x, reward = _series(steps, "reward")
    top.plot(x, reward, ".-", alpha=0.5, markersize=3, label="training batch reward")
    for key, style in (("sampled_reward", "o-"), ("greedy_reward", "s--")):
        points = sorted((e["step"], e[key]) for e in evals if _number(e.get(key)))
        if points:
            top.plot(*zip(*points, strict=True), style, label=f"held-out {key.replace('_', ' ')}")
    envs = sorted({env for e in evals if len(e.get("envs") or {}) > 1 for env in e["envs"]})
    for env in envs:  # a mixture: each environment's held-out sampled reward, thinner
        points = sorted((e["step"], e["envs"][env]["sampled_reward"]) for e in evals
                        if _number((e.get("envs") or {}).get(env, {}).get("sampled_reward")))
        if points:
            top.plot(*zip(*points, strict=True), "^:", alpha=0.7, markersize=4, label=f"held-out sampled: {env}")
    top.set_ylabel("reward")
    top.set_ylim(-0.05, 1.05)
    top.legend(loc="best", fontsize=8)  # "lower right" sat on the after-SFT evaluation's point
    top.grid(alpha=0.3)
    x, tokens = _series(steps, "tokens_per_s")
    bottom.plot(x, tokens, color="tab:blue", label="trained tokens/s")
    bottom.set_ylabel("trained tokens/s")
    twin = bottom.twinx()
    x, trajs = _series([{**s, "trajectories_per_s": s.get("trajectories_per_s") if s.get("phase") == "rl"
                         else None} for s in steps], "trajectories_per_s")
    twin.plot(x, trajs, color="tab:orange", label="trajectories/s")
    twin.set_ylabel("trajectories/s")
    handles, labels = bottom.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    bottom.legend(handles + more_handles, labels + more_labels, loc="upper left", fontsize=8)
    compressed = _compress_warm_start(steps, bottom)
    bottom.set_xlabel("trainer step (SFT and RL)" + (f"; the SFT span drawn {compressed:.0f}x narrower" if compressed
                                                     else ""))
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


SFT_WIDTH = 0.25
"""At most this share of the x axis goes to the SFT warm start: 600 SFT steps before 80 RL steps
squeezed RL into 12% of the plot (issue 33, item 7)."""


def _compress_warm_start(steps: list[dict[str, Any]], ax: Any) -> float:
    """Draws the warm start's steps narrower when they would take more than SFT_WIDTH of the axis
    (a piecewise-linear scale, shared by both panels); returns the factor (0: not compressed)."""
    sft_end = max((s["step"] for s in steps if s.get("phase") == "sft"), default=0)
    last = max((s["step"] for s in steps), default=0)
    rl_span = last - sft_end
    if sft_end <= 0 or rl_span <= 0 or sft_end <= rl_span * SFT_WIDTH / (1 - SFT_WIDTH):
        return 0.0
    scale = rl_span * SFT_WIDTH / (1 - SFT_WIDTH) / sft_end
    edge = sft_end * scale

    def forward(x: Any) -> Any:
        import numpy as np

        x = np.asarray(x, dtype=float)
        return np.where(x <= sft_end, x * scale, edge + (x - sft_end))

    def inverse(y: Any) -> Any:
        import numpy as np

        y = np.asarray(y, dtype=float)
        return np.where(y <= edge, y / scale, sft_end + (y - edge))

    from matplotlib.ticker import MaxNLocator

    ax.set_xscale("function", functions=(forward, inverse))
    # Ticks placed in data space would crowd the narrow SFT span and leave RL's unlabelled.
    rl_ticks = [t for t in MaxNLocator(6, integer=True).tick_values(sft_end, last) if sft_end < t <= last]
    ax.set_xticks([0, sft_end, *rl_ticks])
    ax.set_xlim(0, last + 1)
    return 1 / scale


def _mark_phases(steps: list[dict[str, Any]], axes: tuple[Any, ...]) -> None:
    sft = [s["step"] for s in steps if s.get("phase") == "sft"]
    rl = [s["step"] for s in steps if s.get("phase") == "rl"]
    for ax in axes:
        if sft:
            # Step k is the k-th update: the warm start spans (first - 1, last].
            ax.axvspan(min(sft) - 1, max(sft), color="tab:green", alpha=0.12, label="SFT warm start")
        if rl:
            ax.axvline(min(rl) - 1, color="tab:red", linestyle=":", label="RL starts")
