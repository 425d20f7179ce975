"""A real inference gRPC server on an ephemeral port (the tiny preset, no Redis), and the
helpers the inference contract tests share."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from arlo.config import InferenceConfig, load_config
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from arlo.rpc import ServiceBinding, start_server
from services.inference.engine import Engine
from services.inference.server import InferenceServicer

TOKEN = "stream-token"


@pytest.fixture
async def served(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, Engine]]:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    cfg = load_config(overrides={"inference": {"server": {"port": 0, "metrics_port": -1, "grace_s": 0.5}}})
    # Two steps per chunk and up to 200 tokens: a long request stays in flight for many chunks.
    engine = Engine(preset_source("tiny"), config=InferenceConfig(max_n=4, max_tokens=200, max_prompt_tokens=32, max_batch=8, decode_steps=2))
    name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    running = await start_server("inference", cfg.inference.server, cfg.auth, [
        ServiceBinding(name=name, add_to_server=inference_pb2_grpc.add_InferenceServicer_to_server,
                       servicer=InferenceServicer(engine, "byte"))])
    try:
        yield f"127.0.0.1:{running.port}", engine
    finally:
        await running.stop(0.1)
        await asyncio.to_thread(engine.close)


def request(max_tokens: int, *, seed: int | None = None, prompt: tuple[int, ...] = (257, 260, 49, 258, 261),
            temperature: float = 1.0) -> inference_pb2.GenerateRequest:
    # Stop id 263 is no byte-tokenizer id; greedy decoding of this model never produces it.
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop_token_ids=[263])
    if seed is not None:
        sampling.seed = seed
    return inference_pb2.GenerateRequest(prompt_token_ids=list(prompt), n=1, sampling=sampling)


def hold_after_first_tokens_until_cancelled(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """The engine thread waits, after a request's first tokens, until the server queued a
    cancel: a cancel that travels slowly on a loaded machine cannot lose a race with the rest
    of the generation (200 tokens of a tiny model take well under a second). Every submit path
    (Generate, GenerateStream, GenerateBatch) goes through submit_many."""
    cancelled = threading.Event()
    real_submit_many, real_cancel = engine.submit_many, engine.cancel

    def submit_many(reqs, *, on_tokens=None, **kw):
        def held(delta) -> None:
            if on_tokens is not None:
                on_tokens(delta)
            cancelled.wait(30)
        return real_submit_many(reqs, on_tokens=held, **kw)

    def cancel(request_id: int) -> None:
        real_cancel(request_id)
        cancelled.set()

    monkeypatch.setattr(engine, "submit_many", submit_many)
    monkeypatch.setattr(engine, "cancel", cancel)
