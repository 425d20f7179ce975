"""env_gateway on an ephemeral port: the Environment contract and every bad-input class."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from arlo.config import AuthConfig, EnvGatewayConfig, RunConfig, ServerConfig
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import RunningServer, make_channel
from services.env_gateway.__main__ import start_env_gateway

TOKEN = "env-token"
TOKEN_ENV = "ARLO_TEST_ENV_TOKEN"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def config(**gateway: object) -> RunConfig:
    return RunConfig(auth=AuthConfig(token_env=TOKEN_ENV),
                     env_gateway=EnvGatewayConfig(server=ServerConfig(port=0, metrics_port=-1), **gateway))


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


async def serve(cfg: RunConfig) -> AsyncIterator[env_pb2_grpc.EnvironmentStub]:
    running: RunningServer = await start_env_gateway(cfg)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield env_pb2_grpc.EnvironmentStub(channel)
    finally:
        await running.stop(None)


@pytest.fixture
async def stub(token: str) -> AsyncIterator[env_pb2_grpc.EnvironmentStub]:
    async for s in serve(config()):
        yield s


async def fails(call: object, code: grpc.StatusCode, fragment: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call  # type: ignore[misc]
    assert e.value.code() == code, e.value.details()
    details = e.value.details() or ""
    assert fragment in details
    return details


def answer_of(prompt: str) -> int:
    a, b = prompt.removesuffix("=").split("+")
    return int(a) + int(b)


async def reset(stub: env_pb2_grpc.EnvironmentStub, seed: int = 0, config_json: str = "") -> env_pb2.ResetResponse:
    return await stub.Reset(env_pb2.ResetRequest(env_name="arith", seed=seed, config_json=config_json), timeout=5)


async def test_list_environments(stub: env_pb2_grpc.EnvironmentStub) -> None:
    reply = await stub.ListEnvironments(env_pb2.ListEnvironmentsRequest(), timeout=5)
    infos = {info.name: info for info in reply.environments}
    assert sorted(infos) == ["arith", "calculator", "dataset", "guess_number", "long_doc", "python", "retrieval"]
    info = infos["arith"]
    assert info.tools_json == "[]" and info.max_turns == 16 and info.description


async def test_episode_wrong_then_right(stub: env_pb2_grpc.EnvironmentStub) -> None:
    started = await reset(stub, seed=5)
    assert started.session_id and started.tools_json == "[]"
    (message,) = started.observation
    assert message.role == "user" and message.content.endswith("=")
    assert started.task_id == f"arith-{message.content[:-1]}"
    result = answer_of(message.content)
    wrong = await stub.Step(env_pb2.StepRequest(session_id=started.session_id, action=str(result + 1)), timeout=5)
    assert not wrong.done and [m.content for m in wrong.observation] == ["no"]
    right = await stub.Step(env_pb2.StepRequest(session_id=started.session_id, action=f"{result}\n"), timeout=5)
    assert right.done and right.reward == 1.0
    assert right.answer == str(result) and right.reference == str(result)
    assert json.loads(right.info_json) == {"turns": 2, "correct": True}
    await fails(stub.Step(env_pb2.StepRequest(session_id=started.session_id, action="1"), timeout=5),
                grpc.StatusCode.FAILED_PRECONDITION, "Reset")
    await stub.Close(env_pb2.CloseRequest(session_id=started.session_id), timeout=5)
    await fails(stub.Step(env_pb2.StepRequest(session_id=started.session_id, action="1"), timeout=5),
                grpc.StatusCode.NOT_FOUND)


async def test_same_seed_same_task_and_full_uint64_seed(stub: env_pb2_grpc.EnvironmentStub) -> None:
    assert (await reset(stub, seed=2**64 - 1)).task_id == (await reset(stub, seed=2**64 - 1)).task_id
    operands = await reset(stub, seed=3, config_json='{"max_operand": 1000, "max_turns": 1}')
    assert max(int(x) for x in operands.observation[0].content[:-1].split("+")) <= 1000


@pytest.mark.parametrize(("request_", "code", "fragment"), [
    (env_pb2.ResetRequest(), INVALID, "env_name is required"),
    (env_pb2.ResetRequest(env_name="chess"), grpc.StatusCode.NOT_FOUND, "arith"),
    (env_pb2.ResetRequest(env_name="a" * 129), INVALID, "env_name"),
    (env_pb2.ResetRequest(env_name="arith", config_json=" " * (64 * 1024 + 1)), INVALID, "config_json"),
    (env_pb2.ResetRequest(env_name="arith", config_json="{"), INVALID, "not valid JSON"),
    (env_pb2.ResetRequest(env_name="arith", config_json="[]"), INVALID, "JSON object"),
    (env_pb2.ResetRequest(env_name="arith", config_json='{"colour": 1}'), INVALID, "colour"),
    (env_pb2.ResetRequest(env_name="arith", config_json='{"max_turns": "3"}'), INVALID, "max_turns"),
    (env_pb2.ResetRequest(env_name="arith", config_json='{"a": ' + "[" * 20000 + "]" * 20000 + "}"), INVALID,
     "config_json is not valid JSON: nesting deeper"),
], ids=["no-name", "unknown", "long-name", "big-config", "bad-json", "not-object", "unknown-key", "bad-type",
        "deep-config"])
async def test_reset_bad_inputs(stub: env_pb2_grpc.EnvironmentStub, request_: env_pb2.ResetRequest,
                                code: grpc.StatusCode, fragment: str) -> None:
    await fails(stub.Reset(request_, timeout=5), code, fragment)


async def test_step_bad_inputs(stub: env_pb2_grpc.EnvironmentStub) -> None:
    session = (await reset(stub)).session_id
    await fails(stub.Step(env_pb2.StepRequest(action="1"), timeout=5), INVALID, "session_id is required")
    await fails(stub.Step(env_pb2.StepRequest(session_id="f" * 32, action="1"), timeout=5), grpc.StatusCode.NOT_FOUND)
    await fails(stub.Step(env_pb2.StepRequest(session_id="f" * 129, action="1"), timeout=5), INVALID, "session_id")
    await fails(stub.Step(env_pb2.StepRequest(session_id=session, action="é" * (32 * 1024 + 1)), timeout=5),
                INVALID, "action is 65538 bytes")
    # Rejected requests do not use up the session's turns.
    ok = await stub.Step(env_pb2.StepRequest(session_id=session, action="x"), timeout=5)
    assert json.loads(ok.info_json)["turns"] == 1


async def test_close_unknown_session_is_fine(stub: env_pb2_grpc.EnvironmentStub) -> None:
    await stub.Close(env_pb2.CloseRequest(session_id="never-existed"), timeout=5)


async def test_step_batch(stub: env_pb2_grpc.EnvironmentStub) -> None:
    sessions = [await reset(stub, seed=i) for i in range(3)]
    steps = [env_pb2.StepRequest(session_id=s.session_id, action=str(answer_of(s.observation[0].content)))
             for s in sessions[:2]]
    steps += [env_pb2.StepRequest(session_id="gone", action="1"),
              env_pb2.StepRequest(session_id=sessions[2].session_id, action="x" * (64 * 1024 + 1)),
              env_pb2.StepRequest(action="1")]
    reply = await stub.StepBatch(env_pb2.StepBatchRequest(steps=steps), timeout=5)
    codes = [r.code for r in reply.results]
    assert codes == [0, 0, grpc.StatusCode.NOT_FOUND.value[0], INVALID.value[0], INVALID.value[0]]
    assert all(r.response.done and r.response.reward == 1.0 for r in reply.results[:2])
    assert "steps[3].action" in reply.results[3].message and "steps[4].session_id" in reply.results[4].message
    again = await stub.StepBatch(env_pb2.StepBatchRequest(steps=steps[:1]), timeout=5)
    assert again.results[0].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]


async def test_step_batch_bounds(stub: env_pb2_grpc.EnvironmentStub) -> None:
    await fails(stub.StepBatch(env_pb2.StepBatchRequest(), timeout=5), INVALID, "1 to 256")
    too_many = [env_pb2.StepRequest(session_id=str(i), action="1") for i in range(257)]
    await fails(stub.StepBatch(env_pb2.StepBatchRequest(steps=too_many), timeout=5), INVALID, "257")
    session = (await reset(stub)).session_id
    twice = [env_pb2.StepRequest(session_id=session, action="1")] * 2
    await fails(stub.StepBatch(env_pb2.StepBatchRequest(steps=twice), timeout=5), INVALID, "steps[1] repeats")
    started = await asyncio.gather(*(reset(stub, seed=i) for i in range(256)))
    full = [env_pb2.StepRequest(session_id=s.session_id, action="x") for s in started]
    reply = await stub.StepBatch(env_pb2.StepBatchRequest(steps=full), timeout=10)
    assert len(reply.results) == 256 and all(r.code == 0 for r in reply.results)


async def test_close_batch_closes_each_session_and_answers_each_id(stub: env_pb2_grpc.EnvironmentStub) -> None:
    sessions = [(await reset(stub, seed=i)).session_id for i in range(3)]
    kept = (await reset(stub, seed=9)).session_id
    # Unknown and repeated ids are no error (as for Close); an id past the bound is refused alone.
    ids = [*sessions, "never-existed", sessions[0], "s" * 129]
    reply = await stub.CloseBatch(env_pb2.CloseBatchRequest(session_ids=ids), timeout=5)
    assert [r.code for r in reply.results] == [0, 0, 0, 0, 0, INVALID.value[0]]
    assert "session_ids[5]" in reply.results[5].message
    for session in sessions:
        await fails(stub.Step(env_pb2.StepRequest(session_id=session, action="1"), timeout=5), grpc.StatusCode.NOT_FOUND)
    await stub.Step(env_pb2.StepRequest(session_id=kept, action="x"), timeout=5)  # a session not named lives on
    await fails(stub.CloseBatch(env_pb2.CloseBatchRequest(), timeout=5), INVALID, "1 to 256")
    too_many = [str(i) for i in range(257)]
    await fails(stub.CloseBatch(env_pb2.CloseBatchRequest(session_ids=too_many), timeout=5), INVALID, "257")


async def test_session_limit_and_idle_expiry(token: str) -> None:
    # 1.5 s: the three calls before the sleep must land inside it on a loaded machine too.
    async for stub in serve(config(max_sessions=2, session_idle_timeout_s=1.5)):
        first = await reset(stub, seed=1)
        await reset(stub, seed=2)
        await fails(reset(stub, seed=3), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_sessions")
        await asyncio.sleep(1.8)
        await fails(stub.Step(env_pb2.StepRequest(session_id=first.session_id, action="1"), timeout=5),
                    grpc.StatusCode.NOT_FOUND, "expired")
        await reset(stub, seed=4)  # expired sessions freed their slots
        await reset(stub, seed=5)
