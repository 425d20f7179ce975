"""Inference and trainer on ephemeral ports against the real Redis: bad input, auth, and the
weight path trainer -> PullWeights -> inference hot swap."""

from __future__ import annotations

import asyncio
import hashlib
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from arlo.background import TaskGroup
from arlo.config import load_config
from arlo.coord import TrajectoryStream, WeightPointer, connect, delete_run
from arlo.model.weights import state_to_bytes
from arlo.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel
from services.inference.__main__ import start_inference
from services.inference.engine import Engine
from services.inference.weights import WeightPullError, WeightSync
from services.trainer.__main__ import start_trainer

TOKEN = "contract-token"


@pytest.fixture
async def stack(redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict]:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    server = {"port": 0, "metrics_port": 0, "grace_s": 0.5}
    cfg = load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url},
        "inference": {"server": server, "max_n": 8, "max_tokens": 16, "max_prompt_tokens": 64, "weight_poll_s": 0.2},
        "trainer": {"server": server, "groups_per_step": 1, "read_block_ms": 100},
    })
    tasks = TaskGroup()
    trainer, loop = await start_trainer(cfg, tasks)
    inference, engine = await start_inference(cfg, tasks)
    try:
        yield {"cfg": cfg, "loop": loop, "engine": engine, "trainer": f"127.0.0.1:{trainer.port}",
               "inference": f"127.0.0.1:{inference.port}", "inference_metrics": inference.metrics_port}
    finally:
        await tasks.cancel_all()
        await inference.stop(0.1)
        await trainer.stop(0.1)
        redis = await connect(cfg.redis)
        await delete_run(redis, run_id)
        await redis.aclose()


def generate_request(**kw) -> inference_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=kw.pop("max_tokens", 4), temperature=1.0)
    return inference_pb2.GenerateRequest(**{"prompt_token_ids": [257, 260, 49, 258, 261], "n": 1,
                                            "sampling": sampling, **kw})


async def test_generate_returns_n_samples_with_logprobs_and_versions(stack: dict) -> None:
    async with make_channel(stack["inference"], token=TOKEN) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        resp = await stub.Generate(generate_request(n=4, max_tokens=6))
        info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert len(resp.completions) == 4 and resp.policy_version == 0
    for c in resp.completions:
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids) == len(c.policy_versions)
        assert all(lp <= 0.0 for lp in c.logprobs)
    assert info.model_name == "tiny" and info.max_n == 8 and info.eos_token_id == 258


@pytest.mark.parametrize(("request_kw", "needle"), [
    ({"prompt_token_ids": []}, "must not be empty"),
    ({"n": 9}, "n must be in"),
    ({"max_tokens": 0}, "max_tokens is required"),
    ({"max_tokens": 17}, "max_tokens must be in"),
    ({"prompt_token_ids": [5000]}, "prompt_token_ids must be in"),
    ({"prompt_token_ids": [1] * 65}, "at most 64"),
    ({"session_id": "x" * 129}, "at most 128 bytes"),
])
async def test_generate_bad_input_is_invalid_argument(stack: dict, request_kw: dict, needle: str) -> None:
    async with make_channel(stack["inference"], token=TOKEN) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await inference_pb2_grpc.InferenceStub(ch).Generate(generate_request(**request_kw))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_every_rpc_needs_the_token_but_health(stack: dict) -> None:
    calls = [
        (stack["inference"], inference_pb2_grpc.InferenceStub, "Generate", generate_request()),
        (stack["inference"], inference_pb2_grpc.InferenceStub, "GetModelInfo", inference_pb2.GetModelInfoRequest()),
        (stack["trainer"], trainer_pb2_grpc.TrainerStub, "GetStatus", trainer_pb2.GetStatusRequest()),
        (stack["trainer"], trainer_pb2_grpc.TrainerStub, "Pause", trainer_pb2.PauseRequest()),
        (stack["trainer"], trainer_pb2_grpc.TrainerStub, "Resume", trainer_pb2.ResumeRequest()),
        (stack["trainer"], trainer_pb2_grpc.TrainerStub, "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest()),
    ]
    for address, stub_cls, method, request in calls:
        for token in (None, "wrong"):
            async with make_channel(address, token=token) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await getattr(stub_cls(ch), method)(request)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, token)
    for stream_call in ("GenerateStream", "PullWeights"):
        async with make_channel(stack["inference" if stream_call == "GenerateStream" else "trainer"], token=None) as ch:
            stub = (inference_pb2_grpc.InferenceStub(ch) if stream_call == "GenerateStream"
                    else trainer_pb2_grpc.TrainerStub(ch))
            request = (inference_pb2.GenerateStreamRequest(request=generate_request()) if stream_call == "GenerateStream"
                       else trainer_pb2.PullWeightsRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in getattr(stub, stream_call)(request):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with make_channel(stack["trainer"], token=None) as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def trajectory(group: str, reward: float) -> common_pb2.Trajectory:
    prompt = [257, 260, 51, 43, 52, 61, 258, 261]
    return common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=prompt + [55, 258],
        logprobs=[0.0] * 8 + [-5.5, -5.5], loss_mask=[0] * 8 + [1, 1], policy_versions=[-1] * 8 + [0, 0],
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


async def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_trained_version_reaches_inference_intact(stack: dict) -> None:
    cfg, loop, engine = stack["cfg"], stack["loop"], stack["engine"]
    redis = await connect(cfg.redis)
    stream = TrajectoryStream(redis, cfg.run_id, consumer="test-producer")
    for traj in (trajectory("g1", 1.0), trajectory("g1", 0.0)):
        await stream.add(traj)
    await wait_for(lambda: loop.state.version >= 1)
    pointer = None
    for _ in range(200):  # the version counter moves just before the pointer does
        pointer = await WeightPointer(redis, cfg.run_id).get()
        if pointer is not None:
            break
        await asyncio.sleep(0.05)
    assert pointer is not None and pointer.version == 1
    await wait_for(lambda: engine.version >= 1)
    # What inference serves is byte-for-byte what the trainer published.
    assert hashlib.sha256(state_to_bytes(engine.state)).hexdigest() == pointer.sha256
    async with make_channel(stack["inference"], token=TOKEN) as ch:
        resp = await inference_pb2_grpc.InferenceStub(ch).Generate(generate_request())
    assert set(resp.completions[0].policy_versions) == {1}
    # Inference's own figures on its /metrics, scraped over HTTP.
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{stack['inference_metrics']}/metrics", timeout=5).read().decode())
    scraped = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    assert scraped["arlo_inference_swaps_total"] >= 1 and scraped["arlo_inference_last_swap_seconds"] > 0
    # At least this reply's tokens: sampled at temperature 1, it may stop at EOS before max_tokens
    # (CI: 2 of 4, from a model just trained on a completion that ends in EOS).
    made = len(resp.completions[0].token_ids)
    assert made >= 1 and scraped["arlo_inference_generated_tokens_total"] >= made
    assert scraped["arlo_inference_weight_version"] == 1
    assert scraped["arlo_inference_slots"] >= 1 and 0 <= scraped["arlo_inference_kv_use"] <= 1
    assert 0 <= scraped["arlo_inference_batch_occupancy"] <= 1 and "arlo_inference_kv_pages_used" in scraped
    async with make_channel(stack["trainer"], token=TOKEN) as ch:
        status = await trainer_pb2_grpc.TrainerStub(ch).GetStatus(trainer_pb2.GetStatusRequest())
    assert status.version == 1 and status.step == 1 and status.trajectories_consumed == 2
    # Acknowledged after the step: in its tail, which may still be running beside the loop
    # (a CI run at load ~7 read the backlog before it ended), so within a bound, not at once.
    for _ in range(600):
        if await stream.backlog() == 0:
            break
        await asyncio.sleep(0.05)
    assert await stream.backlog() == 0
    await redis.aclose()


async def test_corrupt_publication_is_rejected_and_old_weights_keep_serving(stack: dict) -> None:
    cfg, loop, engine = stack["cfg"], stack["loop"], stack["engine"]
    loop.store.put(1, state_to_bytes(loop.learner.state))
    bad = replace(await _pointer_state(cfg, loop), sha256="0" * 64)
    sync = WeightSync(engine, WeightPointer(await connect(cfg.redis), cfg.run_id), token=TOKEN, poll_s=1.0,
                      max_message_bytes=64 << 20)
    try:
        with pytest.raises(WeightPullError, match="sha256"):
            await sync.sync_to(bad)
    finally:
        await sync.aclose()
    assert engine.version == 0


async def test_pulls_share_one_channel_per_trainer_address(stack: dict) -> None:
    """A new connection per version cost a few ms of every swap; a new address gets a new channel."""
    cfg, loop, engine = stack["cfg"], stack["loop"], stack["engine"]
    sync = WeightSync(engine, WeightPointer(await connect(cfg.redis), cfg.run_id), token=TOKEN, poll_s=1.0,
                      max_message_bytes=64 << 20)
    try:
        channels = []
        for version in (1, 2):
            published = loop.store.put(version, state_to_bytes(loop.learner.state))
            await sync.sync_to(replace(await _pointer_state(cfg, loop), version=version, sha256=published.sha256))
            channels.append(sync._channel)
        assert engine.version == 2 and channels[0] is channels[1]
        with pytest.raises(grpc.aio.AioRpcError):  # a trainer elsewhere (nothing listens there)
            await sync.sync_to(replace(await _pointer_state(cfg, loop), version=3, source="grpc://127.0.0.1:1"))
        assert sync._channel is not None and sync._channel[0] == "127.0.0.1:1"
    finally:
        await sync.aclose()
    assert sync._channel is None


async def _pointer_state(cfg, loop):
    from arlo.coord import WeightPointerState

    published = loop.store.get(0)
    return WeightPointerState(version=published.version, source=loop.source, sha256=published.sha256,
                              checkpoint_version=0, checkpoint_uri="", time=published.time)


@pytest.mark.parametrize(("request_kw", "code"), [
    ({"chunk_bytes": 1}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"version": 99}, grpc.StatusCode.NOT_FOUND),
    ({"version": -1}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"offset": 1 << 40}, grpc.StatusCode.OUT_OF_RANGE),
])
async def test_pull_weights_bad_input(stack: dict, request_kw: dict, code: grpc.StatusCode) -> None:
    stack["loop"].store.put(1, b"x" * 1000)
    async with make_channel(stack["trainer"], token=TOKEN) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in trainer_pb2_grpc.TrainerStub(ch).PullWeights(trainer_pb2.PullWeightsRequest(**request_kw)):
                pass
    assert err.value.code() == code


async def test_save_checkpoint_without_a_directory_is_failed_precondition(stack: dict) -> None:
    async with make_channel(stack["trainer"], token=TOKEN) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "checkpoint_dir" in err.value.details()


async def test_deltas_and_storage_reach_the_engine_bit_exact(stack: dict, tmp_path) -> None:
    """trainer.weights (deltas, shared storage) end to end through the real Publisher and Engine:
    the versions between fulls go out as deltas, the engine serves each one's exact bytes, and a
    replica that missed a version catches up through the newest full and the deltas after it."""
    import jax

    from arlo.config.trainer import WeightPublishConfig
    from services.trainer.publish import VersionEncoder

    cfg, loop = stack["cfg"], stack["loop"]
    # A replica of its own: the served engine's WeightSync follows the same pointer and would
    # install some versions before this one does (a race the counts below would lose).
    engine = Engine(cfg.model_source(), config=cfg.inference)
    loop.publisher.encoder = VersionEncoder(loop.store, WeightPublishConfig(full_every=3,
                                                                            storage=f"file://{tmp_path}"))
    pointer = WeightPointer(await connect(cfg.redis), cfg.run_id)
    sync = WeightSync(engine, pointer, token=TOKEN, poll_s=1.0, max_message_bytes=64 << 20)
    kinds = []
    try:
        for version in range(1, 6):
            leaves, tree = jax.tree.flatten(loop.learner.state)
            leaves[0] = leaves[0].at[(version,) * leaves[0].ndim].add(1.0)  # one element: a small delta
            loop.learner.state = jax.tree.unflatten(tree, leaves)
            published = await loop.publisher.stored(version)
            assert await loop.publisher.point_at(published) is None
            kinds.append(published.kind)
            if version == 3:
                continue  # this replica misses version 3: 4 is a full, 5 a delta onto it
            await sync.sync_to(await pointer.get())
            assert engine.version == version
            assert hashlib.sha256(state_to_bytes(engine.published_state)).hexdigest() == published.sha256
            assert sync.stats.last_sync["deltas"] == (1 if published.kind == "delta" else 0)
            assert sync.stats.last_sync["from_storage"] == 1.0
    finally:
        await sync.aclose()
        engine.close()
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert sync.versions.fallbacks == 0 and loop.store.sent_bytes == 0  # nothing pulled from the trainer
