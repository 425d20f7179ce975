"""OpenAI request bodies -> checked records, with errors that name the field. Pure.

Only what the engine can honour is accepted: a field it cannot (a penalty, `echo`,
`tool_choice` naming a function; more top logprobs than inference.max_top_logprobs, checked by
the endpoint, which knows the setting) is a 400 naming it, never silently ignored, so an agent
learns at once that the server differs from OpenAI. Unknown fields are ignored, as
OpenAI-compatible servers do (SDKs add new ones all the time).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.inference.requests import MAX_STOP_STRINGS

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MESSAGES = 512
MAX_TOOLS = 128
MAX_ID_BYTES = 128
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's bounds: chat `top_logprobs` in [0, 20], legacy completions `logprobs` in [0, 5]."""
MAX_COMPLETION_LOGPROBS = 5


class BadRequest(ValueError):
    """A client error: the HTTP layer answers 400 with OpenAI's error JSON naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    n: int
    max_tokens: int | None
    """None: as many as the context and inference.max_tokens allow."""
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    top_logprobs: int
    """Alternatives per token (chat `top_logprobs`, completions `logprobs`); 0: the sampled token's alone."""
    top_logprobs_param: str
    """The field that asked for them, for an error that names it."""
    stream: bool
    include_usage: bool
    episode: str
    """From the `user` field; the X-Arlo-Episode header wins over it."""
    model: str = ""
    """The request's `model`: on a service shared by several runs, a run_id picks that run's adapter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...]
    parse_tools: bool
    """False for tool_choice "none": the reply is text even when it looks like a call."""
    sampling: Sampling


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]
    sampling: Sampling


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"messages has {len(messages)} entries; at most {MAX_MESSAGES}", "messages")
    for i, m in enumerate(messages):
        _check_message(m, f"messages[{i}]")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("parameters", {}), dict)):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                             f'"parameters": {{...}}}}}}', f"tools[{i}]")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise BadRequest('tool_choice: only "auto" and "none" are supported', "tool_choice")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be a boolean", "logprobs")
    top = body.get("top_logprobs")
    top = 0 if top is None else _int(top, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top and not logprobs:  # as OpenAI: alternatives come with the sampled token's logprob
        raise BadRequest("top_logprobs needs logprobs: true", "logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(messages=tuple(messages), tools=tuple(tools), parse_tools=bool(tools) and choice != "none",
                       sampling=_sampling(body, max_tokens=max_tokens, logprobs=logprobs, top=top,
                                          top_param="top_logprobs"))


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise BadRequest("prompt must be a string, or one list of token ids (one prompt per request)", "prompt")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")
    if body.get("echo"):
        raise BadRequest("echo is not supported", "echo")
    if body.get("suffix"):
        raise BadRequest("suffix is not supported", "suffix")
    # Legacy `logprobs: K`: the sampled token's logprob and, for K > 0, the K most likely alternatives.
    logprobs = body.get("logprobs")
    top = 0 if logprobs is None else _int(logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(prompt=prompt, sampling=_sampling(body, max_tokens=body.get("max_tokens", 16),
                                                               logprobs=logprobs is not None, top=top,
                                                               top_param="logprobs"))


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _check_message(m: Any, where: str) -> None:
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object with role and content", where)
    if m.get("role") not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {m.get('role')!r}", f"{where}.role")
    content = m.get("content")
    ok = content is None or isinstance(content, str) or (
        isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                          and isinstance(p.get("text"), str) for p in content))
    if not ok:
        raise BadRequest(f"{where}.content must be a string or a list of text parts (no images or audio)",
                         f"{where}.content")
    if content is None and not m.get("tool_calls"):
        raise BadRequest(f"{where}.content is required (it may be null only beside tool_calls)", f"{where}.content")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list) or (calls and m["role"] != "assistant"):
        raise BadRequest(f"{where}.tool_calls must be a list, on an assistant message", f"{where}.tool_calls")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", ""), str)):
            raise BadRequest(f"{where}.tool_calls[{j}] must have function.name and function.arguments (a JSON string)",
                             f"{where}.tool_calls[{j}]")


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _int(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}], got {value!r}", key)
    return value


def _sampling(body: Mapping[str, Any], *, max_tokens: Any, logprobs: bool, top: int, top_param: str) -> Sampling:
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key):
            raise BadRequest(f"{key} is not supported (send 0 or leave it out)", key)
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported", "logit_bias")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    user = body.get("user") or ""
    if not isinstance(user, str) or len(user.encode()) > MAX_ID_BYTES:
        raise BadRequest(f"user must be a string of at most {MAX_ID_BYTES} bytes", "user")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    seed = body.get("seed")
    model = body.get("model") or ""
    if not isinstance(model, str) or len(model.encode()) > MAX_ID_BYTES:
        raise BadRequest(f"model must be a string of at most {MAX_ID_BYTES} bytes", "model")
    return Sampling(
        n=_int(body.get("n", 1), "n", 1, 1 << 16),
        max_tokens=None if max_tokens is None else _int(max_tokens, "max_tokens", 1, 1 << 30),
        temperature=_number(body, "temperature", 1.0, 0.0, 10.0), top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        stop=tuple(stop), seed=None if seed is None else _int(seed, "seed", 0, 2**64 - 1), logprobs=logprobs,
        top_logprobs=top, top_logprobs_param=top_param, stream=stream,
        include_usage=bool(options.get("include_usage")), episode=user, model=model,
    )
