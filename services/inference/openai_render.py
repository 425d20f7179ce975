"""OpenAI chat messages <-> the served model's tokens and replies. Pure.

Prompts: a conversation is rendered with the served tokenizer's chat template. Tools go to
the template when `encode_messages` takes `tools=`, and so do an assistant message's tool calls
and a tool result's id and name: the template writes them in the family's own format (Hermes,
Llama 3 JSON, Qwen3-Coder XML, Mistral [TOOL_CALLS], Gemma call:NAME{...}). Otherwise (the byte
tokenizer) tools become a system message in the Hermes format (`<tool_call>{"name": ...,
"arguments": ...}</tool_call>`), the format `tool_calls.py` parses back, and an assistant's tool
calls are rendered as that same markup.

Replies: the text is read for tool calls in `model.tool_format` ("auto": any format). A call's id
is what the family's template accepts back: Mistral's refuse any but 9 alphanumerics.

Token-exact continuation: when a call's messages are an earlier reply's conversation plus
that reply as it was returned plus new messages, the prompt is that earlier sequence's
exact tokens followed by only the new messages, encoded turn by turn (what the rollout's
own agent loop does). The model's own tokens are never re-tokenized, so the trajectory the
rollout assembles equals what was sampled. Any other call is rendered from its start.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from arlo.jsonfields import loads_bounded
from arlo.model.tokenizer import Tokenizer
from arlo.tool_calls import ToolCall, parse_tool_calls
from services.inference.episodes import Branch

TOOLS_PREAMBLE = ("Tools:\n<tools>\n{tools}\n</tools>\n"
                  'Call: <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>')
"""Kept short, with each tool as its compact `function` object: it is in every prompt of a
tool-using episode, and the byte model's whole context is 256 tokens."""


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _calls(message: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    out = []
    for c in message.get("tool_calls") or ():
        fn = c["function"]
        try:
            args = loads_bounded(fn.get("arguments") or "{}")  # a client's string: 100k deep stays a string
        except json.JSONDecodeError:
            args = fn.get("arguments")
        out.append((str(c.get("id", "")), fn["name"], args))
    return out


def canonical(message: Mapping[str, Any]) -> str:
    """One message as a string two equal messages share, whatever the SDK added (None fields,
    refusal, annotations) or how it ordered keys."""
    return json.dumps([message["role"], content_text(message.get("content")), _calls(message),
                       str(message.get("tool_call_id") or ""), str(message.get("name") or "")],
                      sort_keys=True, separators=(",", ":"))


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True, separators=(",", ":"))


def _chat_pair(message: Mapping[str, Any]) -> tuple[str, str]:
    role = "system" if message["role"] == "developer" else message["role"]
    text = content_text(message.get("content"))
    calls = "".join(f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'
                    for _, name, args in _calls(message))
    return role, f"{text}\n{calls}" if text and calls else text + calls


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it (transformers' convention): tool calls with their
    arguments as an object, a tool result with its call's id and name."""
    out: dict[str, Any] = {"role": "system" if message["role"] == "developer" else message["role"],
                           "content": content_text(message.get("content"))}
    calls = _calls(message)
    if calls:
        out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                             for i, name, args in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = str(message[key])
    return out


def _accepts_tools(tok: Tokenizer) -> bool:
    # The byte tokenizer takes tools= but ignores them (its presets learn a tool's syntax from
    # demonstrations); tools then go into the prompt as the preamble, so a client's schemas are seen.
    return bool(getattr(tok, "renders_tools", False))


def _template_messages(tok: Tokenizer, messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    if _accepts_tools(tok):
        return [_template_message(m) for m in messages]
    return [_chat_pair(m) for m in messages]


def encode_conversation(tok: Tokenizer, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]]) -> list[int]:
    chat = _template_messages(tok, messages)
    if tools and _accepts_tools(tok):
        return tok.encode_messages(chat, add_generation_prompt=True, add_bos=True, tools=list(tools))  # type: ignore[call-arg]
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools))
        if chat and chat[0][0] == "system":
            chat[0] = ("system", f"{chat[0][1]}\n\n{preamble}")
        else:
            chat.insert(0, ("system", preamble))
    return tok.encode_messages(chat, add_generation_prompt=True, add_bos=True)


def build_prompt(tok: Tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                 branches: Sequence[Branch]) -> tuple[list[int], bool, tuple[str, ...]]:
    """(prompt ids, continued, the conversation's key); see the module docstring."""
    keys = tuple(canonical(m) for m in messages)
    tkey = tools_key(tools)
    best: Branch | None = None
    for b in branches:
        n = len(b.key) - 1
        if b.key[-1] == tkey and n < len(keys) and keys[:n] == b.key[:-1] and (best is None or n > len(best.key) - 1):
            best = b
    if best is None:
        return encode_conversation(tok, messages, tools), False, keys
    tail = _template_messages(tok, messages[len(best.key) - 1:])
    try:
        added = tok.encode_messages(tail, add_generation_prompt=True, add_bos=False)
    except ValueError:  # a template that cannot be encoded turn by turn: render it whole
        return encode_conversation(tok, messages, tools), False, keys
    return list(best.tokens) + added, True, keys


def branch(keys: tuple[str, ...], tools: Sequence[Mapping[str, Any]], reply: Mapping[str, Any],
           tokens: Sequence[int]) -> Branch:
    return Branch(key=(*keys, canonical(reply), tools_key(tools)), tokens=tuple(tokens))


def closed_turn(prompt: Sequence[int], sampled: Sequence[int], stop_ids: Sequence[int], eos_id: int) -> list[int]:
    """The sequence after a reply: a turn the model did not end itself (length, stop string)
    is closed with the end-of-turn token, as context, the way the template would."""
    tail = [] if sampled and sampled[-1] in stop_ids else [eos_id]
    return [*prompt, *sampled, *tail]


def reply_text(tok: Tokenizer, sampled: Sequence[int], stop: Sequence[str], finish: str) -> str:
    """What the client sees: special tokens dropped, and (as OpenAI does) the stop string and
    anything after it cut."""
    text = tok.decode(sampled)
    if stop and finish == "stop":
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        if cuts:
            text = text[:min(cuts)]
    return text


def chat_message(text: str, tools: Sequence[Mapping[str, Any]], parse: bool,
                 tool_format: str = "auto") -> tuple[dict[str, Any], bool]:
    """The assistant message for `text` and whether it holds tool calls. A call that does not
    parse or fails its schema stays in the text: the agent sees what the model wrote."""
    if parse:
        turn = parse_tool_calls(text, tools, format=tool_format)
        good = [c for c in turn.calls if isinstance(c, ToolCall)]
        if good:
            return {"role": "assistant", "content": turn.text or None, "tool_calls": [
                {"id": call_id(turn.format), "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in good]}, True
    return {"role": "assistant", "content": text}, False


def call_id(tool_format: str) -> str:
    """A new tool call's id, in the form the format's chat templates take back."""
    if tool_format == "mistral":  # Mistral's templates raise on any id but 9 alphanumerics
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_logprobs(tok: Tokenizer, ids: Sequence[int], logprobs: Sequence[float],
                  top_ids: np.ndarray | None = None, top_logprobs: np.ndarray | None = None) -> dict[str, Any]:
    """Chat's `logprobs`: per token its text, logprob and bytes, and `top_logprobs`, the request's K
    most likely tokens at that position, most likely first ([] without: K = 0)."""
    entries = []
    for i, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
        top = [] if top_ids is None or top_logprobs is None else [
            _token(tok, int(t), float(v)) for t, v in zip(top_ids[i], top_logprobs[i], strict=True)]
        entries.append({**_token(tok, token, lp), "top_logprobs": top})
    return {"content": entries}


def _token(tok: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    piece = tok.decode([token])
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def completion_logprobs(tok: Tokenizer, ids: Sequence[int], logprobs: Sequence[float],
                        top_ids: np.ndarray | None = None, top_logprobs: np.ndarray | None = None) -> dict[str, Any]:
    """Legacy completions' `logprobs`. `top_logprobs` is OpenAI's legacy shape: per position a
    {token text: logprob} of the K most likely tokens plus the sampled one (so up to K + 1 keys);
    None without (K = 0). Two ids that decode to the same text keep the likelier's logprob."""
    pieces = [tok.decode([i]) for i in ids]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    top = None
    if top_ids is not None and top_logprobs is not None:
        top = []
        for i, (piece, lp) in enumerate(zip(pieces, logprobs, strict=True)):
            alternatives: dict[str, float] = {}
            for t, v in zip(top_ids[i], top_logprobs[i], strict=True):
                alternatives.setdefault(tok.decode([int(t)]), float(v))
            alternatives.setdefault(piece, lp)
            top.append(alternatives)
    return {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}
