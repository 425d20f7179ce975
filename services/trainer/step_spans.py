"""Each RL step as a trace: a `trainer.step` span with one child per phase, laid out from the
step record's marks (services/trainer/anatomy.py) once the step is done. The loop itself carries
no tracing code; this is one more consumer of its records, like the metrics stream.

The step runs from the previous step's version cut to this one's (services/trainer/anatomy.py).
Its phases, in order: `tail` (the previous step's record and acks), `wait` (nothing to train
on), `intake` (reads that returned data, decode, grouping), `batch`, `train` (the jitted step)
and `publish` (inline, or the device copy of an overlapped one). The loop interleaves waiting
and intake; their totals are laid end to end, so these children tile the step exactly. An
overlapped publish's rest (serialise, hash, move the pointer) ran beside the next step: it is
one more child, `publish_overlapped`, from the cut to the pointer's move, past the step's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

RECORD_ATTRIBUTES = (
    "step",
    "version",
    "loss",
    "reward_mean",
    "num_trajectories",
    "num_tokens",
    "staleness_max",
)
"""Copied from the record onto the step span (as `arlo.<name>`)."""


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def step_phases(record: dict[str, Any]) -> tuple[float, list[tuple[str, float, float]]] | None:
    """(the step's start, [(phase, start, end)] in Unix seconds) from an RL step record; None for a
    record without marks (SFT steps)."""
    marks, timing = record.get("anatomy"), record.get("timing")
    if not marks or not timing:
        return None
    batch_at, train_at = marks["batch_at"], marks["train_at"]
    trained_at, cut_at = marks["trained_at"], marks["cut_at"]
    prev = marks.get("prev_cut_at") or 0.0
    phases: list[tuple[str, float, float]] = []
    if prev:  # the first RL step has no previous publish: its wait is not accounted
        at = prev
        for name in ("tail", "wait", "intake"):
            seconds = timing.get(f"{name}_s", 0.0)
            phases.append((name, at, at + seconds))
            at += seconds
        start = prev
    else:
        start = batch_at - timing.get("intake_s", 0.0)
        phases.append(("intake", start, batch_at))
    phases += [
        ("batch", batch_at, train_at),
        ("train", train_at, trained_at),
        ("publish", trained_at, cut_at),
    ]
    published_at = marks.get("published_at") or 0.0
    if published_at > cut_at:
        phases.append(("publish_overlapped", cut_at, published_at))
    return start, phases


class StepSpans:
    """`add` is an `on_step` consumer of the training loop."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    async def add(self, record: dict[str, Any]) -> None:
        laid = step_phases(record)
        if laid is None:
            return
        from opentelemetry import trace
        from opentelemetry.context import Context

        start, phases = laid
        attributes = {
            f"arlo.{k}": record[k] for k in RECORD_ATTRIBUTES if isinstance(record.get(k), int | float)
        }
        # A root of its own (Context()): a step is its own trace, whatever RPC happened to be current.
        step = self.tracer.start_span(
            "trainer.step", context=Context(), start_time=_ns(start), attributes=attributes
        )
        parent = trace.set_span_in_context(step)
        for name, begin, end in phases:
            self.tracer.start_span(f"trainer.{name}", context=parent, start_time=_ns(begin)).end(
                end_time=_ns(end)
            )
        step.end(end_time=_ns(record["anatomy"]["cut_at"]))
