"""docs/environments.md's examples run: the built-in example env in process and through a real
gateway, and the remote config block loads. (The remote example server is run, as a subprocess
behind a gateway, by test_remote_env.py.)"""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from arlo.config import AuthConfig, EnvGatewayConfig, RunConfig, ServerConfig, load_config
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.__main__ import build_gateway, start_env_gateway
from services.env_gateway.registry import EnvSpec
from services.env_gateway.server import EnvironmentServicer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "environments.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w+\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert match, f"docs/environments.md has no example {name!r}"
    return match.group(1)


@pytest.fixture
def doc_module() -> Iterator[types.ModuleType]:
    # A real module in sys.modules: dataclasses resolve their annotations through it.
    module = types.ModuleType("docs_letter_count")
    sys.modules[module.__name__] = module
    try:
        exec(compile(example("letter_count"), str(DOC), "exec"), module.__dict__)  # noqa: S102
        yield module
    finally:
        del sys.modules[module.__name__]


def test_episode_example_runs_in_process(doc_module: types.ModuleType) -> None:
    exec(compile(example("letter_count_episode"), str(DOC), "exec"), dict(doc_module.__dict__))  # noqa: S102


async def test_example_env_through_a_real_gateway(doc_module: types.ModuleType) -> None:
    spec: EnvSpec = doc_module.SPEC
    cfg = RunConfig(auth=AuthConfig(disabled=True),
                    env_gateway=EnvGatewayConfig(server=ServerConfig(port=0, metrics_port=-1)))
    gateway = build_gateway(cfg)
    gateway.registry.register(spec)  # beside the built-ins, as builtin_specs() would add it
    running = await start_env_gateway(cfg, EnvironmentServicer(gateway))
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=None) as channel:
            stub = env_pb2_grpc.EnvironmentStub(channel)
            listed = {i.name: i for i in (await stub.ListEnvironments(env_pb2.ListEnvironmentsRequest())).environments}
            assert listed["letter_count"].description.endswith("Config: max_turns (int, default 3).")
            assert json.loads(listed["letter_count"].tools_json)[0]["function"]["name"] == "count"
            started = await stub.Reset(env_pb2.ResetRequest(env_name="letter_count", seed=3), timeout=5)
            bad = await stub.Step(env_pb2.StepRequest(session_id=started.session_id, action=(
                '<tool_call>{"name": "count", "arguments": {"text": "abc", "letter": "bc"}}</tool_call>')), timeout=5)
            assert bad.observation[0].role == "tool" and "has 2 characters; at most 1 allowed" in bad.observation[0].content
            wrong = await stub.Step(env_pb2.StepRequest(session_id=started.session_id, action="999"), timeout=5)
            assert wrong.done and wrong.reward == 0.0 and wrong.answer == "999" and wrong.reference.isdigit()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Reset(env_pb2.ResetRequest(env_name="letter_count", config_json='{"max_turns": 0}'))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "letter_count config: max_turns must be in [1, 10], got 0" in (e.value.details() or "")
    finally:
        await running.stop(None)


def test_remote_config_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(example("remote-config"))
    (remote,) = load_config(path).env_gateway.remotes
    assert remote.address == "127.0.0.1:50070" and remote.env_names == ("word_reverse",)
    assert remote.token_env == "REMOTE_ENV_TOKEN" and remote.breaker_failures == 5


def test_the_remote_example_and_its_readme_exist() -> None:
    readme = (ROOT / "examples" / "remote_env" / "README.md").read_text()
    assert "python examples/remote_env/server.py --port 50070" in readme
    assert (ROOT / "examples" / "remote_env" / "server.py").is_file()
