"""Two runs on one inference service (issue 35, item 3): each run's weight pointer (real Redis)
feeds its own adapter slot through its own WeightSync (a real PullWeights over gRPC), each run's
requests (real gRPC Generate) are sampled by its own adapter and report its own version, one run's
publish leaves the other's version alone, and a run the service does not serve is refused."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import grpc
import jax
import pytest

from arlo.config import InferenceConfig, RunConfig, TrainerConfig, load_config
from arlo.config.trainer import LoraConfig
from arlo.coord import WeightPointer, connect, delete_run
from arlo.model import lora, state_to_bytes
from arlo.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import ServiceBinding, make_channel, start_server
from services.inference.engine import Engine
from services.inference.runs import EngineSlot, run_slots
from services.inference.server import InferenceServicer
from services.inference.weights import WeightSync
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from tests.support.scripted_server import scripted_server
from tests.unit.test_trainer_learner import random_groups

PROMPT = [257, 260, 51, 43, 52, 61, 258, 261]


class OneVersion(trainer_pb2_grpc.TrainerServicer):
    """PullWeights of one payload (a trained adapter), as the trainer streams it."""

    def __init__(self, version: int, payload: bytes) -> None:
        self.version, self.payload = version, payload
        self.sha = hashlib.sha256(payload).hexdigest()

    async def PullWeights(self, request, context) -> AsyncIterator[trainer_pb2.PullWeightsResponse]:  # noqa: N802
        assert request.version == self.version
        piece = self.payload[request.offset:]
        yield trainer_pb2.PullWeightsResponse(
            version=common_pb2.WeightVersion(version=self.version, sha256=self.sha), offset=request.offset,
            data=piece, total_bytes=len(self.payload), chunk_sha256=hashlib.sha256(piece).hexdigest())


def request(run_id: str) -> inference_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop_token_ids=[263])
    return inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, n=4, sampling=sampling, run_id=run_id)


@pytest.mark.timeout(600)
async def test_two_runs_share_one_inference_service_each_with_its_adapter_and_version(redis_url: str) -> None:
    cfg: RunConfig = load_config(overrides={
        "run_id": "runs-a", "redis": {"url": redis_url}, "auth": {"disabled": True},
        "trainer": {"learning_rate": 1e-2, "lora": {"rank": 4}},
        "inference": {"runs": ["runs-b"], "server": {"port": 0, "metrics_port": -1, "grace_s": 0.2}}})
    slots = run_slots(cfg)
    assert slots == {"runs-a": 0, "runs-b": 1}
    engine = Engine(cfg.model_source(), config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64),
                    adapters=len(slots))
    tc = TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=4))
    learner = Learner(cfg.model_source(), cfg=tc)  # run b's trainer, one step in
    learner.step(build_batch(random_groups(2, 4), 256, 256))
    payload = state_to_bytes(learner.serving_state())
    redis = await connect(cfg.redis)
    name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    running = await start_server("inference", cfg.inference.server, cfg.auth, [ServiceBinding(
        name=name, add_to_server=inference_pb2_grpc.add_InferenceServicer_to_server,
        servicer=InferenceServicer(engine, "byte", runs=slots))])
    try:
        async with scripted_server(trainer_pb2_grpc.add_TrainerServicer_to_server, OneVersion(5, payload)) as trainer:
            pointer_b = WeightPointer(redis, "runs-b")
            assert await pointer_b.publish(5, source=f"grpc://{trainer}", sha256=hashlib.sha256(payload).hexdigest(),
                                           scope="adapters")
            sync_b = WeightSync(EngineSlot(engine, 1), pointer_b, token=None, poll_s=0.1,
                                max_message_bytes=64 << 20)
            await sync_b.sync_to(await pointer_b.get())
            await sync_b.aclose()
        assert engine.versions == (0, 5)  # run b's publish left run a's slot alone
        served = lora.slot_of(lora.split_adapters(engine.state)[0], 1)
        assert state_to_bytes(served) == payload

        async with make_channel(f"127.0.0.1:{running.port}", token=None) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            a, b, own = [await stub.Generate(request(r), timeout=300) for r in ("runs-a", "runs-b", "")]
            assert {v for c in a.completions for v in c.policy_versions} == {0}
            assert {v for c in b.completions for v in c.policy_versions} == {5}
            assert [c.token_ids for c in own.completions] == [c.token_ids for c in a.completions]
            assert [c.token_ids for c in a.completions] != [c.token_ids for c in b.completions]
            info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(run_id="runs-b"), timeout=30)
            assert info.policy_version == 5
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(request("runs-c"), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not served here" in \
                refused.value.details()
    finally:
        await running.stop(0.1)
        engine.close()
        for run in slots:
            await delete_run(redis, run)
        await redis.aclose()


def test_inference_runs_need_lora_and_other_run_ids() -> None:
    from arlo.config.base import ConfigError

    with pytest.raises(ConfigError, match="inference.runs.*trainer.lora.rank"):
        load_config(overrides={"inference": {"runs": ["b"]}})
    with pytest.raises(ConfigError, match="own run_id"):
        load_config(overrides={"run_id": "a", "trainer": {"lora": {"rank": 4}}, "inference": {"runs": ["a"]}})
    with pytest.raises(ConfigError, match=r"inference.runs\[0\]"):
        load_config(overrides={"trainer": {"lora": {"rank": 4}}, "inference": {"runs": ["bad id"]}})


async def test_the_pointer_says_a_publish_holds_adapters_and_a_service_without_lora_refuses_it(redis_url: str) -> None:
    """A LoRA trainer's pointer says "adapters"; an inference service configured without LoRA
    (the two configs drifted apart) refuses the version naming trainer.lora, and serves on."""
    from arlo.model.source import preset_source

    redis = await connect(load_config(overrides={"redis": {"url": redis_url}}).redis)
    pointer = WeightPointer(redis, "runs-scope")
    try:
        assert await pointer.publish(1, source="grpc://127.0.0.1:1", sha256="0" * 64, scope="adapters")
        state = await pointer.get()
        assert state is not None and state.scope == "adapters"
        assert type(state).from_proto(state.to_proto()).scope == "adapters"
        with pytest.raises(ValueError, match="scope"):
            await pointer.publish(2, source="grpc://127.0.0.1:1", sha256="0" * 64, scope="lora")  # type: ignore[arg-type]
        engine = Engine(preset_source("tiny"), config=InferenceConfig(max_n=1, max_tokens=8, max_prompt_tokens=16))
        sync = WeightSync(engine, pointer, token=None, poll_s=0.1, max_message_bytes=1 << 20)
        with pytest.raises(ValueError, match="trainer.lora must be the same on both sides"):
            await sync.sync_to(state)
        assert engine.version == 0
        engine.close()
    finally:
        await delete_run(redis, "runs-scope")
        await redis.aclose()


def test_the_openai_door_picks_a_runs_adapter_by_model() -> None:
    """`model` naming a run served here generates with that run's adapter and reports its version;
    /v1/models lists the runs; any other `model` is the service's own run."""
    from starlette.testclient import TestClient

    from services.inference.episodes import EpisodeRecorder
    from services.inference.openai_http import OpenAIEndpoint

    cfg = load_config(overrides={"run_id": "door-a", "trainer": {"lora": {"rank": 4}},
                                 "inference": {"runs": ["door-b"]}})
    slots = run_slots(cfg)
    engine = Engine(cfg.model_source(), config=InferenceConfig(max_n=2, max_tokens=8, max_prompt_tokens=32),
                    adapters=2)
    adapters = lora.slot_of(lora.split_adapters(engine.state)[0], 1)
    engine.swap(jax.tree.map(lambda x: x + 0.3, adapters), 7, adapter=1)
    endpoint = OpenAIEndpoint(engine, EpisodeRecorder(max_episodes=4, max_calls=4, ttl_s=60.0), token=None, runs=slots)
    try:
        with TestClient(endpoint.app) as client:
            listed = client.get("/v1/models").json()["data"]
            assert [(m["id"], m["policy_version"]) for m in listed][1:] == [("door-b", 7)]
            body = {"prompt": [257, 260, 51, 43], "max_tokens": 6, "temperature": 0, "seed": 1}
            b = client.post("/v1/completions", json={**body, "model": "door-b"}).json()
            a = client.post("/v1/completions", json={**body, "model": "door-a"}).json()
            other = client.post("/v1/completions", json={**body, "model": "anything"}).json()
        assert b["system_fingerprint"] == "arlo-v7" and a["system_fingerprint"] == "arlo-v0"
        assert other["choices"][0]["text"] == a["choices"][0]["text"] != b["choices"][0]["text"]
    finally:
        engine.close()
