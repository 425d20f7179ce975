"""What a training run leaves behind: metrics as JSONL and TensorBoard events, and a PNG plot.

One row per trainer step (the driver's view: step, version, phase, loss, reward, staleness,
throughput) and one per evaluation, written as they happen so a crash keeps what was seen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STEP_SCALARS = ("loss", "reward", "staleness", "trajectories_per_s", "tokens_per_s")
EVAL_SCALARS = ("greedy_reward", "sampled_reward", "pass_at_k")


class RunRecorder:
    def __init__(self, out_dir: Path) -> None:
        from tensorboardX import SummaryWriter  # imported here: only runs that record pay for it

        self.out_dir = out_dir
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
        for name in STEP_SCALARS:
            if row.get(name) is not None:
                self._tb.add_scalar(f"train/{name}", row[name], global_step=row["step"], walltime=row["time"])

    def evaluation(self, tag: str, result: dict[str, Any], *, step: int, elapsed_s: float, time: float) -> None:
        row = {"tag": tag, "step": step, "elapsed_s": elapsed_s, "time": time, **result}
        self.evals.append(row)
        self._write({"kind": "eval", **row})
        for name in EVAL_SCALARS:
            if isinstance(result.get(name), int | float):
                self._tb.add_scalar(f"eval/{name}", result[name], global_step=step, walltime=time)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
        if self.steps or self.evals:
            plot_run(self.steps, self.evals, self.plot_path)

    def _write(self, row: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()


def plot_run(steps: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> None:
    """Reward (training and held-out) and throughput against wall time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rl = [s for s in steps if s.get("phase") == "rl"]
    top.plot([s["elapsed_s"] for s in rl], [s["reward"] for s in rl], ".", alpha=0.4, label="training batch reward")
    for key, style in (("sampled_reward", "o-"), ("greedy_reward", "s--")):
        points = [(e["elapsed_s"], e[key]) for e in evals if key in e]
        if points:
            top.plot(*zip(*points, strict=True), style, label=f"held-out {key.replace('_', ' ')}")
    top.set_ylabel("reward")
    top.set_ylim(-0.05, 1.05)
    top.legend(loc="lower right", fontsize=8)
    top.grid(alpha=0.3)
    bottom.plot([s["elapsed_s"] for s in steps], [s.get("tokens_per_s") or 0 for s in steps], label="tokens/s")
    bottom.set_ylabel("trained tokens/s")
    twin = bottom.twinx()
    twin.plot([s["elapsed_s"] for s in rl], [s.get("trajectories_per_s") or 0 for s in rl], color="tab:orange",
              label="trajectories/s")
    twin.set_ylabel("trajectories/s")
    bottom.set_xlabel("wall time (s)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
