"""A remote environment's replies are held to the contract's bounds (issue 33, item 16): a real
in-process backend on an ephemeral port answers each poisoned reply a red team sent (an
oversized observation, 200,000 messages, non-JSON or deep tools_json, NaN/inf/huge rewards, an
oversized answer, a 1 MB session id), and the gateway refuses each as the backend's failure
(UNAVAILABLE, naming the field), never INTERNAL and never passing it on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from arlo.proto.v1 import common_pb2, env_pb2, env_pb2_grpc
from services.env_gateway.registry import default_registry
from services.env_gateway.remote import MAX_LISTED_ENVIRONMENTS
from services.env_gateway.remote_replies import MAX_CONTENT_BYTES, MAX_TEXT_BYTES
from tests.contract.test_remote_env import config, fails, reset, scripted_remote, serve, tokens  # noqa: F401
from tests.support.scripted_server import scripted_server

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
Poison = Callable[[env_pb2.ResetResponse | env_pb2.StepResponse], None]


def builtin_names() -> list[str]:
    return default_registry().names()


def good_step() -> env_pb2.StepResponse:
    return env_pb2.StepResponse(observation=[common_pb2.Message(role="user", content="ok")], reward=1.0,
                                info_json='{"turn": 1}')


class PoisonBackend(env_pb2_grpc.EnvironmentServicer):
    """Answers Reset with `reset_poison` applied, and steps of sessions starting "p" with
    `step_poison` applied (others get a good reply)."""

    def __init__(self) -> None:
        self.reset_poison: Poison | None = None
        self.step_poison: Poison | None = None
        self.listed_extra = 0
        self.closed: list[str] = []
        self.sent: list[str] = []
        self.resets = 0

    async def ListEnvironments(self, request, context):  # noqa: N802
        return env_pb2.ListEnvironmentsResponse(environments=[
            env_pb2.EnvironmentInfo(name="scripted", tools_json="[]"),
            env_pb2.EnvironmentInfo(name="deep_tools", tools_json="[" * 10_000 + "]" * 10_000),
            *(env_pb2.EnvironmentInfo(name=f"many{i}") for i in range(self.listed_extra))])

    async def Reset(self, request, context):  # noqa: N802
        self.resets += 1
        reply = env_pb2.ResetResponse(session_id=f"p{self.resets}", tools_json="[]", task_id="t",
                                      observation=[common_pb2.Message(role="user", content="hi")])
        if self.reset_poison is not None:
            self.reset_poison(reply)
        self.sent.append(reply.session_id)
        return reply

    def _step(self, session_id: str) -> env_pb2.StepResponse:
        reply = good_step()
        if session_id.startswith("p") and self.step_poison is not None:
            self.step_poison(reply)
        return reply

    async def Step(self, request, context):  # noqa: N802
        return self._step(request.session_id)

    async def StepBatch(self, request, context):  # noqa: N802
        return env_pb2.StepBatchResponse(results=[env_pb2.StepResult(response=self._step(s.session_id))
                                                  for s in request.steps])

    async def Close(self, request, context):  # noqa: N802
        self.closed.append(request.session_id)
        return env_pb2.CloseResponse()


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[PoisonBackend, env_pb2_grpc.EnvironmentStub]]:
    backend = PoisonBackend()
    async with scripted_server(env_pb2_grpc.add_EnvironmentServicer_to_server, backend) as address:
        # breaker_failures=1: a refused reply must not count as the backend being down.
        remote = scripted_remote(int(address.rsplit(":", 1)[1]), env_names=(), breaker_failures=1,
                                 breaker_reset_s=60)
        async for stub in serve(config(remote)):
            yield backend, stub


def _messages(n: int, content: str = "x", role: str = "user") -> list[common_pb2.Message]:
    return [common_pb2.Message(role=role, content=content) for _ in range(n)]


def _set(field: str, value: object) -> Poison:
    def poison(reply: env_pb2.ResetResponse | env_pb2.StepResponse) -> None:
        if field == "observation":
            del reply.observation[:]
            reply.observation.extend(value)  # type: ignore[arg-type]
        else:
            setattr(reply, field, value)
    return poison


RESET_POISONS = [
    ("observation", _messages(1, "x" * (MAX_CONTENT_BYTES + 1)), "observation[0].content is 65537 bytes"),
    ("observation", _messages(200_000), "observation has 200000 messages"),
    ("observation", _messages(1, role="robot"), "observation[0].role"),
    ("tools_json", "not json", "tools_json is not valid JSON"),
    ("tools_json", "[" * 100 + "]" * 100, "nesting deeper than 64"),
    ("tools_json", '{"name": "f"}', "tools_json must be a JSON list"),
    ("metadata_json", "[1, 2]", "metadata_json must be a JSON object"),
    ("task_id", "t" * 2000, "task_id is 2000 bytes"),
    ("session_id", "s" * (1 << 20), "session id is 1048576 bytes"),
]


@pytest.mark.parametrize(("field", "value", "fragment"), RESET_POISONS, ids=lambda v: str(v)[:24])
async def test_a_reset_reply_outside_the_contract_is_refused_and_its_session_closed(
        gateway: tuple[PoisonBackend, env_pb2_grpc.EnvironmentStub], field: str, value: object,
        fragment: str) -> None:
    backend, stub = gateway
    backend.reset_poison = _set(field, value)
    details = await fails(reset(stub, "scripted"), UNAVAILABLE, fragment)
    assert "outside the Environment contract" in details and len(details) < 1000
    backend.reset_poison = None
    started = await reset(stub, "scripted")  # the breaker stayed closed: the backend answers
    assert started.session_id.startswith("r0:p")
    for _ in range(100):  # the orphan is closed in the background
        if backend.closed:
            break
        await asyncio.sleep(0.02)
    assert backend.closed == [backend.sent[0]]  # the episode the refused reply started was ended


STEP_POISONS = [
    ("reward", float("nan"), "reward is nan"), ("reward", float("inf"), "reward is inf"),
    ("reward", -1e30, "reward is -1e+30"),
    ("answer", "a" * (MAX_TEXT_BYTES + 1), "answer is 1048577 bytes"),
    ("reference", "r" * (MAX_TEXT_BYTES + 1), "reference is 1048577 bytes"),
    ("info_json", "nope", "info_json is not valid JSON"),
    ("observation", _messages(100_000), "observation has 100000 messages"),
    ("observation", _messages(20, "y" * 60_000), "observation's contents are 1200000 bytes"),
]


@pytest.mark.parametrize(("field", "value", "fragment"), STEP_POISONS, ids=lambda v: str(v)[:24])
async def test_a_step_reply_outside_the_contract_is_refused_in_step_and_step_batch(
        gateway: tuple[PoisonBackend, env_pb2_grpc.EnvironmentStub], field: str, value: object,
        fragment: str) -> None:
    backend, stub = gateway
    session = (await reset(stub, "scripted")).session_id
    backend.step_poison = _set(field, value)
    await fails(stub.Step(env_pb2.StepRequest(session_id=session, action="x"), timeout=10), UNAVAILABLE, fragment)
    # In a batch the poisoned step fails alone: a healthy session of the same backend is answered.
    batch = await stub.StepBatch(env_pb2.StepBatchRequest(steps=[
        env_pb2.StepRequest(session_id=session, action="x"), env_pb2.StepRequest(session_id="r0:q1", action="x")]),
        timeout=10)
    bad, ok = batch.results
    assert bad.code == UNAVAILABLE.value[0] and fragment in bad.message and not bad.HasField("response")
    assert ok.code == 0 and ok.response == good_step()


async def test_a_listed_environment_outside_the_contract_is_left_out(
        gateway: tuple[PoisonBackend, env_pb2_grpc.EnvironmentStub]) -> None:
    backend, stub = gateway
    backend.listed_extra = 100_000
    listed = [i.name for i in (await stub.ListEnvironments(env_pb2.ListEnvironmentsRequest(), timeout=10)).environments]
    assert "scripted" in listed and "deep_tools" not in listed
    assert len(listed) == MAX_LISTED_ENVIRONMENTS - 1 + len(builtin_names())  # of 100,002 listed
    await fails(reset(stub, "deep_tools"), grpc.StatusCode.NOT_FOUND, "unknown environment")
