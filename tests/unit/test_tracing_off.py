"""Tracing off costs nothing: no provider installed, no OpenTelemetry SDK or instrumentation loaded,
no file written. And where it is on by default: `arlo up` and `arlo demo` (arlo.app.local)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from arlo.app.local import default_tracing
from arlo.config import RunConfig, TracingConfig, replace_config

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys
from pathlib import Path
import services.rollout.__main__, services.env_gateway.__main__, services.reward.__main__
from arlo.config import RunConfig, TracingConfig
from arlo.tracing import service_tracing
from opentelemetry import trace
for cfg in (RunConfig().tracing, TracingConfig(enabled=False, dir=sys.argv[1])):
    with service_tracing(cfg, service="rollout", run_id="r") as tracing:
        assert tracing is None, tracing
print(type(trace.get_tracer_provider()).__name__, sorted(m for m in ("opentelemetry.sdk.trace",
      "opentelemetry.instrumentation.grpc", "opentelemetry.exporter.otlp") if m in sys.modules),
      sorted(p.name for p in Path(sys.argv[1]).iterdir()) if Path(sys.argv[1]).exists() else "no dir")
"""


def test_tracing_off_installs_no_provider_loads_no_sdk_and_writes_nothing(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    out = subprocess.run(
        [sys.executable, "-c", CODE, str(traces)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    assert out.stdout.split("\n")[-2] == "ProxyTracerProvider [] no dir"


def test_local_runs_trace_when_asked_and_keep_what_the_config_says(tmp_path: Path) -> None:
    cfg = RunConfig()
    assert cfg.tracing.enabled is False and default_tracing(cfg, tmp_path) == {}  # opt-in: it costs per RPC
    on = replace_config(cfg, {"tracing": {"enabled": True}})
    assert default_tracing(on, tmp_path) == {"enabled": True, "dir": str(tmp_path / "traces")}
    elsewhere = replace_config(
        cfg, {"tracing": {"enabled": True, "dir": "/data/spans", "otlp_endpoint": "http://collector:4317"}}
    )
    assert default_tracing(elsewhere, tmp_path) == {"enabled": True}
    assert replace_config(
        elsewhere, {"tracing": default_tracing(elsewhere, tmp_path)}
    ).tracing == TracingConfig(enabled=True, dir="/data/spans", otlp_endpoint="http://collector:4317")
