"""Qwen3-Coder, Mistral and Gemma tool calls: each family's chat template (rendered by transformers'
apply_chat_template) writes an assistant's tool calls, arlo's tokenizer encodes and decodes that
text, and arlo's parser reads back the same calls; malformed calls become errors, never raise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from arlo.model.hf_tokenizer import HFTokenizer
from arlo.tool_calls import FORMATS, BadToolCall, ToolCall, parse_tool_calls
from arlo.tool_schema import function_tool
from tests.support.tool_templates import write_tool_tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [
    function_tool("calc", "Evaluate an arithmetic expression.", {
        "expression": {"type": "string", "description": "e.g. 2*3"}, "digits": {"type": "integer"},
        "exact": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object"}}, required=["expression"]),
    function_tool("lookup", "Find a word.", {"word": {"type": "string"}}),
]
CALLS = [ToolCall(name="calc", arguments={"expression": "2*(3+4), then {x}: \"q\"", "digits": 3, "exact": True,
                                          "tags": ["a", "b c"], "opts": {"mode": "fast", "n": 2.5}}),
         ToolCall(name="lookup", arguments={"word": "multi\nline"})]
IDS = ["aB3dE6gH9", "zY8xW7vU6"]  # Mistral's templates require 9 alphanumerics
FAMILIES = ["qwen3_coder", "mistral", "gemma"]


def assistant(content: str | None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in zip(IDS, CALLS, strict=True)]}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param)
    write_tool_tokenizer(path, request.param)
    return request.param, path


def test_a_call_the_template_renders_is_read_back_equal(family: tuple[str, Path]) -> None:
    name, path = family
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    content = None if name == "mistral" else "Let me compute that."  # Mistral's template writes calls alone
    messages = [{"role": "user", "content": "What is 2*(3+4)?"}, assistant(content)]
    prompt = hf.apply_chat_template(messages[:1], tools=TOOLS, tokenize=False)
    full = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    # What the model wrote, as arlo's tokenizer gives it back: its ids decoded, markup kept.
    tok = HFTokenizer.from_dir(path)
    text = tok.decode(tok.encode(full[len(prompt):]))
    for fmt in (name, "auto"):
        turn = parse_tool_calls(text, TOOLS, format=fmt)
        assert list(turn.calls) == CALLS and turn.format == name, (fmt, text)
        assert turn.text.endswith(content or "")
    # Another format's reader finds no call in it.
    other = next(f for f in FAMILIES if f != name)
    assert parse_tool_calls(text, TOOLS, format=other).calls == ()


def test_arlo_renders_calls_and_results_as_transformers_does(family: tuple[str, Path]) -> None:
    """The OpenAI door and the rollout render history with arlo's template engine: tool calls
    and tool results come out in the family's own format, as transformers writes them."""
    _, path = family
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    tok = HFTokenizer.from_dir(path)
    messages = [{"role": "user", "content": "What is 2*(3+4)?"}, assistant(None),
                {"role": "tool", "tool_call_id": IDS[0], "name": "calc", "content": "14"},
                {"role": "tool", "tool_call_id": IDS[1], "name": "lookup", "content": "a word"},
                {"role": "assistant", "content": "It is 14."}]
    for n in (2, 4, 5):
        expected = hf.apply_chat_template(messages[:n], tools=TOOLS, tokenize=False)
        assert tok.render_messages(messages[:n], add_generation_prompt=False, add_bos=True, tools=TOOLS) == expected


def test_decode_keeps_tool_markup_but_drops_other_special_tokens(tmp_path: Path) -> None:
    write_tool_tokenizer(tmp_path, "gemma")
    tok = HFTokenizer.from_dir(tmp_path)
    text = '<|turn>model\n<|tool_call>call:lookup{word:<|"|>x<|"|>}<tool_call|><turn|>'
    assert tok.decode(tok.encode(text)) == 'model\n<|tool_call>call:lookup{word:<|"|>x<|"|>}<tool_call|>'


@pytest.mark.parametrize(("fmt", "text", "says"), [
    ("qwen3_coder", "<tool_call>\n<parameter=word>\nx\n</parameter>\n</tool_call>", "has no <function=NAME>"),
    ("qwen3_coder", "<tool_call>\n<function=lookup>\n<parameter=word>\nx", "not closed with </parameter>"),
    ("qwen3_coder", "<tool_call>\n<function=lookup>\n<parameter=word>\nx\n</parameter>\n<parameter=word>\ny\n"
                    "</parameter>\n</function>\n</tool_call>", "given twice"),
    ("qwen3_coder", "<tool_call>\n<function=calc>\n<parameter=expression>\n1\n</parameter>\n<parameter=digits>\n"
                    "three\n</parameter>\n</function>\n</tool_call>", "calc arguments.digits must be integer"),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n</function>\n</tool_call>", "unknown tool 'nope'"),
    ("mistral", '[TOOL_CALLS] [{"name": "lookup", "arguments": {"word": "x"}', "not valid JSON"),
    ("mistral", "[TOOL_CALLS] [1]", 'must be an object with "name"'),
    ("mistral", '[TOOL_CALLS] [{"name": "lookup", "arguments": "{bad"}]', "not valid JSON"),
    ("mistral", "[TOOL_CALLS]lookup{}", "NAME[ARGS]"),
    ("mistral", '[TOOL_CALLS]lookup[ARGS]{"word": }', "after [ARGS] are not valid JSON"),
    ("mistral", '[TOOL_CALLS] [{"name": "calc", "arguments": {"digits": 1}}]', "missing required argument"),
    ("gemma", "<|tool_call>lookup{word:1}<tool_call|>", "is not call:NAME{...}"),
    ("gemma", '<|tool_call>call:lookup{word:<|"|>x}<tool_call|>', "is not closed"),
    ("gemma", "<|tool_call>call:lookup{word:x}<tool_call|>", "'x' is not a number"),
    ("gemma", "<|tool_call>call:lookup{word 1}<tool_call|>", "expected : after key 'word'"),
    ("gemma", "<|tool_call>call:lookup{word:" + "[" * 80 + "<tool_call|>", "nesting deeper than 64"),
    ("gemma", "<|tool_call>call:lookup{word:1}<tool_call|>", "lookup arguments.word must be string"),
    ("gemma", "<start_function_call>call:lookup{word:<escape>x}<end_function_call>", "<escape> is not closed"),
])
def test_malformed_calls_become_errors_that_say_what_is_wrong(fmt: str, text: str, says: str) -> None:
    (call,) = parse_tool_calls(text, TOOLS, format=fmt).calls
    assert isinstance(call, BadToolCall) and says in call.error, call
    (call,) = parse_tool_calls(text, TOOLS).calls  # "auto" may read it as another format, but never as a call
    assert isinstance(call, BadToolCall), call


def test_what_each_reader_accepts_beyond_the_template() -> None:
    # Qwen3-Coder without the <tool_call> wrapper, and a call the turn's end cut after </parameter>.
    for text in ("<function=lookup>\n<parameter=word>\nx\n</parameter>\n</function>",
                 "<tool_call>\n<function=lookup>\n<parameter=word>\nx\n</parameter>\n"):
        assert parse_tool_calls(text, TOOLS).calls == (ToolCall(name="lookup", arguments={"word": "x"}),)
    # Mistral's later tokenizers: one [TOOL_CALLS]NAME[ARGS]{...} per call, [CALL_ID] optional.
    turn = parse_tool_calls('[TOOL_CALLS]lookup[ARGS]{"word": "x"}[TOOL_CALLS]lookup[CALL_ID]aB3dE6gH9[ARGS]'
                            '{"word": "y"}</s>', TOOLS)
    assert [c.arguments for c in turn.calls] == [{"word": "x"}, {"word": "y"}]  # type: ignore[union-attr]
    # FunctionGemma's tokens, with text around the call.
    turn = parse_tool_calls("Sure. <start_function_call>call:lookup{word:<escape>a,b}<escape>}<end_function_call>"
                            " Done.", TOOLS)
    assert turn.calls == (ToolCall(name="lookup", arguments={"word": "a,b}"}),) and turn.text.split() == ["Sure.", "Done."]


def test_too_many_calls_and_plain_text() -> None:
    text = "".join("<|tool_call>call:lookup{word:<|\"|>w<|\"|>}<tool_call|>" for _ in range(3))
    calls = parse_tool_calls(text, TOOLS, max_calls=2).calls
    assert len(calls) == 3 and isinstance(calls[2], BadToolCall) and "more than 2" in calls[2].error
    for f in FORMATS:
        assert parse_tool_calls("The function=f(x) is {a} [b].", TOOLS, format=f).calls == ()
    with pytest.raises(ValueError, match="tool call format: expected one of"):
        parse_tool_calls("x", TOOLS, format="xml")


def test_model_tool_format_is_checked_at_load_naming_the_field() -> None:
    from arlo.config import load_config
    from arlo.config.base import ConfigError

    assert load_config(overrides={"model": {"tool_format": "mistral"}}).model.tool_format == "mistral"
    with pytest.raises(ConfigError, match=r"model\.tool_format: must be one of auto, hermes, .*gemma, got 'xml'"):
        load_config(overrides={"model": {"tool_format": "xml"}})


def test_no_text_makes_a_reader_raise() -> None:
    """Fragments of every format's markup in random order and length: each reader answers with
    calls or errors, never an exception (what reaches the door or an environment is any text)."""
    import random

    pieces = ["<tool_call>", "</tool_call>", "<function=calc>", "</function>", "<parameter=digits>", "</parameter>",
              "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call>", "<tool_call|>", '<|"|>', "call:calc{", "call:",
              "<start_function_call>", "<end_function_call>", "<escape>", "{", "}", "[", "]", ":", ",", '"', "\n",
              '{"name": "calc"', '"arguments": {', "expression", "3", "true", "None", "x y", "</s>"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        for fmt in FORMATS:
            turn = parse_tool_calls(text, TOOLS, format=fmt)
            assert all(isinstance(c, ToolCall | BadToolCall) for c in turn.calls)
