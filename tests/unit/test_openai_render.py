"""The pure parts of the OpenAI endpoint and black-box assembly: tool calls parsed into OpenAI
`tool_calls`, prompts continued from earlier tokens, episode records bounded, trajectories
assembled from recorded calls."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arlo.model.tokenizer import ASSISTANT, EOS, TOOL, USER, ByteTokenizer
from services.inference import openai_render as render
from services.inference.episodes import EpisodeRecorder, RecordedCall
from services.inference.openai_requests import BadRequest, parse_chat, parse_completion
from services.rollout.agent import Turn
from services.rollout.blackbox import Call, assemble, load_agent

TOK = ByteTokenizer()
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]}}}]


def test_a_hermes_call_in_the_text_becomes_openai_tool_calls() -> None:
    message, has_calls = render.chat_message('let me <tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>',
                                             TOOLS, parse=True)
    assert has_calls and message["content"] == "let me"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"e": "2*3"}
    llama, has = render.chat_message('{"name": "calc", "parameters": {"e": "1"}}', TOOLS, parse=True)
    assert has and llama["content"] is None and json.loads(llama["tool_calls"][0]["function"]["arguments"]) == {"e": "1"}


def test_a_call_that_fails_its_schema_or_tool_choice_none_stays_text() -> None:
    bad = '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    assert render.chat_message(bad, TOOLS, parse=True) == ({"role": "assistant", "content": bad}, False)
    good = '<tool_call>{"name": "calc", "arguments": {"e": "1"}}</tool_call>'
    assert render.chat_message(good, TOOLS, parse=False) == ({"role": "assistant", "content": good}, False)


def test_a_reply_sent_back_verbatim_continues_from_its_exact_tokens() -> None:
    messages = [{"role": "user", "content": "2*3?"}]
    prompt, continued, keys = render.build_prompt(TOK, messages, TOOLS, [])
    assert not continued and prompt == render.encode_conversation(TOK, messages, TOOLS)
    sampled = [0xFF, 0xFE, 7]  # bytes that would not survive a decode/encode round trip
    reply, _ = render.chat_message('<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>', TOOLS, True)
    branch = render.branch(keys, TOOLS, reply, render.closed_turn(prompt, sampled, TOK.stop_token_ids, TOK.eos_id))
    # The SDK sends the message back with extra None fields and the arguments re-serialised.
    echoed = {**reply, "refusal": None, "tool_calls": [{**reply["tool_calls"][0], "function": {
        "name": "calc", "arguments": '{"e":"2*3"}'}}]}
    follow = [*messages, echoed, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "6"}]
    prompt2, continued2, _ = render.build_prompt(TOK, follow, TOOLS, [branch])
    assert continued2 and prompt2 == [*prompt, *sampled, EOS, TOOL, *TOK.encode("6"), EOS, ASSISTANT]
    edited = [*messages, {**reply, "content": "something else"}, follow[2]]
    assert not render.build_prompt(TOK, edited, TOOLS, [branch])[1]  # a rewritten reply renders afresh
    assert not render.build_prompt(TOK, follow, [], [branch])[1]  # other tools: afresh


def test_reply_text_cuts_the_stop_string_as_openai_does() -> None:
    ids = TOK.encode("abc STOP def")
    assert render.reply_text(TOK, ids, ["STOP"], "stop") == "abc "
    assert render.reply_text(TOK, ids, ["STOP"], "length") == "abc STOP def"


def test_request_parsing_names_the_field() -> None:
    ok = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stop": "x",
                     "seed": 3, "user": "ep"})
    assert ok.sampling.stop == ("x",) and ok.sampling.seed == 3 and ok.sampling.episode == "ep"
    for body, param in [({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, "tool_choice"),
                        ({"messages": [{"role": "user", "content": "a"}], "stop": [""]}, "stop"),
                        ({"messages": [{"role": "user", "content": "a"}], "seed": -1}, "seed"),
                        ({"messages": [{"role": "user", "content": "a"}], "user": "u" * 200}, "user")]:
        with pytest.raises(BadRequest) as e:
            parse_chat(body)
        assert e.value.param == param
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    with pytest.raises(BadRequest, match="echo"):
        parse_completion({"prompt": "a", "echo": True})


def test_top_logprobs_parse_in_openai_bounds_and_render_in_openai_shapes() -> None:
    chat = {"messages": [{"role": "user", "content": "a"}]}
    assert parse_chat({**chat, "logprobs": True, "top_logprobs": 20}).sampling.top_logprobs == 20
    assert parse_chat({**chat, "logprobs": True}).sampling.top_logprobs == 0
    for body, param in [({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({**chat, "top_logprobs": 2}, "logprobs"),  # as OpenAI: needs logprobs: true
                        ({"prompt": "a", "logprobs": 6}, "logprobs"), ({"prompt": "a", "logprobs": True}, "logprobs")]:
        with pytest.raises(BadRequest) as e:
            (parse_chat if "messages" in body else parse_completion)(body)
        assert e.value.param == param
    legacy = parse_completion({"prompt": "a", "logprobs": 5}).sampling
    assert legacy.logprobs and legacy.top_logprobs == 5 and legacy.top_logprobs_param == "logprobs"

    ids, lps = TOK.encode("ab"), [-0.5, -1.5]
    top_ids = np.array([[ids[0], ids[1]], [ids[0], TOK.encode("c")[0]]], np.int32)  # "b" is not in the second's
    top_lps = np.array([[-0.5, -2.0], [-0.25, -1.0]], np.float32)
    content = render.chat_logprobs(TOK, ids, lps, top_ids, top_lps)["content"]
    assert content[0]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                          {"token": "b", "logprob": -2.0, "bytes": [98]}]
    assert [e["token"] for e in content[1]["top_logprobs"]] == ["a", "c"]
    assert render.chat_logprobs(TOK, ids, lps)["content"][0]["top_logprobs"] == []
    legacy_lps = render.completion_logprobs(TOK, ids, lps, top_ids, top_lps)
    # OpenAI's legacy shape: {text: logprob} of the K best, plus the sampled token when it is not among them.
    assert legacy_lps["top_logprobs"] == [{"a": -0.5, "b": -2.0}, {"a": -0.25, "c": -1.0, "b": -1.5}]
    assert render.completion_logprobs(TOK, ids, lps)["top_logprobs"] is None


def call(prompt: list[int]) -> RecordedCall:
    return RecordedCall(prompt_token_ids=tuple(prompt), choices=(), kind="chat", continued=False, created_at=0.0)


def test_episode_records_are_bounded_per_episode_in_count_and_in_time() -> None:
    now = [0.0]
    rec = EpisodeRecorder(max_episodes=2, max_calls=2, ttl_s=10.0, clock=lambda: now[0])
    for _ in range(3):
        rec.record("a", call([1]), [])
    log = rec.take("a", keep=True)
    assert log is not None and len(log.calls) == 2 and log.dropped == 1
    rec.record("b", call([2]), [])
    rec.record("c", call([3]), [])  # a third episode: the least recently used ("a") goes
    assert rec.take("a") is None and len(rec) == 2
    now[0] = 11.0
    assert rec.take("b") is None and rec.take("c") is None and rec.evicted == 3
    rec.record("d", call([4]), [])
    assert rec.take("d") is not None and rec.take("d") is None  # taken means forgotten


def turn(ids: list[int], version: int = 3) -> Turn:
    return Turn(token_ids=ids, logprobs=[-0.5] * len(ids), policy_versions=[version] * len(ids), finished_by_stop=True)


def test_assembly_extends_one_sequence_and_starts_a_segment_when_history_changes() -> None:
    one = Call(prompt=(1, 2), choices=(turn([9, EOS], 2), turn([8, EOS], 2)))
    two = Call(prompt=(1, 2, 8, EOS, USER, 5), choices=(turn([6, EOS]),))  # built on choice 2 of call 1
    built = assemble([one, two])
    assert built is not None and built.segments == 1 and built.turns == 2 and built.prompt_length == 2
    b = built.builder
    assert b.tokens == [1, 2, 8, EOS, USER, 5, 6, EOS]
    assert b.mask == [0, 0, 1, 1, 0, 0, 1, 1] and b.versions == [-1, -1, 2, 2, -1, -1, 3, 3]
    fresh = assemble([one, two, Call(prompt=(4,), choices=(turn([7]),))])
    assert fresh is not None and fresh.segments == 2 and fresh.builder.tokens == [4, 7] and fresh.turns == 1
    assert assemble([]) is None


def test_a_bad_agent_spec_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_agent("no_such_module:run")
    with pytest.raises(ValueError, match=r"must name an `async def run\(task, client\)`"):
        load_agent("json:dumps")
    assert load_agent("examples.openai_agent.agent:run").__name__ == "run"
