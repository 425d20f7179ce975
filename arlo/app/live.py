"""The live view of a training run: a progress bar over the planned steps and a table of the
latest steps (step, phase, version, loss, reward, staleness, trajectories/s, tokens/s), with
held-out evaluations as they arrive."""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROWS_SHOWN = 8
COLUMNS = ("step", "phase", "version", "loss", "reward", "staleness", "traj/s", "tokens/s")


class LiveRun:
    def __init__(self, console: Console, *, rl_steps: int | None) -> None:
        self.console = console
        self.rl_steps = rl_steps
        self.progress = Progress(TextColumn("[bold]{task.fields[phase]}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
        self.task = self.progress.add_task("run", total=None, phase="starting", info="")
        self.rows: deque[dict[str, Any]] = deque(maxlen=ROWS_SHOWN)
        self.evals: list[str] = []
        self.first_step: int | None = None
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveRun:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.update(self._render())
        self.live.__exit__(*exc)

    def update(self, event: dict[str, Any]) -> None:
        if "evaluating" in event:
            self.progress.update(self.task, info=f"evaluating ({event['evaluating']})")
        elif "evaluated" in event:
            self.evals.append(eval_text(event["evaluated"], event))
        else:
            self._step(event)
        self.live.update(self._render())

    def _step(self, row: dict[str, Any]) -> None:
        if self.first_step is None:
            self.first_step = row["step"] - 1
        # The SFT steps still to come (none when the trainer resumed past its warm start: a run
        # resumed from an old ARLO_HOME showed "RL 1/0"), then the RL steps asked for.
        sft_left = max(row["sft_steps"] - self.first_step, 0)
        total = sft_left + self.rl_steps if self.rl_steps is not None else None
        self.progress.update(self.task, completed=row["step"] - self.first_step, total=total,
                             phase="SFT warm start" if row["phase"] == "sft" else "RL",
                             info=f"v{row['version']} loss {row['loss']:.4f}")
        self.rows.append(row)

    def _render(self) -> Group:
        table = Table(*COLUMNS, title="latest steps", title_justify="left")
        for r in self.rows:
            table.add_row(str(r["step"]), r["phase"], str(r["version"]), f"{r['loss']:.4f}", _num(r["reward"]),
                          _num(r["staleness"], 2), f"{r['trajectories_per_s']:.1f}", f"{r['tokens_per_s']:.0f}")
        return Group(self.progress, table, *self.evals[-6:])


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def eval_text(tag: str, e: dict[str, Any]) -> str:
    """An evaluation result as rich text: the overall figures, then one line per environment of a
    mixture. Shown live by `arlo train`/`demo` and as the latest evaluation by `arlo status`."""
    if "error" in e:
        return f"[red]eval {tag}: {e['error']}"
    ran_on = f"v{e['min_version']}" if e.get("min_version") == e.get("max_version") else \
        f"v{e.get('min_version', '?')}-v{e.get('max_version', '?')}"
    lines = [f"eval {tag} (ran on {ran_on}): {_figures(e)} over {e['num_tasks']} held-out tasks "
             f"({e.get('wall_s', 0.0):.1f}s)"]
    if e.get("errors"):  # else "greedy 0.000" hid episodes that all failed (issue 33, item 3)
        lines.append(f"[red]  {errors_text(e)}[/red]")
    envs = e.get("envs") or {}
    if len(envs) > 1:
        lines += [f"  {env}: {_figures({'k': e['k'], **f})}" + (f", {f['errors']} errors" if f.get("errors") else "")
                  for env, f in envs.items()]
    return "\n".join(lines)


def errors_text(e: dict[str, Any]) -> str:
    """An evaluation's failed episodes: how many, and the first one's error."""
    first = f"; the first: {escape(e['first_error'])}" if e.get("first_error") else ""
    return f"{e['errors']} episodes failed (scored 0){first}"


def _figures(e: dict[str, Any]) -> str:
    return f"greedy {e['greedy_reward']:.3f}, sampled {e['sampled_reward']:.3f}, pass@{e['k']} {e['pass_at_k']:.3f}"
