"""The OpenAI endpoint of a real inference service returns `tool_calls` for a Qwen3-Coder, Mistral
and Gemma model: each a real checkpoint (tests/support/scripted_model.py) with the family's
tokenizer and chat template whose greedy reply is that family's tool call, driven by the real
`openai` client; the reply sent back with the tool's result is rendered in the family's format."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import openai
import pytest

from arlo.proto.v1 import inference_pb2
from tests.support.openai_server import TOKEN, inference_service
from tests.support.scripted_model import write_scripted_checkpoint

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="session")]

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
# Each family's call to calc("2*7"), as pieces the scripted model writes one token each (no piece
# twice: Gemma's second string quote goes with the brace after it).
SCRIPTS = {
    "qwen3_coder": ["Let me compute.\n", "<tool_call>", "\n<function=calc>\n<parameter=expression>\n2*7\n"
                    "</parameter>\n</function>\n", "</tool_call>"],
    "mistral": ["[TOOL_CALLS]", ' [{"name": "calc", "arguments": {"expression": "2*7"}}]'],
    "gemma": ["Let me compute.", "<|tool_call>", "call:calc{expression:", '<|"|>', "2*7", '<|"|>}', "<tool_call|>"],
}


@pytest.mark.parametrize("family", sorted(SCRIPTS))
async def test_the_endpoint_returns_the_familys_tool_calls(family: str, tmp_path: Path, redis_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_scripted_checkpoint(tmp_path / family, family, SCRIPTS[family])
    model = {"path": str(path), "tool_format": family, "max_seq_len": 1024}
    async with inference_service(monkeypatch, redis_url, f"tools-{uuid.uuid4().hex[:8]}", model=model,
                                 max_batch=1, max_n=1, max_tokens=12, max_prompt_tokens=768,
                                 warmup_programs=0) as served:
        client = openai.AsyncOpenAI(base_url=served.openai_url, api_key=TOKEN, max_retries=0)
        messages: list[dict] = [{"role": "user", "content": "What is 2*7?"}]
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,
                                                     max_tokens=12, user="ep-1")
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calc"
        assert json.loads(call.function.arguments) == {"expression": "2*7"}
        assert choice.message.content == (None if family == "mistral" else "Let me compute.")
        if family == "mistral":  # the only ids Mistral's template takes back
            assert len(call.id) == 9 and call.id.isalnum()

        # Streaming gives the same call.
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=12, stream=True)]
        streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or ())]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [("calc", {"expression": "2*7"})]

        # The reply sent back with the result: the template renders the call and the result.
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "14"}]
        again = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,
                                                     max_tokens=12, user="ep-1")
        assert again.choices[0].message.tool_calls
        record = await served.stub.GetEpisode(inference_pb2.GetEpisodeRequest(episode_id="ep-1"))
        first, second = record.calls
        assert len(second.prompt_token_ids) > len(first.prompt_token_ids)
        # The second prompt continues the first's exact tokens, but for Gemma 4, whose template writes
        # a result only inside the calling turn: that conversation is rendered whole instead.
        assert second.continued == (family != "gemma")
        if second.continued:
            assert list(second.prompt_token_ids[:len(first.prompt_token_ids)]) == list(first.prompt_token_ids)
