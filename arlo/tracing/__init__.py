"""OpenTelemetry traces across arlo's services (docs/architecture.md, Traces).

`start_tracing` / `service_tracing` set up one service's provider and exporters (a JSONL file per
service, OTLP when configured); `Tracing` hands out the gRPC interceptors and tracers; `span` is
a no-op without a tracer. Nothing of OpenTelemetry is imported until tracing is on.
"""

from arlo.tracing.setup import (
    Tracing,
    current_span_context,
    in_span,
    service_tracing,
    span,
    start_span,
    start_tracing,
)

__all__ = ["Tracing", "current_span_context", "in_span", "service_tracing", "span", "start_span", "start_tracing"]
