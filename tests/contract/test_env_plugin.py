"""Environment plugins: examples/env_plugin served by a real gateway started from its YAML, an
episode through gRPC; docs/environments.md shows the example file verbatim; broken plugins
stop the gateway at start-up with one line naming the plugin."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from arlo.config import ConfigError, EnvPluginConfig, load_config
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.__main__ import build_gateway, start_env_gateway
from services.env_gateway.plugins import load_env_plugin
from services.env_gateway.spec import EnvContext

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "env_plugin"
TOKEN, TOKEN_ENV = "plugin-env-token", "ARLO_TEST_ENV_PLUGIN_TOKEN"


@pytest.fixture
async def stub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[env_pb2_grpc.EnvironmentStub]:
    monkeypatch.syspath_prepend(str(ROOT))  # as `python -m services.env_gateway` from the repository root
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = load_config(EXAMPLE / "gateway.yaml", {"auth": {"token_env": TOKEN_ENV},
                                                 "env_gateway": {"server": {"port": 0, "metrics_port": -1}}})
    running = await start_env_gateway(cfg)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield env_pb2_grpc.EnvironmentStub(channel)
    finally:
        await running.stop(None)


def test_docs_show_the_example_verbatim() -> None:
    doc = (ROOT / "docs" / "environments.md").read_text()
    block = re.search(r"<!-- example: letter_count -->\n```python\n(.*?)```", doc, re.DOTALL)
    assert block and block.group(1) == (EXAMPLE / "letter_count.py").read_text()
    config = re.search(r"<!-- example: plugin-config -->\n```yaml\n(.*?)```", doc, re.DOTALL)
    assert config and "examples.env_plugin.letter_count:SPEC" in config.group(1)


async def test_plugin_episode_through_the_gateway(stub: env_pb2_grpc.EnvironmentStub) -> None:
    listed = {e.name: e for e in (await stub.ListEnvironments(env_pb2.ListEnvironmentsRequest(), timeout=5)).environments}
    assert "letter_count" in listed and "arith" in listed
    assert json.loads(listed["letter_count"].tools_json)[0]["function"]["name"] == "count"
    started = await stub.Reset(env_pb2.ResetRequest(env_name="letter_count", config_json='{"max_turns": 2}', seed=7),
                               timeout=5)
    prompt = started.observation[0].content
    letter, sentence = prompt.split("'")[1], prompt.split(": ", 1)[1].rstrip("?")
    call = json.dumps({"name": "count", "arguments": {"text": sentence, "letter": letter}})
    counted = await stub.Step(env_pb2.StepRequest(session_id=started.session_id,
                                                  action=f"<tool_call>{call}</tool_call>"), timeout=5)
    assert counted.observation[0].role == "tool" and counted.observation[0].content == str(sentence.count(letter))
    final = await stub.Step(env_pb2.StepRequest(session_id=started.session_id,
                                                action=f"{counted.observation[0].content} times"), timeout=5)
    assert final.done and final.reward == 1.0 and final.answer == final.reference


def _start_gateway(tmp_path: Path, target: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "run.yaml"
    config.write_text(f"env_gateway:\n  plugins:\n    - name: mine\n      target: '{target}'\n")
    env = {**os.environ, "ARLO_TOKEN": "t", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env.pop("ARLO_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "services.env_gateway", "-c", str(config), "--port", "0",
                           "--metrics-port", "-1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


BROKEN = '''
from dataclasses import dataclass
from services.env_gateway.spec import EnvSpec

raise_on_import = False

class NotAnEnv:
    pass

class NoConfig:
    def reset(self, seed, config): ...
    def step(self, action): ...

BAD_CONFIG = EnvSpec(name="x", description="", factory=lambda ctx: NoConfig(), config_type=dict)
'''


@pytest.mark.parametrize(("target", "why"), [
    ("no_such_env_pkg.envs:SPEC", "cannot import module 'no_such_env_pkg.envs': ModuleNotFoundError"),
    ("broken_envs:Missing", "'broken_envs' has no attribute 'Missing'"),
    ("broken_envs:raise_on_import", "is a bool, not an EnvSpec"),
    ("broken_envs:NotAnEnv", "the factory failed: TypeError"),
    ("broken_envs:NoConfig", "needs a `config_type` attribute"),
    ("broken_envs:BAD_CONFIG", "config_type 'dict' must be a dataclass with a validate() method"),
    ("import_fails:X", "cannot import module 'import_fails': RuntimeError: boom"),
])
def test_gateway_refuses_to_start_on_a_broken_plugin(tmp_path: Path, target: str, why: str) -> None:
    (tmp_path / "broken_envs.py").write_text(BROKEN)
    (tmp_path / "import_fails.py").write_text("raise RuntimeError('boom')\n")
    done = _start_gateway(tmp_path, target)
    assert done.returncode == 2, done.stderr
    assert f"env_gateway.plugins[0] 'mine' (target '{target}')" in done.stderr and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_plugin_name_clashing_with_a_builtin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    cfg = load_config(overrides={"env_gateway": {"plugins": [
        {"name": "arith", "target": "examples.env_plugin.letter_count:SPEC"}]}})
    with pytest.raises(ConfigError, match=r"env_gateway.plugins\[0\] 'arith': the name is taken by a built-in"):
        build_gateway(cfg)


def test_a_class_target_becomes_a_spec_named_by_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    spec = load_env_plugin(EnvPluginConfig(name="letters", target="examples.env_plugin.letter_count:LetterCountEnv"),
                           EnvContext(), "plugin")
    assert spec.name == "letters" and spec.config_type.__name__ == "LetterCountConfig"
    assert spec.factory(EnvContext()).reset(1, {}).task_id.startswith("letter_count-")
