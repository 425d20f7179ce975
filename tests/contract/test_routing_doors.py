"""Routing replay through every door of a real inference service on a Qwen3-MoE checkpoint written
by transformers: Generate, GenerateStream (the deltas' routed_experts joined), and a black-box
call to the OpenAI endpoint, recorded and read back as the rollout reads it (GetEpisode through
services/rollout/recorded.py) for a run with routing replay. Greedy, so every door generates the same tokens, and each token's
experts are the same bytes; a black-box episode's trajectory can then be replayed like any other."""

from __future__ import annotations

import uuid
from pathlib import Path

import openai
import pytest

from arlo.proto.v1 import common_pb2, inference_pb2
from arlo.routing_replay import routing_bytes
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
                                 model={"path": str(path), "max_seq_len": 256}, max_batch=2, max_n=1,
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
        (call,) = await GrpcRecordings(served.channel, timeout_s=30, routing=True).take("ep-moe")
        (turn,) = call.choices
        n = len(turn.token_ids)
        assert 0 < n and turn.token_ids == list(unary.token_ids[:n])
        assert turn.routed_experts == unary.routed_experts[: n * per_token]

        # A run without routing replay drops them (the service records them for every run it
        # serves: on a service shared by several runs each run's setting may differ).
        await client.completions.create(model="m", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                        extra_headers={"X-Arlo-Episode": "ep-plain"})
        (plain_call,) = await GrpcRecordings(served.channel, timeout_s=30).take("ep-plain")
        assert plain_call.choices[0].token_ids == turn.token_ids and plain_call.choices[0].routed_experts == b""
        # Without return_routing Generate sends none.
        plain = inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, n=1, sampling=request.sampling)
        assert (await served.stub.Generate(plain)).completions[0].routed_experts == b""
