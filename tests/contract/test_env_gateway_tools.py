"""The tool environments through a real env_gateway on an ephemeral port: tool schemas, episodes,
code execution off the event loop, and StepBatch mixing cheap and blocking environments."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from arlo.config import AuthConfig, EnvGatewayConfig, RunConfig, SandboxConfig, ServerConfig
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.__main__ import start_env_gateway

Stub = env_pb2_grpc.EnvironmentStub


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    cfg = RunConfig(auth=AuthConfig(disabled=True), env_gateway=EnvGatewayConfig(
        server=ServerConfig(port=0, metrics_port=-1), sandbox=SandboxConfig(wall_timeout_s=5.0)))
    running = await start_env_gateway(cfg)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=None) as channel:
            yield Stub(channel)
    finally:
        await running.stop(None)


async def reset(stub: Stub, env: str, seed: int = 0, config: dict | None = None) -> env_pb2.ResetResponse:
    return await stub.Reset(env_pb2.ResetRequest(env_name=env, seed=seed, config_json=json.dumps(config or {})),
                            timeout=10)


async def step(stub: Stub, session: str, action: str) -> env_pb2.StepResponse:
    return await stub.Step(env_pb2.StepRequest(session_id=session, action=action), timeout=10)


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def test_tool_schemas_in_list_and_reset_agree(stub: Stub) -> None:
    listed = {i.name: i for i in (await stub.ListEnvironments(env_pb2.ListEnvironmentsRequest(), timeout=5)).environments}
    for name in ("calculator", "guess_number", "python", "retrieval"):
        tools = json.loads(listed[name].tools_json)
        assert tools and all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object"
                             for t in tools)
        assert (await reset(stub, name)).tools_json == listed[name].tools_json
        assert listed[name].max_turns >= 6 and "Config:" in listed[name].description


async def test_calculator_episode(stub: Stub) -> None:
    started = await reset(stub, "calculator", seed=7)
    expression = started.observation[0].content.removeprefix("Compute ").split(".")[0]
    tool = await step(stub, started.session_id, call("calculator", expression=expression))
    (reply,) = tool.observation
    assert reply.role == "tool" and reply.name == "calculator" and reply.content.lstrip("-").isdigit()
    done = await step(stub, started.session_id, f"So the answer is {reply.content}.")
    assert done.done and done.reward == 1.0 and done.answer == done.reference == reply.content


async def test_guess_number_with_step_batch(stub: Stub) -> None:
    sessions = [(await reset(stub, "guess_number", seed=s)).session_id for s in range(16)]
    bounds = {s: (1, 100) for s in sessions}
    rewards: dict[str, float] = {}
    for _ in range(7):
        live = [s for s in sessions if s not in rewards]
        guesses = {s: sum(bounds[s]) // 2 for s in live}
        reply = await stub.StepBatch(env_pb2.StepBatchRequest(steps=[
            env_pb2.StepRequest(session_id=s, action=str(guesses[s])) for s in live]), timeout=10)
        for s, result in zip(live, reply.results, strict=True):
            assert result.code == 0, result.message
            if result.response.done:
                rewards[s] = result.response.reward
            else:
                low, high = bounds[s]
                g = guesses[s]
                bounds[s] = (g + 1, high) if result.response.observation[0].content == "higher" else (low, g - 1)
    assert rewards == {s: 1.0 for s in sessions}


async def test_retrieval_episode(stub: Stub) -> None:
    started = await reset(stub, "retrieval", seed=1)
    question = started.observation[0].content.splitlines()[0].removeprefix("Question: ")
    found = await step(stub, started.session_id, call("search", query=question))
    assert found.observation[0].name == "search" and "[1] " in found.observation[0].content
    wrong = await step(stub, started.session_id, call("answer", text="no idea"))
    assert wrong.done and wrong.reward == 0.0 and wrong.answer == "no idea" and wrong.reference


async def test_malformed_tool_call_is_an_observation_not_an_error(stub: Stub) -> None:
    started = await reset(stub, "calculator")
    reply = await step(stub, started.session_id, '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}')
    assert not reply.done and reply.observation[0].role == "tool"
    assert "calculator arguments.expression must be string, got integer 5" in reply.observation[0].content


async def test_code_runs_off_the_event_loop(stub: Stub) -> None:
    slow = await reset(stub, "python")
    cheap = await reset(stub, "arith")
    running = asyncio.ensure_future(step(stub, slow.session_id, "```python\nimport time\ntime.sleep(1.5)\nprint(7)\n```"))
    await asyncio.sleep(0.2)
    await step(stub, cheap.session_id, "x")
    assert not running.done()  # answered while the 1.5 s program still runs
    await fails(step(stub, slow.session_id, "42"), grpc.StatusCode.ABORTED, "one step at a time")
    result = await running
    assert "status: ok" in result.observation[0].content and "--- stdout ---\n7" in result.observation[0].content


async def test_step_batch_mixes_cheap_and_blocking_sessions(stub: Stub) -> None:
    programs = [await reset(stub, "python", seed=i) for i in range(3)]
    sums = [await reset(stub, "arith", seed=i) for i in range(3)]
    steps = [env_pb2.StepRequest(session_id=p.session_id, action=f"```python\nprint({i} * 6)\n```")
             for i, p in enumerate(programs)]
    steps += [env_pb2.StepRequest(session_id=s.session_id, action="x") for s in sums]
    steps.append(env_pb2.StepRequest(session_id="0" * 32, action="x"))
    started = time.monotonic()
    reply = await stub.StepBatch(env_pb2.StepBatchRequest(steps=steps), timeout=20)
    assert [r.code for r in reply.results] == [0] * 6 + [grpc.StatusCode.NOT_FOUND.value[0]]
    for i, result in enumerate(reply.results[:3]):
        assert f"--- stdout ---\n{i * 6}\n" in result.response.observation[0].content
    assert [r.response.observation[0].content for r in reply.results[3:6]] == ["answer with a number"] * 3
    assert time.monotonic() - started < 5


async def test_bad_inputs_to_the_new_environments(stub: Stub) -> None:
    await fails(reset(stub, "python", config={"max_turns": 0}), grpc.StatusCode.INVALID_ARGUMENT,
                "python config: max_turns must be in [1, 32]")
    await fails(reset(stub, "retrieval", config={"top_k": "3"}), grpc.StatusCode.INVALID_ARGUMENT,
                "retrieval config: top_k must be int")
    await fails(reset(stub, "sudoku"), grpc.StatusCode.NOT_FOUND,
                "known: ['arith', 'calculator', 'dataset', 'guess_number', 'long_doc', 'python', 'retrieval']")
    session = (await reset(stub, "python")).session_id
    await fails(step(stub, session, "x" * (64 * 1024 + 1)), grpc.StatusCode.INVALID_ARGUMENT, "action is 65537 bytes")
    assert not (await step(stub, session, "no code here")).done  # the rejected step used no turn


async def fails(call: object, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call  # type: ignore[misc]
    assert e.value.code() == code, e.value.details()
    assert fragment in (e.value.details() or "")
