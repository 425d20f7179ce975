"""Trace context across real gRPC calls: servers on ephemeral ports and client channels, each with
its own tracing (its own provider and span file, as two processes have); a StepBatch's and a
coalesced ScoreBatch's links; and
export to a real OTLP/gRPC collector."""

from __future__ import annotations

import asyncio
import json
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from arlo.config import (
    AuthConfig,
    ConfigError,
    EnvGatewayConfig,
    RewardConfig,
    RunConfig,
    ServerConfig,
    TracingConfig,
)
from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
from arlo.rpc import make_channel
from arlo.tracing import span, start_tracing
from arlo.tracing.summary import read_spans, summarize
from services.env_gateway.__main__ import start_env_gateway
from services.reward.__main__ import start_reward
from services.rollout.clients import RewardClient
from services.rollout.env_affinity import AffinityEnvironmentClient


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_client_and_server_spans_share_the_trace_with_the_right_parents(tmp_path: Path) -> None:
    cfg = TracingConfig(enabled=True, dir=str(tmp_path))
    server_tracing = start_tracing(cfg, service="reward", run_id="r1")
    client_tracing = start_tracing(cfg, service="rollout", run_id="r1")
    assert server_tracing is not None and client_tracing is not None
    run = RunConfig(
        auth=AuthConfig(disabled=True), reward=RewardConfig(server=ServerConfig(port=0, metrics_port=-1))
    )
    server = await start_reward(run, server_tracing)
    try:
        async with make_channel(f"127.0.0.1:{server.port}", token=None, tracing=client_tracing) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            with span(client_tracing.tracer("test"), "test.episode"):
                reply = await stub.Score(
                    reward_pb2.ScoreRequest(reward_fn="exact_match", response="4", reference="4")
                )
            assert reply.reward == 1.0
    finally:
        await server.stop(None)
    # Nothing is on disk before the flush that a graceful stop does (the batch delay is 5 s).
    client_tracing.shutdown()
    server_tracing.shutdown()

    (episode, client) = sorted(lines(tmp_path / "rollout.jsonl"), key=lambda s: s["start_ns"])
    (served,) = lines(tmp_path / "reward.jsonl")  # health and reflection are not traced
    assert episode["name"] == "test.episode" and episode["parent_id"] is None
    assert client["name"] == served["name"] == "/arlo.v1.Reward/Score"
    assert (client["kind"], served["kind"]) == ("CLIENT", "SERVER")
    assert episode["trace_id"] == client["trace_id"] == served["trace_id"]
    assert client["parent_id"] == episode["span_id"] and served["parent_id"] == client["span_id"]
    assert (client["service"], served["service"]) == ("rollout", "reward")
    assert served["start_ns"] >= client["start_ns"] and served["end_ns"] <= client["end_ns"]

    summary = summarize(read_spans(tmp_path))
    assert (summary.traces, summary.spans, summary.multi_service_traces) == (1, 3, 1)
    assert {(n.service, n.name, n.count) for n in summary.names} == {
        ("rollout", "test.episode", 1),
        ("rollout", "/arlo.v1.Reward/Score", 1),
        ("reward", "/arlo.v1.Reward/Score", 1),
    }


def test_sampling_ratio_zero_records_nothing_and_children_follow_the_parent(tmp_path: Path) -> None:
    tracing = start_tracing(
        TracingConfig(enabled=True, dir=str(tmp_path), sample_ratio=0.0), service="rollout", run_id="r1"
    )
    assert tracing is not None
    with span(tracing.tracer("test"), "root") as root, span(tracing.tracer("test"), "child") as child:
        assert root is not None and child is not None
        assert not root.get_span_context().trace_flags.sampled and not child.is_recording()
    tracing.shutdown()
    assert (tmp_path / "rollout.jsonl").read_text() == ""


def test_on_with_nowhere_to_send_spans_is_an_error_naming_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with pytest.raises(ConfigError, match=r"tracing\.dir or tracing\.otlp_endpoint"):
        start_tracing(TracingConfig(enabled=True), service="reward", run_id="r1")


def test_config_checks_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^tracing\.sample_ratio: must be in \[0, 1\]"):
        TracingConfig(sample_ratio=1.5).validate("tracing")
    with pytest.raises(ConfigError, match=r"^tracing\.otlp_endpoint: must start with http:// or https://"):
        TracingConfig(otlp_endpoint="collector:4317").validate("tracing")


async def test_a_step_batch_is_a_root_linked_to_the_episodes_it_carried(tmp_path: Path) -> None:
    """Steps that wait for a busy replica leave together in one StepBatch: it belongs to none of the
    episodes' traces, so it is a root span of its own, linked to each of theirs."""
    cfg = TracingConfig(enabled=True, dir=str(tmp_path))
    server_tracing = start_tracing(cfg, service="env_gateway", run_id="r1")
    client_tracing = start_tracing(cfg, service="rollout", run_id="r1")
    assert server_tracing is not None and client_tracing is not None
    run = RunConfig(
        auth=AuthConfig(disabled=True),
        env_gateway=EnvGatewayConfig(server=ServerConfig(port=0, metrics_port=-1)),
    )
    server = await start_env_gateway(run, tracing=server_tracing)
    tracer = client_tracing.tracer("test")
    env = AffinityEnvironmentClient(
        f"ipv4:127.0.0.1:{server.port}",
        lambda a: make_channel(a, token=None, tracing=client_tracing),
        timeout_s=5,
        tracer=tracer,
    )

    async def episode(seed: int) -> str:
        with span(tracer, "test.episode") as current:
            started = await env.reset("arith", "", seed)
            await env.step(started.session_id, "x")
            return f"{current.get_span_context().span_id:016x}"

    try:
        episode_ids = await asyncio.gather(*(episode(seed) for seed in range(8)))
    finally:
        await env.aclose()
        await server.stop(None)
    client_tracing.shutdown()
    server_tracing.shutdown()

    assert env.calls["StepBatch"] >= 1
    spans = read_spans(tmp_path)
    batches = [s for s in spans if s["name"] == "rollout.step_batch"]
    assert len(batches) == env.calls["StepBatch"]
    linked = [link["span_id"] for b in batches for link in b["links"]]
    assert len(linked) == len(set(linked)) == env.calls["batched_steps"] and set(linked) <= set(episode_ids)
    episode_traces = {s["trace_id"] for s in spans if s["name"] == "test.episode"}
    for batch in batches:
        assert batch["parent_id"] is None and batch["trace_id"] not in episode_traces
        assert batch["attributes"]["arlo.steps"] == len(batch["links"])
        (call,) = [s for s in spans if s["parent_id"] == batch["span_id"]]
        (served,) = [s for s in spans if s["parent_id"] == call["span_id"]]
        assert (call["name"], call["kind"], served["kind"]) == (
            "/arlo.v1.Environment/StepBatch",
            "CLIENT",
            "SERVER",
        )
        assert served["service"] == "env_gateway" and served["trace_id"] == batch["trace_id"]
    # The steps that went alone are children of their episodes.
    alone = [s for s in spans if s["name"] == "/arlo.v1.Environment/Step" and s["kind"] == "CLIENT"]
    assert {s["parent_id"] for s in alone} == set(episode_ids) - set(linked)


async def test_a_coalesced_score_batch_is_a_root_linked_to_its_callers_and_a_lone_call_stays_theirs(
        tmp_path: Path) -> None:
    """The rollout's Coalescer (Score and Generate calls that arrive together) traces as StepBatch does."""
    cfg = TracingConfig(enabled=True, dir=str(tmp_path))
    server_tracing = start_tracing(cfg, service="reward", run_id="r1")
    client_tracing = start_tracing(cfg, service="rollout", run_id="r1")
    assert server_tracing is not None and client_tracing is not None
    server = await start_reward(RunConfig(auth=AuthConfig(disabled=True),
                                          reward=RewardConfig(server=ServerConfig(port=0, metrics_port=-1))),
                                tracing=server_tracing)
    tracer = client_tracing.tracer("test")
    channel = make_channel(f"127.0.0.1:{server.port}", token=None, tracing=client_tracing)
    scorer = RewardClient(channel, timeout_s=5, batch_window_s=0.05, tracer=tracer)

    async def episode() -> str:
        with span(tracer, "test.episode") as current:
            await scorer.score("exact_match", "4", "4")
            return f"{current.get_span_context().span_id:016x}"

    try:
        together = await asyncio.gather(*(episode() for _ in range(4)))
        alone = await episode()
    finally:
        await channel.close()
        await server.stop(None)
    client_tracing.shutdown()
    server_tracing.shutdown()

    spans = read_spans(tmp_path)
    (batch,) = [s for s in spans if s["name"] == "rollout.score_batch"]
    assert batch["parent_id"] is None and batch["attributes"]["arlo.requests"] == 4
    assert sorted(link["span_id"] for link in batch["links"]) == sorted(together)
    (call,) = [s for s in spans if s["parent_id"] == batch["span_id"]]
    assert call["name"] == "/arlo.v1.Reward/ScoreBatch"
    (lone,) = [s for s in spans if s["name"] == "/arlo.v1.Reward/Score" and s["kind"] == "CLIENT"]
    assert lone["parent_id"] == alone


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC endpoint that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: N802 (the generated name)
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.mark.parametrize("from_env", [False, True])
def test_spans_go_to_an_otlp_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, from_env: bool
) -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        if from_env:  # the standard variable, as a collector's sidecar or operator sets it
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            cfg = TracingConfig(enabled=True)
        else:
            monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
            cfg = TracingConfig(enabled=True, otlp_endpoint=endpoint)
        tracing = start_tracing(cfg, service="trainer", run_id="r7")
        assert tracing is not None
        with span(tracing.tracer("test"), "trainer.step", {"arlo.version": 3}):
            pass
        tracing.shutdown()
    finally:
        server.stop(None)
    assert not list(tmp_path.iterdir())  # no directory configured: no file
    (resource_spans,) = [rs for r in collector.requests for rs in r.resource_spans]
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert (resource["service.name"], resource["service.namespace"]) == ("trainer", "r7")
    (sent,) = [s for ss in resource_spans.scope_spans for s in ss.spans]
    assert sent.name == "trainer.step" and sent.attributes[0].value.int_value == 3


def test_probes_and_status_polls_are_not_traced() -> None:
    from types import SimpleNamespace

    from arlo.tracing.setup import _traced_rpcs

    traced = _traced_rpcs()
    assert traced(SimpleNamespace(method="/arlo.v1.Reward/Score", invocation_metadata=()))
    for method in ("/arlo.v1.Trainer/GetStatus", "/grpc.health.v1.Health/Check",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert not traced(SimpleNamespace(method=method, invocation_metadata=())), method
