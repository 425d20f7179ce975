"""One service's tracing: a TracerProvider, its exporters, and the gRPC interceptors that carry
trace context across processes (W3C `traceparent` in the call's metadata).

OpenTelemetry's SDK and its gRPC instrumentation are imported only here, and only when tracing
is on (they cost ~40-70 ms of import): a service with tracing off loads none of it, installs no
provider and opens no file. The provider is handed to the interceptors and tracers explicitly;
`service_tracing` also installs it as OpenTelemetry's global one, so instrumented code we do not
own (a plugin, a black-box agent) joins the same traces.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arlo.config import ConfigError, TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanContext, Tracer

log = logging.getLogger(__name__)

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""The standard variable; OpenTelemetry's exporter also reads the rest of OTEL_EXPORTER_OTLP_* itself."""
OTLP_TIMEOUT_ENV = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
FLUSH_TIMEOUT_S = 5.0
"""What a graceful stop waits for the last spans to be written (or sent to the collector)."""


class Tracing:
    """A service's provider, and the interceptors its server and channels install."""

    def __init__(self, provider: TracerProvider, service: str) -> None:
        self.provider = provider
        self.service = service

    def tracer(self, name: str) -> Tracer:
        return self.provider.get_tracer(name)

    def server_interceptor(self) -> Any:
        """A span per served RPC, a child of the caller's span (health and reflection left out)."""
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return aio_server_interceptor(tracer_provider=self.provider, filter_=_traced_rpcs())

    def client_interceptors(self) -> list[Any]:
        """A span per outgoing RPC, whose context goes with the call in its metadata."""
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return aio_client_interceptors(tracer_provider=self.provider, filter_=_traced_rpcs())

    def shutdown(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Writes what the batch processors still hold, then closes the exporters."""
        if not self.provider.force_flush(timeout_millis=int(timeout_s * 1000)):
            log.warning(
                "%s: traces not flushed within %.0fs; the last spans may be missing", self.service, timeout_s
            )
        self.provider.shutdown()


def _traced_rpcs() -> Any:
    from opentelemetry.instrumentation.grpc.filters import (
        any_of,
        health_check,
        method_name,
        negate,
        service_prefix,
    )

    # Probes call health several times a second, and `arlo train`/`demo` poll GetStatus (747 of
    # a run's 783 trainer traces, issue 33): as spans they would bury the work.
    return negate(any_of(health_check(), service_prefix("grpc.reflection."), method_name("GetStatus")))


def otlp_endpoint(cfg: TracingConfig) -> str:
    return cfg.otlp_endpoint or os.environ.get(OTLP_ENDPOINT_ENV, "")


def start_tracing(cfg: TracingConfig, *, service: str, run_id: str) -> Tracing | None:
    """The service's tracing, or None when `cfg` leaves it off (nothing imported, nothing written).

    Spans go to `<cfg.dir>/<service>.jsonl` and/or the OTLP collector; ConfigError when tracing
    is on and neither is set.
    """
    if not cfg.enabled:
        return None
    endpoint = otlp_endpoint(cfg)
    if not cfg.dir and not endpoint:
        raise ConfigError(
            f"tracing.enabled: spans would go nowhere; set tracing.dir or tracing.otlp_endpoint "
            f"(or ${OTLP_ENDPOINT_ENV})"
        )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from arlo.tracing.jsonl import JsonlSpanExporter

    resource = Resource.create(
        {
            "service.name": service,
            "service.namespace": run_id,
            "arlo.run_id": run_id,
            "service.instance.id": f"{os.uname().nodename}-{os.getpid()}",
        }
    )
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    if cfg.dir:
        path = Path(cfg.dir) / f"{service}.jsonl"
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(path)))
    if endpoint:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(cfg.otlp_endpoint)))
    log.info(
        "%s: tracing to %s",
        service,
        " and ".join(
            [
                *([str(Path(cfg.dir) / f"{service}.jsonl")] if cfg.dir else []),
                *([endpoint] if endpoint else []),
            ]
        ),
    )
    return Tracing(provider, service)


def _otlp_exporter(endpoint: str) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    # Unset here, the exporter reads $OTEL_EXPORTER_OTLP_ENDPOINT (and its headers, certificate
    # and timeout variables) itself. Its default timeout (10 s, retries included) would let a
    # collector that never answers hold a stop for 5 s of flush plus 10 s of export.
    kwargs: dict[str, Any] = {"endpoint": endpoint} if endpoint else {}
    if not any(v in os.environ for v in OTLP_TIMEOUT_ENV):
        kwargs["timeout"] = FLUSH_TIMEOUT_S
    return OTLPSpanExporter(**kwargs)


@contextmanager
def service_tracing(cfg: TracingConfig, *, service: str, run_id: str) -> Iterator[Tracing | None]:
    """A service `main`'s tracing for its lifetime: started (and made global) on entry; on exit,
    the SIGTERM path included, its last spans are flushed."""
    tracing = start_tracing(cfg, service=service, run_id=run_id)
    if tracing is not None:
        from opentelemetry import trace

        trace.set_tracer_provider(tracing.provider)
    try:
        yield tracing
    finally:
        if tracing is not None:
            tracing.shutdown()


def span(
    tracer: Tracer | None,
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    links: Sequence[SpanContext] = (),
) -> AbstractContextManager[Span | None]:
    """`tracer`'s span `name`, current for the block (RPCs made in it are its children); with no
    tracer, nothing (yields None). `links`: spans of other traces this one serves (a batch's callers)."""
    if tracer is None:
        return nullcontext()
    if links:
        from opentelemetry.trace import Link

        return tracer.start_as_current_span(name, attributes=attributes, links=[Link(c) for c in links])
    return tracer.start_as_current_span(name, attributes=attributes)


def start_span(tracer: Tracer | None, name: str) -> Span | None:
    """A span started now, not current anywhere yet: work begun before the block it belongs to
    (a Reset prefetched before an episode runs) is made its child with `in_span(..., end=False)`,
    and the block itself runs in `in_span(..., end=True)`. None untraced."""
    return None if tracer is None else tracer.start_span(name)


def in_span(started: Span | None, *, end: bool) -> AbstractContextManager[Span | None]:
    """`started` (from `start_span`) current for the block, ended after it when `end`; nothing for None."""
    if started is None:
        return nullcontext()
    from opentelemetry import trace

    return trace.use_span(started, end_on_exit=end)


def current_span_context(tracer: Tracer | None) -> SpanContext | None:
    """The span current here, to link to from work done later on others' behalf; None untraced."""
    if tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None
