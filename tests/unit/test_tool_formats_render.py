"""Where arlo renders tool calls and results for the Qwen3-Coder, Mistral and Gemma families: the
OpenAI door's prompt (a client's conversation, as transformers' apply_chat_template renders it),
its reply (calls read in the family's format, ids its template takes back), and the rollout's
turn-by-turn encoding of tool results."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from arlo.model.hf_tokenizer import HFTokenizer
from arlo.tool_schema import function_tool
from services.inference import openai_render as render
from tests.support.tool_templates import write_tool_tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [function_tool("calc", "Evaluate.", {"expression": {"type": "string"}, "digits": {"type": "integer"}})]
REPLIES = {  # what each family's model writes for one call
    "qwen3_coder": "<tool_call>\n<function=calc>\n<parameter=expression>\n2*7\n</parameter>\n<parameter=digits>\n"
                   "2\n</parameter>\n</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "2*7", "digits": 2}}]',
    "gemma": '<|tool_call>call:calc{digits:2,expression:<|"|>2*7<|"|>}<tool_call|>',
}


@pytest.fixture(scope="module", params=sorted(REPLIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param)
    write_tool_tokenizer(path, request.param)
    return request.param, path


def test_the_doors_reply_reads_the_familys_call_and_its_prompt_renders_it_back(family: tuple[str, Path]) -> None:
    name, path = family
    for fmt in (name, "auto"):
        message, has_calls = render.chat_message(REPLIES[name], TOOLS, True, fmt)
        (call,) = message["tool_calls"]
        assert has_calls and message["content"] is None
        assert call["function"]["name"] == "calc"
        assert json.loads(call["function"]["arguments"]) == {"expression": "2*7", "digits": 2}
        assert re.fullmatch(r"[0-9a-f]{9}" if name == "mistral" else r"call_[0-9a-f]{24}", call["id"])
    # The client sends the reply back with the tool's result: the prompt is the family's template
    # over the conversation, the call and the result in its own format.
    user = {"role": "user", "content": "2*7?"}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "14"}
    prompt = render.encode_conversation(HFTokenizer.from_dir(path), [user, message, result], TOOLS)
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    hf_call = {**call, "function": {"name": "calc", "arguments": {"expression": "2*7", "digits": 2}}}
    expected = hf.apply_chat_template([user, {"role": "assistant", "content": "", "tool_calls": [hf_call]}, result],
                                      tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert HFTokenizer.from_dir(path).encode(expected) == prompt


def test_a_call_the_family_does_not_write_stays_text(family: tuple[str, Path]) -> None:
    name, _ = family
    other = REPLIES["gemma" if name != "gemma" else "mistral"]
    assert render.chat_message(other, TOOLS, True, name) == ({"role": "assistant", "content": other}, False)


def test_the_rollouts_tool_results_continue_the_conversation_in_the_familys_format(family: tuple[str, Path]) -> None:
    """The rollout's observations are (role, name, content): no call id, given after the model's
    own tokens. Mistral's template needs an id (a placeholder is given); Gemma 4's writes a result
    only inside the calling turn, so it is refused with a message rather than dropped."""
    name, path = family
    tok = HFTokenizer.from_dir(path)
    observation = [{"role": "tool", "name": "calc", "content": "14"}]
    if name == "gemma":
        with pytest.raises(ValueError, match="drops a tool result"):
            tok.render_messages(observation, add_generation_prompt=True, add_bos=False, tools=TOOLS)
        return
    text = tok.render_messages(observation, add_generation_prompt=True, add_bos=False, tools=TOOLS)
    assert text == {"qwen3_coder": "\n<|im_start|>user\n<tool_response>\n14\n</tool_response>\n<|im_end|>\n"
                                   "<|im_start|>assistant\n",
                    "mistral": '[TOOL_RESULTS] {"content": 14, "call_id": "call00000"}[/TOOL_RESULTS]'}[name]


@pytest.mark.parametrize(("tool_format", "read"), [("auto", True), ("gemma", True), ("mistral", False)])
def test_the_gateways_environments_read_calls_in_the_configured_format(tool_format: str, read: bool) -> None:
    from services.env_gateway.registry import EnvContext, default_registry

    registry = default_registry(EnvContext(tool_format=tool_format))
    env = registry.create(registry.get("calculator"))  # type: ignore[arg-type]
    env.reset(0, {})
    step = env.step('Let me check. <|tool_call>call:calculator{expression:<|"|>6*7<|"|>}<tool_call|>')
    if read:
        assert [(m.role, m.content) for m in step.observation] == [("tool", "42")] and not step.done
    else:  # not a call in Mistral's format: the turn is plain text (its last number, 7, the answer)
        assert step.done and not any(m.role == "tool" for m in step.observation)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_a_malformed_call_stays_the_replys_text(name: str) -> None:
    cut = REPLIES[name][: len(REPLIES[name]) * 2 // 3]  # the turn ended inside the call
    for fmt in (name, "auto"):
        assert render.chat_message(cut, TOOLS, True, fmt) == ({"role": "assistant", "content": cut}, False)
