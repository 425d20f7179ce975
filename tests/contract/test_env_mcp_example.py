"""examples/mcp_env: the gateway started from its YAML runs the example MCP server over stdio and
serves an episode through gRPC; docs/mcp.md shows both files verbatim."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed (pip install -e .[mcp])")

from arlo.config import load_config  # noqa: E402
from arlo.proto.v1 import env_pb2, env_pb2_grpc  # noqa: E402
from arlo.rpc import make_channel  # noqa: E402
from services.env_gateway.__main__ import build_servicer, start_env_gateway  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mcp_env"
TOKEN, TOKEN_ENV = "mcp-example-token", "ARLO_TEST_MCP_EXAMPLE_TOKEN"


def test_docs_show_the_example_verbatim() -> None:
    doc = (ROOT / "docs" / "mcp.md").read_text()
    for marker, lang, path in (("mcp-server", "python", "tools_server.py"), ("mcp-config", "yaml", "gateway.yaml")):
        block = re.search(rf"<!-- example: {marker} -->\n```{lang}\n(.*?)```", doc, re.DOTALL)
        assert block and block.group(1) == (EXAMPLE / path).read_text(), path


async def test_example_episode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.chdir(ROOT)  # as the docs say: run from the repository root
    cfg = load_config(EXAMPLE / "gateway.yaml", {"auth": {"token_env": TOKEN_ENV},
                                                 "env_gateway": {"server": {"port": 0, "metrics_port": -1}}})
    (server,) = cfg.env_gateway.mcp_servers
    assert server.command[0] == "python"  # this interpreter stands in for whatever `python` is on PATH
    gw = dataclasses.replace(cfg.env_gateway, mcp_servers=(dataclasses.replace(
        server, command=(sys.executable, *server.command[1:])),))
    cfg = dataclasses.replace(cfg, env_gateway=gw)
    servicer = await build_servicer(cfg)
    running = await start_env_gateway(cfg, servicer)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            stub = env_pb2_grpc.EnvironmentStub(channel)
            started = await stub.Reset(env_pb2.ResetRequest(env_name=cfg.rollout.env_name,
                                                            config_json=cfg.rollout.env_config_json), timeout=30)
            assert {t["function"]["name"] for t in json.loads(started.tools_json)} == {"convert", "multiply"}
            call = {"name": "convert", "arguments": {"value": 3.5, "from_unit": "km", "to_unit": "ft"}}
            converted = await stub.Step(env_pb2.StepRequest(session_id=started.session_id,
                                                            action=f"<tool_call>{json.dumps(call)}</tool_call>"), timeout=30)
            feet = converted.observation[0].content
            assert converted.observation[0].name == "convert" and abs(float(feet) - 3500 / 0.3048) < 1e-3
            final = await stub.Step(env_pb2.StepRequest(session_id=started.session_id, action=f"{feet}"), timeout=30)
            assert final.done and final.answer == feet and final.reference == "11482.94"
    finally:
        await running.stop(None)
        await servicer.aclose()
