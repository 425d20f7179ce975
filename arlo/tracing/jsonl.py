"""Spans as JSON lines, one file per service: what `arlo up` and `arlo demo` write, and what
`python -m arlo.tracing summary` reads. Imported only when tracing is on (it loads the SDK)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One line: ids as lowercase hex (as W3C traceparent and collectors show them), times in Unix ns."""
    ctx = span.get_span_context()
    assert ctx is not None, "an ended SDK span has a context"
    parent = span.parent
    record = {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }
    if span.links:  # e.g. a StepBatch's span names the episodes whose steps it carried
        record["links"] = [
            {"trace_id": f"{k.context.trace_id:032x}", "span_id": f"{k.context.span_id:016x}"}
            for k in span.links
        ]
    return record


class JsonlSpanExporter(SpanExporter):
    """Appends each batch with one write(): several processes of one service (two rollout
    workers) can share a file without tearing each other's lines."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # the batch worker exports; shutdown may come from another thread

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is already written through
