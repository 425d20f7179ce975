"""Per-server Prometheus metrics and the /metrics HTTP endpoint that serves them.

Each server gets its own CollectorRegistry (no process-wide globals), so tests can run
several servers in one process and read each one's numbers apart.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# Generation and weight streams take seconds to minutes; the default buckets stop at 10 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RpcMetrics:
    """`arlo_rpc_requests_total{service,method,code}` and `arlo_rpc_latency_seconds{service,method}`."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        self.requests = Counter("arlo_rpc_requests", "RPCs handled, by final status code.",
                                ["service", "method", "code"], registry=registry)
        self.latency = Histogram("arlo_rpc_latency_seconds", "Time from handler start to final status "
                                 "(a whole stream for streaming RPCs).", ["service", "method"],
                                 registry=registry, buckets=LATENCY_BUCKETS)

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(self.service, method, code).inc()
        self.latency.labels(self.service, method).observe(seconds)


@dataclass(slots=True)
class MetricsHttpServer:
    """prometheus_client's WSGI server in a daemon thread; `port` is the bound port."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    @classmethod
    def start(cls, host: str, port: int, registry: CollectorRegistry) -> MetricsHttpServer:
        try:
            httpd, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve /metrics on {host}:{port}: {e.strerror}") from e
        return cls(httpd=httpd, thread=thread)

    async def close(self) -> None:
        # shutdown() blocks until serve_forever's next poll (up to 0.5 s): keep it off the loop.
        await asyncio.to_thread(self.httpd.shutdown)
        self.httpd.server_close()
