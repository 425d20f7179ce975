"""Property-based bad input on every RPC of every service, plus garbage in Redis.

All four servers run in process on ephemeral ports against the real Redis (tests/support/
stack.py); hypothesis sends well-typed adversarial messages and raw bytes no client would
send. Every call must end with a clear status (never UNKNOWN, never INTERNAL: both mean an
unhandled error), and every server must still be healthy and answer a good request after.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arlo.config import load_config
from arlo.proto.v1 import (
    common_pb2,
    env_pb2,
    env_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
)
from tests.support.protofuzz import messages, raw_requests
from tests.support.stack import Stack

TOKEN = "fuzz-token"
TOKEN_ENV = "ARLO_FUZZ_TOKEN"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MAX_MESSAGE = 2 << 20
SERVICES = {"inference": "arlo.v1.Inference", "trainer": "arlo.v1.Trainer",
            "env_gateway": "arlo.v1.Environment", "reward": "arlo.v1.Reward"}
# What a well-behaved server may answer to bad input. UNKNOWN and INTERNAL mean an unhandled
# exception; UNAVAILABLE or DEADLINE_EXCEEDED from an in-process server mean it broke or hung.
CLEAR = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(redis_url: str) -> Iterator[Stack]:
    os.environ[TOKEN_ENV] = TOKEN  # a variable of its own: other tests never see it
    server = {"port": 0, "metrics_port": -1, "grace_s": 0.2, "max_message_bytes": MAX_MESSAGE}
    cfg = load_config(overrides={
        "run_id": f"fuzz-{uuid.uuid4().hex[:8]}", "redis": {"url": redis_url}, "auth": {"token_env": TOKEN_ENV},
        # No start-up warm-up: fuzzing needs the servers, not every program compiled ahead.
        "inference": {"server": server, "max_n": 4, "max_tokens": 8, "max_prompt_tokens": 64, "max_batch": 8,
                      "weight_poll_s": 0.2, "warmup_programs": 0},
        "trainer": {"server": server, "groups_per_step": 1, "read_block_ms": 100, "max_staleness": 1000},
        "env_gateway": {"server": server}, "reward": {"server": server}})
    s = Stack(cfg)
    s.start()
    try:
        yield s
    finally:
        s.stop()
        from arlo.coord import connect, delete_run

        async def wipe() -> None:
            redis = await connect(cfg.redis)
            await delete_run(redis, cfg.run_id)
            await redis.aclose()

        asyncio.run(wipe())


@pytest.fixture(scope="module")
def channels(stack: Stack) -> Iterator[dict[str, grpc.Channel]]:
    chans = {name: grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 8 << 20),
                                                         ("grpc.max_receive_message_length", 8 << 20)])
             for name, addr in stack.addresses.items()}
    yield chans
    for ch in chans.values():
        ch.close()


def methods(service: str) -> list[MethodDescriptor]:
    return list(descriptor_pool.Default().FindServiceByName(SERVICES[service]).methods)


def call_raw(channel: grpc.Channel, method: MethodDescriptor, payload: bytes) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    ident = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if method.server_streaming:
            call = channel.unary_stream(path, **ident)(payload, timeout=20, metadata=AUTH)
            for i, _ in enumerate(call):
                if i >= 64:  # a long weight stream: reading this much proves it streams
                    call.cancel()
                    return grpc.StatusCode.OK
        else:
            channel.unary_unary(path, **ident)(payload, timeout=20, metadata=AUTH)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and method.server_streaming:
            return grpc.StatusCode.OK
        return e.code()
    return grpc.StatusCode.OK


def assert_clear(code: grpc.StatusCode, method: MethodDescriptor, what: object) -> None:
    assert code in CLEAR, f"{method.full_name} answered {code.name} to {str(what)[:300]!r}"


def assert_healthy(stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    for name, ch in channels.items():
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    ok = reward_pb2_grpc.RewardStub(channels["reward"]).Score(
        reward_pb2.ScoreRequest(reward_fn="exact_match", response="1", reference="1"), timeout=10, metadata=AUTH)
    assert ok.status == reward_pb2.SCORE_STATUS_OK
    env = env_pb2_grpc.EnvironmentStub(channels["env_gateway"])
    session = env.Reset(env_pb2.ResetRequest(env_name="arith", seed=1), timeout=10, metadata=AUTH).session_id
    env.Step(env_pb2.StepRequest(session_id=session, action="3"), timeout=10, metadata=AUTH)
    env.Close(env_pb2.CloseRequest(session_id=session), timeout=10, metadata=AUTH)
    gen = inference_pb2_grpc.InferenceStub(channels["inference"]).Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=[257, 49], n=2, sampling=common_pb2.SamplingParams(max_tokens=3, temperature=1.0)),
        timeout=30, metadata=AUTH)
    assert len(gen.completions) == 2


@pytest.mark.parametrize("service", list(SERVICES))
def test_adversarial_messages_get_clear_statuses(service: str, stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    ms = methods(service)

    @FUZZ
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(ms), label="method")
        request = data.draw(messages(method.input_type), label="request")
        code = call_raw(channels[service], method, request.SerializeToString())
        assert_clear(code, method, request)

    check()
    assert_healthy(stack, channels)


@pytest.mark.parametrize("service", list(SERVICES))
def test_raw_bytes_get_clear_statuses(service: str, stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    ms = methods(service)

    @FUZZ
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(ms), label="method")
        payload = data.draw(raw_requests(method.input_type), label="payload")
        assert_clear(call_raw(channels[service], method, payload), method, payload)

    check()
    assert_healthy(stack, channels)


def test_wrong_session_ids_are_not_found(stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    env = env_pb2_grpc.EnvironmentStub(channels["env_gateway"])

    @FUZZ
    @given(session=st.one_of(st.text(min_size=1, max_size=32), st.sampled_from(["r0:abc", "r99:x", uuid.uuid4().hex])))
    def check(session: str) -> None:
        with pytest.raises(grpc.RpcError) as e:
            env.Step(env_pb2.StepRequest(session_id=session, action="1"), timeout=10, metadata=AUTH)
        assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), e.value.details()
        batch = env.StepBatch(env_pb2.StepBatchRequest(steps=[env_pb2.StepRequest(session_id=session, action="1")]),
                              timeout=10, metadata=AUTH)
        assert batch.results[0].code in (grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0])

    check()
    assert_healthy(stack, channels)


def test_truncated_streams_free_their_slots(stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    """Clients that walk away from a token stream (after 0 or 1 messages) leave nothing running."""
    stub = inference_pb2_grpc.InferenceStub(channels["inference"])
    request = inference_pb2.GenerateStreamRequest(request=inference_pb2.GenerateRequest(
        prompt_token_ids=[257, 49, 50], n=1, sampling=common_pb2.SamplingParams(max_tokens=8, temperature=1.0)))
    for i in range(12):
        call = stub.GenerateStream(request, timeout=20, metadata=AUTH)
        if i % 2:
            next(call)
        call.cancel()
    engine = stack.objects["engine"]
    deadline = time.monotonic() + 60
    while engine.metrics()["running"] or engine.metrics()["waiting"]:
        assert time.monotonic() < deadline, engine.metrics()
        time.sleep(0.05)
    assert_healthy(stack, channels)


# -- garbage in Redis -----------------------------------------------------------------------

GARBAGE_FIELDS = st.one_of(
    st.dictionaries(st.binary(min_size=1, max_size=12), st.binary(max_size=64), min_size=1, max_size=3),
    st.tuples(st.binary(max_size=40), st.binary(max_size=200)).map(lambda ip: {b"id": ip[0], b"pb": ip[1]}),
    # Well-formed protobuf whose content is not a usable trajectory (lengths, groups, versions).
    messages(common_pb2.Trajectory.DESCRIPTOR, huge=False).map(
        lambda m: {b"id": m.id.encode(), b"pb": m.SerializeToString()}),
)


def test_garbage_stream_entries_are_dead_lettered_and_the_trainer_keeps_training(
        stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    from arlo.coord import TrajectoryStream, connect
    from arlo.coord.codec import encode

    loop = stack.objects["loop"]
    keys_traj = f"arlo:{stack.cfg.run_id}:traj"
    entries: list[dict[bytes, bytes]] = []

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(fields=GARBAGE_FIELDS)
    def collect(fields: dict[bytes, bytes]) -> None:
        entries.append(fields)

    collect()
    good = [common_pb2.Trajectory(id=uuid.uuid4().hex, group_id=f"g{uuid.uuid4().hex}", group_size=1,
                                  token_ids=[257, 49, 50], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1],
                                  policy_versions=[-1, 0, 0], reward=1.0, status=common_pb2.TRAJECTORY_STATUS_OK)
            for _ in range(3)]

    async def feed() -> tuple[int, int]:
        redis = await connect(stack.cfg.redis)
        try:
            for fields in entries:
                await redis.xadd(keys_traj, fields)
            stream = TrajectoryStream(redis, stack.cfg.run_id, consumer="fuzz")
            for traj in good:
                await redis.xadd(keys_traj, encode(traj))
            return await stream.backlog(), len(entries)
        finally:
            await redis.aclose()

    before = loop.learner.step_count
    stack.call(feed)

    async def backlog() -> int:
        redis = await connect(stack.cfg.redis)
        try:
            return await TrajectoryStream(redis, stack.cfg.run_id, consumer="fuzz").backlog()
        finally:
            await redis.aclose()

    loop.state.paused = False
    loop.core.book.assembler.incomplete_timeout_s = 5.0  # garbage that claims members which never come
    deadline = time.monotonic() + 60
    while stack.call(backlog) or loop.learner.step_count - before < 1:
        assert time.monotonic() < deadline, (stack.call(backlog), loop.dropped(), list(loop.core.book.assembler.pending))
        time.sleep(0.2)
    # Every garbage entry was set aside or dropped with a reason, never left pending.
    assert loop.learner.step_count - before >= 1
    assert sum(loop.dropped().values()) >= 1
    assert_healthy(stack, channels)


def test_a_garbage_or_dangling_weight_pointer_never_takes_inference_down(
        stack: Stack, channels: dict[str, grpc.Channel]) -> None:
    """A pointer naming a version nobody holds and a checkpoint that does not exist, then one
    whose fields are not numbers: inference keeps serving what it has, and stays healthy."""
    from arlo.coord import connect

    engine = stack.objects["engine"]
    key = f"arlo:{stack.cfg.run_id}:weights"
    served = engine.version

    async def write(fields: dict[str, str]) -> dict:
        redis = await connect(stack.cfg.redis)
        try:
            saved = await redis.hgetall(key)
            await redis.hset(key, mapping=fields)
            await redis.publish(f"arlo:{stack.cfg.run_id}:weights:events", fields.get("version", "x"))
            return saved
        finally:
            await redis.aclose()

    async def restore(saved: dict) -> None:
        redis = await connect(stack.cfg.redis)
        try:
            await redis.delete(key)
            if saved:
                await redis.hset(key, mapping=saved)
        finally:
            await redis.aclose()

    saved = stack.call(lambda: write({
        "version": str(served + 1000), "source": stack.objects["loop"].source or "grpc://127.0.0.1:1",
        "sha256": "0" * 64, "checkpoint_version": str(served + 1000),
        "checkpoint_uri": "file:///nonexistent/arlo/ckpt/999", "time": "1"}))
    try:
        time.sleep(1.5)  # several poll periods: pulls fail (NOT_FOUND) and are retried
        assert engine.version == served
        assert_healthy(stack, channels)
        stack.call(lambda: write({"version": "not-a-number", "checkpoint_version": "[]", "time": "{}"}))
        time.sleep(1.0)
        assert engine.version == served
        assert_healthy(stack, channels)
        info = inference_pb2_grpc.InferenceStub(channels["inference"]).GetModelInfo(
            inference_pb2.GetModelInfoRequest(), timeout=5, metadata=AUTH)
        assert info.policy_version == served
    finally:
        stack.call(lambda: restore(saved))
    json.dumps(engine.metrics())  # still readable
