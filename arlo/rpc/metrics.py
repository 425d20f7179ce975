"""Per-server Prometheus metrics and the /metrics HTTP endpoint that serves them.

Each server gets its own CollectorRegistry (no process-wide globals), so tests can run
several servers in one process and read each one's numbers apart.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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


TRAINER_GAUGES = {
    "version": "Newest published policy version.",
    "step": "Optimizer steps taken (SFT and RL).",
    "reward": "Mean reward of the last RL step's batch.",
    "kl_ref": "Mean per-token KL to the reference policy (last RL step; only with a KL penalty).",
    "approx_kl": "Mean k3 KL between the proximal and the current policy (last RL step).",
    "clip_fraction": "Fraction of model tokens whose ratio was clipped (last RL step).",
    "entropy": "Mean token entropy (last RL step; only with an entropy bonus).",
    "grad_norm": "Global gradient norm before clipping (last step).",
    "logprob_mismatch": "Mean |behaviour - trainer| logprob on the model tokens both kept (last RL step).",
    "logprob_outside": "Fraction of model tokens outside the set that scored them: the sampler's recorded kept set, else the trainer's own top-k/top-p/min-p filter (last RL step).",
    "is_weight": "Mean importance weight on model tokens (last RL step).",
    "routing_mismatch": "Fraction of recorded model tokens whose experts in the trainer's forward differ from the "
                        "sampler's in any routed layer (last RL step; only with recorded routing, 0 with replay).",
    "staleness": "Mean versions the sampling policy of the last RL step's tokens was behind.",
    "staleness_max": "Largest token lag of the last RL step (bounded by trainer.max_staleness).",
    "queue_depth": "Trajectory stream entries not yet finished with by the trainer.",
    "response_length": "Mean model tokens per trajectory of the last RL step.",
}
RECORD_FIELDS = {"reward": "reward_mean", "staleness": "staleness_mean", "response_length": "response_length_mean"}


class SnapshotCollector(Collector):
    """Prometheus families read at scrape time from a snapshot of plain numbers kept elsewhere
    (exact, never stale, nothing to update on the hot path): `<prefix>_<name>_total` for the
    counters, `<prefix>_<name>` for the gauges, and a labelled counter per {label: total} dict."""

    def __init__(self, prefix: str, snapshot: Callable[[], Mapping[str, Any]], *, counters: Mapping[str, str] = {},
                 gauges: Mapping[str, str] = {}, labelled: Mapping[str, tuple[str, str]] = {}) -> None:
        self.prefix, self.snapshot = prefix, snapshot
        self.counters, self.gauges, self.labelled = dict(counters), dict(gauges), dict(labelled)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = self.snapshot()
        for name, doc in self.counters.items():
            if name in snap:
                yield CounterMetricFamily(f"{self.prefix}_{name}", doc, value=snap[name])
        for name, doc in self.gauges.items():
            if name in snap:
                yield GaugeMetricFamily(f"{self.prefix}_{name}", doc, value=snap[name])
        for name, (label, doc) in self.labelled.items():
            family = CounterMetricFamily(f"{self.prefix}_{name}", doc, labels=[label])
            for key, value in sorted(snap.get(name, {}).items()):
                family.add_metric([key], value)
            yield family


INFERENCE_COUNTERS = {
    "requests": "Generate requests admitted.",
    "generated_tokens": "Tokens sampled (rate() of it is tokens/s).",
    "swaps": "Weight versions swapped in.",
    "aborted": "Requests cancelled or failed.",
    "prefix_hit_tokens": "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
    "prefix_lookup_tokens": "Prompt tokens (in full pages) looked up in the prefix cache.",
    "prefix_evictions": "Cached KV pages evicted for new allocations.",
    "preemptions": "Requests preempted when KV pages ran out (recomputed when readmitted).",
    "recomputed": "Requests continued on new weights with their KV recomputed at a swap (partial rollouts).",
    "prefill_tokens": "Tokens prefilled (prefix cache hits excluded).",
    "compiles": "XLA programs compiled or loaded from the persistent cache (arlo.compile_watch).",
    "late_compiles": "XLA compiles after the warm-up: stalls of the engine loop (a run should have none).",
    "ahead_compiles": "XLA compiles after the warm-up made while idle, ahead of any use (inference.compile_when_idle).",
}
INFERENCE_GAUGES = {
    "weight_version": "Policy version being served.",
    "waiting": "Requests queued for KV pages or a sequence slot.",
    "running": "Requests decoding now.",
    "slots": "Sequences in flight at most (inference.max_batch).",
    "batch_occupancy": "Sequences in flight / slots: the decode batch's fill.",
    "mean_batch": "Mean rows per decode chunk since start.",
    "kv_pages": "KV pages of the paged cache (inference.page_size positions each).",
    "kv_pages_used": "KV pages some sequence holds.",
    "kv_pages_cached": "KV pages named by the prefix cache (held or idle).",
    "kv_use": "kv_pages_used / kv_pages.",
    "prefix_hit_rate": "prefix_hit_tokens / prefix_lookup_tokens since start.",
    "last_swap_seconds": "Wall time of the last weight pull + verify + swap.",
    "programs": "Bucketed program shapes the engine has run.",
}


def inference_collector(snapshot: Callable[[], Mapping[str, Any]]) -> SnapshotCollector:
    return SnapshotCollector("arlo_inference", snapshot, counters=INFERENCE_COUNTERS, gauges=INFERENCE_GAUGES)


def rollout_collector(snapshot: Callable[[], Mapping[str, Any]]) -> SnapshotCollector:
    return SnapshotCollector("arlo_rollout", snapshot, counters={
        "episodes": "Episodes finished (rate() of it is episodes/s).",
        "groups": "Groups finished.",
        "turns": "Model turns taken.",
        "tool_call_errors": "Tool calls the environment answered with an error (bad call, failed tool).",
        "retries": "Episode retries after a retryable backend error.",
        "failed_groups": "Groups masked as failed.",
    }, labelled={"finish_reasons": ("reason", "Episodes by why they ended.")})


class TrainerMetrics:
    """`arlo_trainer_<name>` gauges and `arlo_trainer_loss{phase}` set from each step's diagnostics
    record (services/trainer/diagnostics.py); `arlo_trainer_tokens_trained_total`; and
    `arlo_trainer_dropped_total{reason}` read live from `dropped` (drops happen between steps too)."""

    def __init__(self, registry: CollectorRegistry, dropped: Callable[[], Mapping[str, int]]) -> None:
        self.gauges = {name: Gauge(f"arlo_trainer_{name}", doc, registry=registry)
                       for name, doc in TRAINER_GAUGES.items()}
        self.loss = Gauge("arlo_trainer_loss", "Loss of the last step, by phase (sft: cross-entropy, rl: policy).",
                          ["phase"], registry=registry)
        registry.register(SnapshotCollector("arlo_trainer", lambda: {"dropped": dropped()}, labelled={
            "dropped": ("reason", "Trajectories not trained on, by reason.")}))
        self.tokens = Counter("arlo_trainer_tokens_trained", "Model tokens trained on (SFT and RL).",
                              registry=registry)
        self._tokens_seen = 0

    def started(self, *, version: int, step: int) -> None:
        """Where a (re)started trainer stands before its first step: a restart restored from a
        checkpoint read version 0 and step 0 until the next step (issue 33, item 7)."""
        self.gauges["version"].set(version)
        self.gauges["step"].set(step)

    def observe(self, record: Mapping[str, Any]) -> None:
        for name, gauge in self.gauges.items():
            value = record.get(RECORD_FIELDS.get(name, name))
            if isinstance(value, int | float):
                gauge.set(value)
        self.loss.labels(record.get("phase", "rl")).set(record["loss"])
        # The record carries a running total; the counter goes up by the difference.
        delta = record.get("tokens_trained", 0) - self._tokens_seen
        if delta > 0:
            self.tokens.inc(delta)
            self._tokens_seen += delta


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
