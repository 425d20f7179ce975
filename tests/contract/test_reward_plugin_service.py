"""The worked example of docs/rewards.md: a plugin from config, scored through gRPC; broken plugins stop the start.

examples/reward_plugin/reward.yaml registers examples/reward_plugin/my_verifier.py:keyword_recall.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from arlo.config import load_config
from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
from arlo.rpc import make_channel
from services.reward.__main__ import start_reward

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "reward_plugin" / "reward.yaml"
TOKEN = "plugin-token"
TOKEN_ENV = "ARLO_TEST_REWARD_PLUGIN_TOKEN"
OK, ERROR = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR


@pytest.fixture
async def stub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[reward_pb2_grpc.RewardStub]:
    monkeypatch.syspath_prepend(str(ROOT))  # as `python -m services.reward` from the repository root has it
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = load_config(EXAMPLE_CONFIG, {"auth": {"token_env": TOKEN_ENV},
                                       "reward": {"server": {"port": 0, "metrics_port": -1}}})
    running = await start_reward(cfg)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield reward_pb2_grpc.RewardStub(channel)
    finally:
        await running.stop(None)


async def test_example_plugin_is_listed_and_scores(stub: reward_pb2_grpc.RewardStub) -> None:
    listed = await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
    descriptions = {f.name: f.description for f in listed.functions}
    assert descriptions["keyword_recall"].startswith("Share of the reference's comma-separated keywords")
    reply = await stub.Score(reward_pb2.ScoreRequest(
        reward_fn="keyword_recall", response="Plants use light and chlorophyll.",
        reference="light, chlorophyll, water, carbon dioxide"), timeout=5)
    assert (reply.status, reply.reward, dict(reply.components)) == (OK, 0.5, {"recall": 0.5, "num_keywords": 4.0})


async def test_plugin_in_a_batch_with_builtins_and_composites(stub: reward_pb2_grpc.RewardStub) -> None:
    response = "<think>light is needed</think><answer>Light</answer>"
    items = [
        reward_pb2.ScoreRequest(reward_fn="keyword_recall", response=response, reference="light"),
        reward_pb2.ScoreRequest(reward_fn="keyword_recall", response=response, reference="light",
                                metadata_json='{"case_sensitive": true}'),
        reward_pb2.ScoreRequest(reward_fn="keyword_recall", response=response, reference=" , "),
        reward_pb2.ScoreRequest(reward_fn="composite", response=response, reference="light", metadata_json=(
            '{"components": [{"fn": "keyword_recall", "weight": 0.8}, {"fn": "format_think", "weight": 0.2}]}')),
    ]
    reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=10)
    assert [(r.status, r.reward) for r in reply.results] == [(OK, 1.0), (OK, 1.0), (ERROR, 0.0), (OK, 1.0)]
    assert "ValueError: reference lists no keywords" in reply.results[2].error
    assert reply.results[3].components["keyword_recall.recall"] == 1.0
    assert reply.results[3].components["format_think.answer"] == 1.0


@pytest.mark.parametrize(("target", "why"), [
    ("no_such_plugin_pkg.scorer:score", "cannot import module 'no_such_plugin_pkg.scorer': ModuleNotFoundError"),
    ("examples.reward_plugin.my_verifier:MAX_KEYWORDS", "not callable"),
])
def test_service_refuses_to_start_on_a_broken_plugin(tmp_path: Path, target: str, why: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"reward:\n  plugins:\n    - name: mine\n      target: '{target}'\n")
    env = {**os.environ, "ARLO_TOKEN": "t"}
    env.pop("ARLO_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "services.reward", "-c", str(config), "--port", "0",
                           "--metrics-port", "-1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"reward.plugins[0] 'mine' (target '{target}')" in done.stderr and why in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
