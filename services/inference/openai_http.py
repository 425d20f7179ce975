"""The OpenAI-compatible HTTP endpoint of the inference service (a thin Starlette edge).

`/v1/chat/completions`, `/v1/completions` and `/v1/models`, on the service's own event loop
beside gRPC (uvicorn's `Server.serve()` as a task). Handlers never run the model: they
submit to the engine's loop and await its callbacks, as the gRPC servicer does, so HTTP and
gRPC requests share every decode step. Auth is the service's bearer token (401 without it);
errors use OpenAI's JSON shape, 400 for bad input naming the field.

A call tied to an episode (header `X-Arlo-Episode`, else the `user` field) is recorded in
the `EpisodeRecorder` (fetched with the Inference.GetEpisode RPC) and its prompt continues
that episode's earlier tokens when the agent sent an earlier reply back verbatim
(`openai_render`). With n = 1 the episode id is also the engine session, so the KV prefix
of the previous turn is reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.inference import openai_render as render
from services.inference.bridge import Bridge
from services.inference.engine import Engine, Sample, SamplingRequest, TokenDelta
from services.inference.episodes import Branch, EpisodeRecorder, RecordedCall, RecordedChoice
from services.inference.openai_requests import (
    MAX_BODY_BYTES,
    MAX_ID_BYTES,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    Sampling,
    parse_chat,
    parse_completion,
)

log = logging.getLogger(__name__)
EPISODE_HEADER = "x-arlo-episode"
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Call:
    """What one handler works out before it samples."""

    kind: str
    prompt: list[int]
    request: SamplingRequest
    sampling: Sampling
    episode: str
    continued: bool = False
    chat: ChatRequest | None = None
    keys: tuple[str, ...] = ()


class OpenAIEndpoint:
    def __init__(self, engine: Engine, recorder: EpisodeRecorder, *, token: str | None,
                 tool_format: str = "auto") -> None:
        self.engine, self.recorder = engine, recorder
        self.tool_format = tool_format
        """How replies are read for tool calls (`model.tool_format`)."""
        self.tok = engine.tokenizer
        self._expected = token.encode() if token else None
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ])
        self.app.add_exception_handler(404, lambda r, e: error(404, f"no route {r.url.path}", code="not_found"))
        self.app.add_exception_handler(405, lambda r, e: error(405, f"{r.method} not allowed on {r.url.path}"))

    # ----- edges -----

    def _authorized(self, request: Request) -> bool:
        if self._expected is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)

    async def _guarded(self, request: Request, handle: Callable[[Any, str], Any]) -> Response:
        if not self._authorized(request):
            return error(401, "missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                         kind="authentication_error", code="invalid_api_key")
        try:
            body = await _read_json(request)
            episode = request.headers.get(EPISODE_HEADER, "")
            if len(episode.encode()) > MAX_ID_BYTES:
                raise BadRequest(f"{EPISODE_HEADER} is at most {MAX_ID_BYTES} bytes", EPISODE_HEADER)
            return await handle(body, episode)
        except BadRequest as e:
            return error(400, str(e), param=e.param)
        except ValueError as e:  # the engine's own bounds (validate_request) and template errors
            return error(400, str(e))
        except RuntimeError as e:  # the engine stopped
            return error(503, str(e), kind="server_error")

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error(401, "missing or invalid bearer token", kind="authentication_error", code="invalid_api_key")
        e = self.engine
        return JSONResponse({"object": "list", "data": [{
            "id": e.model_name, "object": "model", "created": 0, "owned_by": "arlo",
            "policy_version": e.version, "max_model_len": e.max_seq_len}]})

    async def chat(self, request: Request) -> Response:
        return await self._guarded(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, self._completion)

    # ----- requests -----

    async def _chat(self, body: Any, episode: str) -> Response:
        req = parse_chat(body)
        episode = episode or req.sampling.episode
        branches = self.recorder.branches(episode) if episode else []
        prompt, continued, keys = render.build_prompt(self.tok, req.messages, req.tools, branches)
        call = _Call(kind="chat", prompt=prompt, request=self._sampling_request(prompt, req.sampling, episode),
                     sampling=req.sampling, episode=episode, continued=continued, chat=req, keys=keys)
        return await self._respond(call)

    async def _completion(self, body: Any, episode: str) -> Response:
        req: CompletionRequest = parse_completion(body)
        prompt = list(req.prompt) if isinstance(req.prompt, tuple) else self.tok.encode(req.prompt)
        episode = episode or req.sampling.episode
        call = _Call(kind="completion", prompt=prompt, request=self._sampling_request(prompt, req.sampling, episode),
                     sampling=req.sampling, episode=episode)
        return await self._respond(call)

    def _sampling_request(self, prompt: list[int], s: Sampling, episode: str) -> SamplingRequest:
        room = self.engine.max_seq_len - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; the context holds {self.engine.max_seq_len}",
                             "messages")
        max_tokens = s.max_tokens if s.max_tokens is not None else min(self.engine.config.max_tokens, room)
        return SamplingRequest(prompt=tuple(prompt), n=s.n, max_tokens=max_tokens, temperature=s.temperature,
                               top_p=s.top_p, seed=s.seed, stop_token_ids=tuple(self.tok.stop_token_ids),
                               stop_strings=s.stop, session_id=episode if s.n == 1 else "")

    async def _respond(self, call: _Call) -> Response:
        bridge = Bridge()
        handle = self.engine.submit(call.request, on_tokens=bridge.put if call.sampling.stream else None,
                                    on_done=bridge.put)
        if call.sampling.stream:
            return StreamingResponse(self._stream(call, handle.id, bridge), media_type="text/event-stream")
        try:
            result = await bridge.queue.get()
        except asyncio.CancelledError:
            self.engine.cancel(handle.id)
            raise
        if isinstance(result, BaseException):
            return error(500, f"generation failed: {result}", kind="server_error")
        choices = [self._choice(call, i, s) for i, s in enumerate(result)]
        self._record(call, result, [m for _, m in choices])
        return JSONResponse({**self._head(call, streaming=False), "choices": [c for c, _ in choices],
                             "usage": _usage(call.prompt, result)})

    def _head(self, call: _Call, *, streaming: bool) -> dict[str, Any]:
        kind = "chat.completion" if call.kind == "chat" else "text_completion"
        prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind + (".chunk" if streaming else ""),
                "created": int(time.time()), "model": self.engine.model_name,
                "system_fingerprint": f"arlo-v{self.engine.version}"}

    def _choice(self, call: _Call, index: int, s: Sample) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(the choice's JSON, the assistant message a later call may send back) for one sample."""
        text = render.reply_text(self.tok, s.token_ids, call.sampling.stop, s.finish_reason)
        finish = _FINISH[s.finish_reason]
        if call.chat is None:
            lps = render.completion_logprobs(self.tok, s.token_ids, s.logprobs) if call.sampling.logprobs else None
            return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}, None
        message, has_calls = render.chat_message(text, call.chat.tools, call.chat.parse_tools, self.tool_format)
        lps = render.chat_logprobs(self.tok, s.token_ids, s.logprobs) if call.sampling.logprobs else None
        return {"index": index, "message": message, "logprobs": lps,
                "finish_reason": "tool_calls" if has_calls else finish}, message

    def _record(self, call: _Call, samples: list[Sample], messages: list[dict[str, Any] | None]) -> None:
        if not call.episode:
            return
        stops, eos = self.tok.stop_token_ids, self.tok.eos_id
        branches: list[Branch] = []
        if call.chat is not None:
            branches = [render.branch(call.keys, call.chat.tools, m,
                                      render.closed_turn(call.prompt, s.token_ids, stops, eos))
                        for s, m in zip(samples, messages, strict=True) if m is not None]
        self.recorder.record(call.episode, RecordedCall(
            prompt_token_ids=tuple(call.prompt), kind=call.kind, continued=call.continued, created_at=time.time(),
            choices=tuple(RecordedChoice(token_ids=tuple(s.token_ids), logprobs=tuple(s.logprobs),
                                         policy_versions=tuple(s.policy_versions), finish_reason=s.finish_reason)
                          for s in samples)), branches)

    # ----- streaming -----

    async def _stream(self, call: _Call, request_id: int, bridge: Bridge) -> AsyncIterator[str]:
        head = self._head(call, streaming=True)
        n = call.request.n
        # Text that might be the start of a stop string waits; with tools the whole reply waits,
        # since a tool call is only known once it is complete.
        hold = max((len(s) for s in call.sampling.stop), default=1) - 1
        buffer_all = call.chat is not None and call.chat.parse_tools
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        sent = [0] * n
        finished = False
        try:
            if call.chat is not None:
                for i in range(n):
                    yield _sse({**head, "choices": [_delta(call, i, {"role": "assistant", "content": ""})]})
            while True:
                item = await bridge.queue.get()
                if isinstance(item, BaseException):
                    yield _sse({"error": {"message": f"generation failed: {item}", "type": "server_error"}})
                    return
                if not isinstance(item, TokenDelta):  # every sample is done: the list of them
                    finished = True
                    self._record(call, item, [self._choice(call, i, s)[1] for i, s in enumerate(item)])
                    break
                i = item.sample
                tokens[i] += item.token_ids
                logprobs[i] += item.logprobs
                lps = None
                if call.sampling.logprobs:
                    lps = (render.chat_logprobs if call.chat else render.completion_logprobs)(
                        self.tok, item.token_ids, item.logprobs)
                if item.finish_reason is None:
                    if buffer_all:
                        continue
                    text = self.tok.decode(tokens[i]).rstrip("\ufffd")
                    upto = len(text) - hold
                    if upto > sent[i] or lps:
                        yield _sse({**head, "choices": [_delta(call, i, text[sent[i]:upto], lps)]})
                        sent[i] = max(sent[i], upto)
                    continue
                final = Sample(token_ids=tokens[i], logprobs=logprobs[i], policy_versions=[], finish_reason=item.finish_reason)
                choice, message = self._choice(call, i, final)
                text = render.reply_text(self.tok, tokens[i], call.sampling.stop, item.finish_reason)
                last: Any = text[sent[i]:]
                if buffer_all and message is not None:
                    last = {k: v for k, v in message.items() if k != "role"}
                    for j, c in enumerate(last.get("tool_calls") or ()):
                        c["index"] = j
                yield _sse({**head, "choices": [_delta(call, i, last, lps)]})
                yield _sse({**head, "choices": [_delta(call, i, {} if call.chat else "", None,
                                                       choice["finish_reason"])]})
            if call.sampling.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(call.prompt, item)})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away, or generation failed
                self.engine.cancel(request_id)


def _delta(call: _Call, index: int, content: Any, logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
    if call.chat is None:
        return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish}
    delta = content if isinstance(content, dict) else {"content": content}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(prompt: list[int], samples: list[Sample]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


async def _read_json(request: Request) -> Any:
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None



def bind(host: str, port: int) -> socket.socket:
    """The endpoint's listening socket, bound now: port 0 is known and a busy port fails at start-up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the service owns SIGTERM/SIGINT, not uvicorn
        yield


async def serve_openai(endpoint: OpenAIEndpoint, sock: socket.socket, *, cert_file: str = "",
                       key_file: str = "", grace_s: float = 5.0) -> None:
    """Serves on `sock` until cancelled; then stops accepting and lets open requests finish."""
    config = uvicorn.Config(endpoint.app, log_level="warning", access_log=False, lifespan="off", backlog=2048,
                            ssl_certfile=cert_file or None, ssl_keyfile=key_file or None,
                            timeout_graceful_shutdown=max(int(grace_s), 1))
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="openai-http")
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(task, grace_s + 1)
        raise
    finally:
        sock.close()
