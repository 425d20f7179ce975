"""Reading the span files back: per span name, how many and how long, over whole traces.

`python -m arlo.tracing summary DIR` prints it; bench/step_anatomy.py is the per-step view of the
trainer's own records, this is the per-RPC view across services.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_spans(directory: Path) -> list[dict[str, Any]]:
    """Every span of every `*.jsonl` file in `directory`; a torn last line (a killed process) is skipped."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans


@dataclass(frozen=True, kw_only=True, slots=True)
class NameStats:
    service: str
    name: str
    count: int
    traces: int
    """Distinct traces the name appears in."""
    mean_ms: float
    max_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    traces: int
    spans: int
    multi_service_traces: int
    """Traces whose spans come from more than one service (context crossed a process)."""
    names: tuple[NameStats, ...]


def summarize(spans: Iterable[dict[str, Any]]) -> Summary:
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    traces_of: dict[tuple[str, str], set[str]] = defaultdict(set)
    for trace_id, members in by_trace.items():
        for s in members:
            key = (s["service"], s["name"])
            durations[key].append((s["end_ns"] - s["start_ns"]) / 1e6)
            traces_of[key].add(trace_id)
    names = tuple(
        NameStats(
            service=svc,
            name=name,
            count=len(d),
            traces=len(traces_of[(svc, name)]),
            mean_ms=sum(d) / len(d),
            max_ms=max(d),
        )
        for (svc, name), d in sorted(durations.items())
    )
    return Summary(
        traces=len(by_trace),
        spans=sum(len(m) for m in by_trace.values()),
        multi_service_traces=sum(len({s["service"] for s in m}) > 1 for m in by_trace.values()),
        names=names,
    )


def format_summary(summary: Summary) -> str:
    lines = [
        f"{summary.traces} traces ({summary.multi_service_traces} across services), {summary.spans} spans",
        f"{'service':<12} {'span':<40} {'count':>7} {'traces':>7} {'mean ms':>9} {'max ms':>9}",
    ]
    lines += [
        f"{n.service:<12} {n.name:<40} {n.count:>7} {n.traces:>7} {n.mean_ms:>9.2f} {n.max_ms:>9.2f}"
        for n in summary.names
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m arlo.tracing", description="Read arlo's span files.")
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help="per span name: count and mean duration, over all traces")
    summary.add_argument(
        "dir", type=Path, help="a traces directory (default under `arlo up`: $ARLO_HOME/traces)"
    )
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"not a directory: {args.dir}")
    print(format_summary(summarize(read_spans(args.dir))))
    return 0
