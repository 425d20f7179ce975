"""Every applied trainer step's diagnostics reach the run's metrics stream and the trainer's
Prometheus /metrics, on a real trainer over a real Redis; staleness at the step never passes
`trainer.max_staleness`, even for groups admitted while they were still fresh."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from arlo.config import load_config
from arlo.coord import TrajectoryStream, WeightPointer, connect
from arlo.coord.metrics import MetricsStream
from arlo.proto.v1 import common_pb2
from tests.support.trainer import trainer_service

FIELDS = {"step", "version", "phase", "time", "loss", "reward_mean", "approx_kl", "clip_fraction", "grad_norm",
          "logprob_mismatch", "logprob_outside", "is_weight", "staleness_mean", "staleness_max", "queue_depth", "dropped",
          "response_length_mean", "response_length_max", "reward_components", "tokens_trained",
          "generated_tokens", "env_reward_mean", "consumed", "reward_by_env", "trajectories_by_env"}


def trajectory(group: str, reward: float, answer: list[int], env_name: str = "") -> common_pb2.Trajectory:
    prompt = [257, 260, 51, 43, 52, 61, 258, 261]
    n = len(prompt) + len(answer)
    traj = common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=prompt + answer,
        logprobs=[0.0] * 8 + [-5.5] * len(answer), loss_mask=[0] * 8 + [1] * len(answer),
        policy_versions=[-1] * 8 + [0] * len(answer), reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK,
        reward_components={"exact_match": reward, "format": 0.5}, finish_reason="done", env_name=env_name)
    traj.turn_rewards.add(token_end=n, reward=reward)
    return traj


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def test_each_step_writes_one_record_and_the_gauges(redis_url: str, run_id: str) -> None:
    cfg = load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url}, "auth": {"disabled": True},
        "trainer": {"server": {"port": 0, "metrics_port": 0, "grace_s": 0.2}, "read_block_ms": 50,
                    "groups_per_step": 1, "max_staleness": 1, "start_paused": True},
    })
    async with trainer_service(cfg) as (running, loop, redis):
        stream = TrajectoryStream(redis, run_id, consumer="test-producer")
        # Three groups sampled at version 0, all admitted at once while version 0 is current: the
        # third would train from version 2, two versions behind, so it is dropped at its step.
        for g, answer, env in (("g1", [55, 258], "times"), ("g2", [55, 56, 57, 258], "plus"), ("g3", [55, 258], "")):
            await stream.add_group([trajectory(g, 1.0, answer, env), trajectory(g, 0.0, answer, env)])
        loop.resume()
        for _ in range(1200):
            if loop.state.version >= 2 and loop.dropped()["stale"] >= 2:
                break
            await asyncio.sleep(0.05)
        await loop.pause()
        assert loop.state.version == 2 and loop.dropped()["stale"] == 2
        records = [r for _, r in await MetricsStream(redis, run_id).after("0-0")]
        assert [r["step"] for r in records] == [1, 2] and [r["version"] for r in records] == [1, 2]
        first, second = records
        assert FIELDS <= set(first) and first["phase"] == "rl"
        assert first["reward_mean"] == 0.5 and first["reward_components"] == {"exact_match": 0.5, "format": 0.5}
        assert first["env_reward_mean"] == 0.5 and first["response_length_max"] == 2
        assert (first["reward_by_env"], first["trajectories_by_env"]) == ({"times": 0.5}, {"times": 2})
        assert (second["reward_by_env"], second["trajectories_by_env"]) == ({"plus": 0.5}, {"plus": 2})
        assert second["response_length_mean"] == 4 and second["generated_tokens"] == 4 + 8
        assert (first["staleness_max"], second["staleness_max"]) == (0, 1)  # <= max_staleness, exactly
        assert second["dropped"]["stale"] == 0  # dropped after step 2, before a third could take it
        assert all(r["approx_kl"] > 0 and r["grad_norm"] > 0 and r["logprob_mismatch"] >= 0 for r in records)
        assert await MetricsStream(redis, run_id).latest() == second
        # Where each step's time went (services/trainer/anatomy.py): the second step's interval
        # starts where the first one's version was cut.
        assert first["timing"]["train_s"] > 0 and "step_s" not in first["timing"]
        assert second["anatomy"]["prev_cut_at"] == first["anatomy"]["cut_at"]
        assert second["timing"]["step_s"] == pytest.approx(second["anatomy"]["cut_at"] - first["anatomy"]["cut_at"])
        for r in records:  # the pointer named each version once it was cut (inline or beside the next step)
            assert r["anatomy"]["published_at"] >= r["anatomy"]["cut_at"] >= r["anatomy"]["trained_at"]
        metrics = await asyncio.to_thread(scrape, running.metrics_port)
        assert metrics["arlo_trainer_version"] == 2 and metrics["arlo_trainer_step"] == 2
        assert metrics["arlo_trainer_loss{phase=rl}"] == second["loss"]
        assert metrics["arlo_trainer_reward"] == 0.5 and metrics["arlo_trainer_staleness_max"] == 1
        assert metrics["arlo_trainer_dropped_total{reason=stale}"] == 2
        assert metrics["arlo_trainer_logprob_mismatch"] == second["logprob_mismatch"]
        assert metrics["arlo_trainer_logprob_outside"] == second["logprob_outside"] == 0.0  # nothing filters
        for name in ("approx_kl", "clip_fraction", "grad_norm", "is_weight", "queue_depth", "response_length"):
            assert f"arlo_trainer_{name}" in metrics, name


async def test_a_restarted_trainers_gauges_say_where_it_stands_before_its_first_step(
        redis_url: str, run_id: str) -> None:
    """A restart read arlo_trainer_version 0 and step 0 until its next step (issue 33, item 7)."""
    cfg = load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url}, "auth": {"disabled": True},
        "trainer": {"server": {"port": 0, "metrics_port": 0, "grace_s": 0.2}, "start_paused": True}})
    redis = await connect(cfg.redis)
    try:  # the run the restarted trainer finds: version 7 published by its previous process
        await WeightPointer(redis, run_id).publish(7, source="grpc://gone:1", sha256="0" * 64)
    finally:
        await redis.aclose()
    async with trainer_service(cfg) as (running, loop, _):
        metrics = await asyncio.to_thread(scrape, running.metrics_port)
        assert loop.state.version == 8 and metrics["arlo_trainer_version"] == 8 and metrics["arlo_trainer_step"] == 0
