"""The trainer's RL step as a trace: phases laid from the step record's marks tile the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arlo.config import TracingConfig
from arlo.tracing import start_tracing
from services.trainer.step_spans import StepSpans, step_phases

T0 = 1_800_000_000.0


def record(prev: float = T0) -> dict:
    anatomy = {
        "prev_cut_at": prev,
        "batch_at": T0 + 1.0,
        "train_at": T0 + 1.1,
        "trained_at": T0 + 1.6,
        "cut_at": T0 + 1.8,
        "published_at": T0 + 1.8,
    }
    timing = {
        "tail_s": 0.05,
        "intake_s": 0.15,
        "wait_s": 0.8,
        "batch_s": 0.1,
        "train_s": 0.5,
        "publish_s": 0.2,
    }
    return {
        "phase": "rl",
        "step": 7,
        "version": 8,
        "loss": 0.25,
        "reward_mean": 0.5,
        "anatomy": anatomy,
        "timing": timing,
    }


def test_phases_tile_the_step_in_order() -> None:
    start, phases = step_phases(record())
    assert start == T0 and [p[0] for p in phases] == ["tail", "wait", "intake", "batch", "train", "publish"]
    assert all(a[2] == pytest.approx(b[1]) for a, b in zip(phases, phases[1:], strict=False))
    assert phases[-1][2] == T0 + 1.8 and phases[2][2] == pytest.approx(
        T0 + 1.0
    )  # intake ends as the batch starts


def test_first_step_and_sft_records() -> None:
    start, phases = step_phases(record(prev=0.0))  # no previous publish: no wait accounted
    assert start == pytest.approx(T0 + 0.85) and [p[0] for p in phases] == [
        "intake",
        "batch",
        "train",
        "publish",
    ]
    assert step_phases({"phase": "sft", "step": 1}) is None


async def test_step_span_is_a_root_with_one_child_per_phase(tmp_path: Path) -> None:
    tracing = start_tracing(TracingConfig(enabled=True, dir=str(tmp_path)), service="trainer", run_id="r")
    assert tracing is not None
    await StepSpans(tracing.tracer("test")).add(record())
    tracing.shutdown()
    spans = [json.loads(line) for line in (tmp_path / "trainer.jsonl").read_text().splitlines()]
    (step,) = [s for s in spans if s["name"] == "trainer.step"]
    children = sorted((s for s in spans if s is not step), key=lambda s: s["start_ns"])
    assert step["parent_id"] is None and step["attributes"]["arlo.version"] == 8
    assert [c["name"] for c in children] == [
        f"trainer.{p}" for p in ("tail", "wait", "intake", "batch", "train", "publish")
    ]
    assert all(c["parent_id"] == step["span_id"] and c["trace_id"] == step["trace_id"] for c in children)
    assert (step["start_ns"], step["end_ns"]) == (children[0]["start_ns"], children[-1]["end_ns"])


async def test_an_overlapped_publish_is_a_child_past_the_step(tmp_path: Path) -> None:
    """The publish's rest ran beside the next step: its span runs from the cut to the pointer's
    move, after the phases that tile the step."""
    overlapped = record()
    overlapped["anatomy"] = {**overlapped["anatomy"], "cut_at": T0 + 1.61, "published_at": T0 + 1.65}
    start, phases = step_phases(overlapped)
    assert [p[0] for p in phases][-2:] == ["publish", "publish_overlapped"]
    assert phases[-2][1:] == (T0 + 1.6, T0 + 1.61) and phases[-1][1:] == (T0 + 1.61, T0 + 1.65)
    tracing = start_tracing(TracingConfig(enabled=True, dir=str(tmp_path)), service="trainer", run_id="r")
    assert tracing is not None
    await StepSpans(tracing.tracer("test")).add(overlapped)
    tracing.shutdown()
    spans = {s["name"]: s for s in map(json.loads, (tmp_path / "trainer.jsonl").read_text().splitlines())}
    assert spans["trainer.step"]["end_ns"] == spans["trainer.publish"]["end_ns"] == int((T0 + 1.61) * 1e9)
    assert spans["trainer.publish_overlapped"]["parent_id"] == spans["trainer.step"]["span_id"]
