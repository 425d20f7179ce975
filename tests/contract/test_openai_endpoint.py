"""The OpenAI-compatible endpoint of a real inference service (start_inference, ephemeral ports)
driven by the real `openai` client: chat, tools, streaming, completions, models, auth, bad
input, and the per-episode token records that black-box training is built on."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from arlo.model.tokenizer import ASSISTANT, BOS, EOS, TOOL, USER, ByteTokenizer
from arlo.proto.v1 import inference_pb2
from tests.support.openai_server import TOKEN, Served

TOK = ByteTokenizer()
# One server for both OpenAI modules (tests/contract/conftest.py).
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture
def served(openai_served: Served) -> Served:
    return openai_served


def client(served: Served, episode: str = "", api_key: str = TOKEN) -> openai.AsyncOpenAI:
    headers = {"X-Arlo-Episode": episode} if episode else None
    return openai.AsyncOpenAI(base_url=served.openai_url, api_key=api_key, default_headers=headers, max_retries=0)


async def episode(served: Served, episode_id: str, keep: bool = False) -> inference_pb2.GetEpisodeResponse:
    return await served.stub.GetEpisode(inference_pb2.GetEpisodeRequest(episode_id=episode_id, keep=keep))


async def test_models_lists_the_served_model_and_its_version(served: Served) -> None:
    assert served.openai_url.startswith("http://127.0.0.1:") and served.openai_url.endswith("/v1")
    models = (await client(served).models.list()).data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["policy_version"] == served.engine.version == 0


async def test_chat_records_exact_tokens_and_continues_a_conversation_from_them(served: Served) -> None:
    c = client(served, episode="ep-chat")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, logprobs=True, seed=3)
    choice = first.choices[0]
    assert first.object == "chat.completion" and choice.message.role == "assistant"
    assert first.usage.prompt_tokens == len(TOK.encode_messages([("system", "be brief"), ("user", "hi")],
                                                                add_generation_prompt=True, add_bos=True))
    lps = [e.logprob for e in choice.logprobs.content]
    assert len(lps) == first.usage.completion_tokens and all(lp <= 0 for lp in lps)

    follow = [*messages, choice.message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    second = await c.chat.completions.create(model="tiny", messages=follow, max_tokens=8)
    record = await episode(served, "ep-chat")
    one, two = record.calls
    assert list(one.prompt_token_ids) == TOK.encode_messages([("system", "be brief"), ("user", "hi")],
                                                             add_generation_prompt=True, add_bos=True)
    sampled = list(one.choices[0].token_ids)
    assert list(one.choices[0].logprobs) == pytest.approx(lps)
    assert list(one.choices[0].policy_versions) == [0] * len(sampled)
    assert TOK.decode(sampled) == choice.message.content
    # The second prompt is the first prompt + the model's own tokens (closed with EOS when it
    # ran out of tokens) + only the new user turn: nothing re-tokenized.
    closed = sampled if sampled[-1] == EOS else [*sampled, EOS]
    assert two.continued and not one.continued
    assert list(two.prompt_token_ids) == [*one.prompt_token_ids, *closed, USER, *TOK.encode("and?"), EOS, ASSISTANT]
    assert second.usage.prompt_tokens == len(two.prompt_token_ids)
    assert (await episode(served, "ep-chat")).calls == []  # fetched once, then forgotten


async def test_tools_render_in_the_prompt_and_tool_messages_reach_the_model(served: Served) -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
        "e": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "2*3?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "calc", "arguments": '{"e": "2*3"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "6"}]
    reply = await client(served).chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=4,
                                                         user="ep-tools")
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = TOK.decode((await episode(served, "ep-tools")).calls[0].prompt_token_ids)
    assert '"name":"calc"' in prompt and "<tools>" in prompt  # the schema, in the system turn
    assert '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>' in prompt
    ids = (await client(served).chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                        user="ep-tools2")).usage.prompt_tokens
    assert ids > 0 and TOOL in (await episode(served, "ep-tools2")).calls[0].prompt_token_ids


async def test_streaming_sends_the_same_text_as_a_plain_call_with_the_same_seed(served: Served) -> None:
    c = client(served, episode="ep-stream")
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 20, "seed": 11}
    plain = await c.chat.completions.create(**kwargs)
    chunks = [ch async for ch in await c.chat.completions.create(**kwargs, stream=True,
                                                                 stream_options={"include_usage": True})]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    calls = (await episode(served, "ep-stream")).calls
    assert len(calls) == 2 and calls[0].choices[0].token_ids == calls[1].choices[0].token_ids


async def test_a_stop_string_ends_the_reply_before_it(served: Served) -> None:
    c = client(served)
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 30, "seed": 5}
    full = (await c.chat.completions.create(**kwargs)).choices[0].message.content
    stop = next(ch for ch in full[2:] if ch.isprintable() and ch != "\ufffd")
    cut = await c.chat.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]


async def test_completions_take_text_or_token_ids_and_return_logprobs(served: Served) -> None:
    c = client(served, episode="ep-cmpl")
    text = await c.completions.create(model="tiny", prompt="abc", max_tokens=6, logprobs=1, seed=2)
    ids = await c.completions.create(model="tiny", prompt=TOK.encode("abc"), max_tokens=6, logprobs=1, seed=2)
    assert text.choices[0].text == ids.choices[0].text and text.usage.prompt_tokens == 3
    assert len(text.choices[0].logprobs.token_logprobs) == text.usage.completion_tokens
    calls = (await episode(served, "ep-cmpl")).calls
    assert [c.kind for c in calls] == ["completion", "completion"]
    assert list(calls[0].prompt_token_ids) == TOK.encode("abc")
    several = await c.completions.create(model="tiny", prompt="x", max_tokens=3, n=3)
    assert sorted(ch.index for ch in several.choices) == [0, 1, 2]


def _one_id(text: str) -> bool:
    """Text only one byte-tokenizer id decodes to (special tokens decode to "", lone high bytes to U+FFFD)."""
    return len(text) == 1 and text.isascii() and text.isprintable()


async def test_top_logprobs_come_with_each_token_most_likely_first(served: Served) -> None:
    """The served engine returns up to inference.max_top_logprobs (5 here) alternatives per token,
    under the distribution the token was drawn from: the sampled token, when among them, has its
    own logprob. More than that is a 400 naming the field, in chat and in legacy completions."""
    c = client(served)
    messages = [{"role": "user", "content": "hi"}]
    reply = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=4, logprobs=True,
                                            top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens > 0
    for e in entries:
        alternatives = e.top_logprobs
        assert len(alternatives) == 3
        assert [a.logprob for a in alternatives] == sorted((a.logprob for a in alternatives), reverse=True)
        assert all(a.bytes == list(a.token.encode()) for a in alternatives)
        same = [a for a in alternatives if a.token == e.token]
        if same and _one_id(e.token):
            assert same[0].logprob == pytest.approx(e.logprob, abs=1e-6)
    greedy = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=2)
    for e in greedy.choices[0].logprobs.content:  # greedy: the token is the likeliest
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
    streamed = [ch async for ch in await c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, seed=4, logprobs=True, top_logprobs=3, stream=True)]
    alternatives = [[a.logprob for a in e.top_logprobs] for ch in streamed if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content]
    assert alternatives == [[a.logprob for a in e.top_logprobs] for e in entries]
    legacy = await c.completions.create(model="tiny", prompt="abc", max_tokens=5, logprobs=2, seed=2)
    lps = legacy.choices[0].logprobs
    for token, lp, top in zip(lps.tokens, lps.token_logprobs, lps.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and (token not in top or not _one_id(token) or top[token] == pytest.approx(lp, abs=1e-6))
    with pytest.raises(openai.BadRequestError) as bad:
        await c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, logprobs=True, top_logprobs=20)
    assert bad.value.body["param"] == "top_logprobs" and "inference.max_top_logprobs" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        await c.completions.create(model="tiny", prompt="abc", max_tokens=2, logprobs=6)
    assert bad.value.body["param"] == "logprobs"


async def test_the_bearer_token_is_required(served: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as bad:
        await client(served, api_key="wrong").models.list()
    assert bad.value.status_code == 401 and bad.value.body["code"] == "invalid_api_key"
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"{served.openai_url}/chat/completions", json={"messages": []})
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 99}, "temperature", "[0.0, 10.0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, None, "max_tokens must be in"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 99}, None, "n must be in [1, 4]"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages", "the context holds"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 6}, "top_logprobs",
     "raise inference.max_top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "logprobs", "needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]", "function"),
])
async def test_bad_input_is_a_400_naming_the_field(served: Served, body: dict, param: str | None, says: str) -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        reply = await http.post(f"{served.openai_url}/chat/completions", json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert err["type"] == "invalid_request_error" and says in err["message"] and err["param"] == param


async def test_malformed_json_and_unknown_routes_answer_in_openai_error_shape(served: Served) -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        broken = await http.post(f"{served.openai_url}/chat/completions", content=b"{nope")
        missing = await http.get(f"{served.openai_url}/embeddings")
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.BadRequestError):
        await client(served).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                     presence_penalty=1.0)


async def test_prompt_bound_and_first_token_are_those_of_the_template(served: Served) -> None:
    reply = await client(served, episode="ep-bos").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=2)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert (await episode(served, "ep-bos", keep=True)).calls[0].prompt_token_ids[0] == BOS
    assert len((await episode(served, "ep-bos")).calls) == 1  # keep=True left it there
