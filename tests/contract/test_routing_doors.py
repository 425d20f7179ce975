"""Routing replay through every door of a real inference service on a Qwen3-MoE checkpoint written
by transformers: Generate, GenerateStream (the deltas' routed_experts joined), and a black-box
call to the OpenAI endpoint, recorded and read back as the rollout reads it (GetEpisode through
services/rollout/recorded.py) with trainer.algorithm.routing_replay on. Greedy, so every door generates the same tokens, and each token's
experts are the same bytes; a black-box episode's trajectory can then be replayed like any other."""

from __future__ import annotations

import uuid
from pathlib import Path

import openai
import pytest

from arlo.proto.v1 import common_pb2, inference_pb2
from arlo.routing_replay import routing_bytes
from services.inference.episodes import EpisodeRecorder
from services.inference.openai_http import OpenAIEndpoint
from services.rollout.recorded import GrpcRecordings
from tests.support.openai_server import TOKEN, inference_service

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="session")]

PROMPT = [5, 17, 42, 99, 7, 30, 31, 32]
NEW = 8


async def test_every_door_returns_the_same_experts_for_the_same_tokens(tmp_path: Path, redis_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.hf_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "moe", "qwen3_moe")
    async with inference_service(monkeypatch, redis_url, f"routing-{uuid.uuid4().hex[:8]}",
                                 model={"path": str(path), "max_seq_len": 256},
                                 trainer={"algorithm": {"routing_replay": True}}, max_batch=2, max_n=1,
                                 max_tokens=NEW, max_prompt_tokens=64, warmup_programs=0) as served:
        per_token = routing_bytes(served.engine.model_cfg)
        assert per_token > 0
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, n=1, return_routing=True,
            sampling=common_pb2.SamplingParams(max_tokens=NEW, temperature=0.0))
        (unary,) = (await served.stub.Generate(request)).completions
        assert len(unary.token_ids) == NEW and len(unary.routed_experts) == NEW * per_token  # no stop ids: all NEW

        deltas = [m async for m in served.stub.GenerateStream(inference_pb2.GenerateStreamRequest(request=request))]
        assert [t for m in deltas for t in m.token_ids] == list(unary.token_ids)
        assert all(len(m.routed_experts) == len(m.token_ids) * per_token for m in deltas)
        assert b"".join(m.routed_experts for m in deltas) == unary.routed_experts

        # A black-box agent's call, recorded under its episode: the endpoint stops at the model's
        # stop ids, so it may end sooner; its tokens are the same prefix, its experts too.
        client = openai.AsyncOpenAI(base_url=served.openai_url, api_key=TOKEN, max_retries=0)
        reply = await client.completions.create(model="m", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                extra_headers={"X-Arlo-Episode": "ep-moe"})
        assert reply.choices[0].text is not None
        (call,) = await GrpcRecordings(served.channel, timeout_s=30).take("ep-moe")
        (turn,) = call.choices
        n = len(turn.token_ids)
        assert 0 < n and turn.token_ids == list(unary.token_ids[:n])
        assert turn.routed_experts == unary.routed_experts[: n * per_token]

        # Without return_routing nothing is sent; without routing replay the endpoint records none.
        plain = inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, n=1, sampling=request.sampling)
        assert (await served.stub.Generate(plain)).completions[0].routed_experts == b""
        recorder = EpisodeRecorder(max_episodes=2, max_calls=2, ttl_s=60)
        assert OpenAIEndpoint(served.engine, recorder, token=TOKEN, record_routing=True).record_routing
        assert not OpenAIEndpoint(served.engine, recorder, token=TOKEN).record_routing
