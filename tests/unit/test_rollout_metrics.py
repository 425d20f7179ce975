"""The rollout's Prometheus families (episodes, turns, finish reasons, tool-call errors) from a
real worker's episodes on the real env gateway and reward cores, scraped over HTTP."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from arlo.config import RolloutConfig, SamplingConfig
from arlo.coord import TrajectoryStream, delete_run
from arlo.rpc.metrics import MetricsHttpServer, rollout_collector
from services.rollout.agent import Turn
from services.rollout.worker import RolloutWorker
from tests.support.inprocess import TOK, CoreScorer, GatewayEnv


class BadToolThenAnswer:
    """First turn: a tool call the calculator cannot evaluate; second turn: the right answer."""

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        text = TOK.decode(prompt)
        if "error:" not in text:
            ids = TOK.encode("calc 1/(") + [TOK.eos_id]
        else:
            a, b = map(int, re.findall(r"(\d+)\+(\d+)=", text)[-1])
            ids = TOK.encode(str(a + b)) + [TOK.eos_id]
        return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids), finished_by_stop=True)


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f"{s.name}{s.labels or ''}": s.value for f in text_string_to_metric_families(body) for s in f.samples}


async def test_rollout_counters_on_metrics(redis_url: str, run_id: str) -> None:
    redis = aioredis.from_url(redis_url)
    cfg = RolloutConfig(env_name="arith", env_config_json='{"tool": true, "max_turns": 3}', reward_fn="exact_match",
                        group_size=2, max_turns=3, sampling=SamplingConfig(max_tokens=16))
    worker = RolloutWorker(cfg, run_id=run_id, tokenizer=TOK, gen=BadToolThenAnswer(), env=GatewayEnv(),
                           scorer=CoreScorer(), stream=TrajectoryStream(redis, run_id, consumer="rollout"), seed=0)
    registry = CollectorRegistry()
    registry.register(rollout_collector(worker.stats.snapshot))  # as services/rollout/__main__.py does
    server = MetricsHttpServer.start("127.0.0.1", 0, registry)
    try:
        trajs = await worker.run_group(3)
        assert all(t.tool_call_errors == 1 and t.num_turns == 2 and t.reward == 1.0 for t in trajs)
        metrics = await asyncio.to_thread(scrape, server.port)
    finally:
        await server.close()
        await delete_run(redis, run_id)
        await redis.aclose()
    assert metrics["arlo_rollout_episodes_total"] == 2 and metrics["arlo_rollout_groups_total"] == 1
    assert metrics["arlo_rollout_turns_total"] == 4 and metrics["arlo_rollout_tool_call_errors_total"] == 2
    assert metrics["arlo_rollout_finish_reasons_total{'reason': 'done'}"] == 2
