"""`arith` with its calculator tool, the held-out split, and the SFT demonstrator: the demo's task."""

from __future__ import annotations

import json
import random

import pytest

from services.env_gateway.envs.arith import ArithEnv, demonstration, in_split
from services.env_gateway.envs.base import Message

TOOL = {"op": "*", "max_operand": 30, "tool": True, "max_turns": 2}


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.removesuffix("=").split("*")
    return int(a), int(b)


def test_calc_is_answered_by_a_tool_message_then_the_answer_scores() -> None:
    env = ArithEnv()
    a, b = operands(env.reset(5, TOOL).observation[0].content)
    call = env.step(f"calc {a}*{b}")
    assert not call.done and call.reward == 0.0
    assert call.observation == [Message(role="tool", name="calc", content=str(a * b))]
    assert call.info == {"turns": 1, "tool_call": True}
    final = env.step(str(a * b))
    assert final.done and final.reward == 1.0 and final.answer == str(a * b)


def test_a_bad_expression_is_an_error_message_not_a_crash() -> None:
    env = ArithEnv()
    env.reset(5, TOOL)
    (reply,) = env.step("calc 3+").observation
    assert reply.role == "tool" and reply.content.startswith("error: ")


def test_calling_the_tool_on_the_last_turn_ends_unanswered() -> None:
    env = ArithEnv()
    env.reset(5, {**TOOL, "max_turns": 1})
    step = env.step("calc 1*1")
    assert step.done and step.reward == 0.0 and step.info["correct"] is False


def test_without_tool_calc_is_not_an_answer() -> None:
    env = ArithEnv()
    env.reset(5, {**TOOL, "tool": False})
    step = env.step("calc 1*1")
    assert not step.done and step.observation == [Message(role="user", content="answer with a number")]


def test_splits_partition_the_operand_pairs() -> None:
    pairs = [(a, b) for a in range(31) for b in range(31)]
    held_out = {p for p in pairs if in_split(*p, "eval")}
    train = {p for p in pairs if in_split(*p, "train")}
    assert held_out and train and not held_out & train and held_out | train == set(pairs)
    assert 0.08 < len(held_out) / len(pairs) < 0.18
    for seed in range(200):
        for split, part in (("eval", held_out), ("train", train)):
            assert operands(ArithEnv().reset(seed, {**TOOL, "split": split}).observation[0].content) in part


@pytest.mark.parametrize("config", [{"split": "test"}, {"split": "eval", "max_operand": 2}])
def test_bad_split_config_is_refused(config: dict) -> None:
    with pytest.raises(ValueError, match="split"):
        ArithEnv().reset(0, config)


def test_demonstrations_follow_the_env_and_are_imperfect() -> None:
    rng = random.Random(0)
    demos = [demonstration(seed, {**TOOL, "split": "train"}, tool_prob=0.3, rng=rng) for seed in range(400)]
    with_tool = [d for d in demos if len(d) == 4]
    assert 0.2 < len(with_tool) / len(demos) < 0.4
    correct_guesses = 0
    for demo in demos:
        env = ArithEnv()
        seed = demos.index(demo)
        assert env.reset(seed, {**TOOL, "split": "train"}).observation[0].content == demo[0][1]
        steps = [env.step(content) for role, content in demo if role == "assistant"]
        if len(demo) == 4:  # replaying the demonstration through the env reproduces its tool reply
            assert steps[0].observation[0].content == demo[2][1] and steps[-1].reward == 1.0
        else:
            correct_guesses += steps[-1].reward == 1.0
    assert correct_guesses < 0.5 * (len(demos) - len(with_tool))  # estimates are mostly wrong


@pytest.mark.parametrize("text", [
    '<tool_call>\n{{"name": "calc", "arguments": {{"expression": "{e}"}}}}\n</tool_call>',  # Qwen2.5 (Hermes)
    '{{"name": "calc", "parameters": {{"expression": "{e}"}}}}',  # Llama 3.1 JSON
    '<|python_tag|>{{"name": "calc", "parameters": {{"expression": "{e}"}}}}<|eom_id|>',
])
def test_structured_tool_calls_in_both_families_formats_are_answered(text: str) -> None:
    env = ArithEnv()
    reset = env.reset(5, TOOL)
    (tool,) = json.loads(reset.tools_json)
    assert tool["function"]["name"] == "calc"  # advertised for the model's chat template
    a, b = operands(reset.observation[0].content)
    call = env.step(text.format(e=f"{a}*{b}"))
    assert not call.done and call.observation == [Message(role="tool", name="calc", content=str(a * b))]
    assert env.step(str(a * b)).reward == 1.0


def test_a_malformed_tool_call_is_answered_with_what_was_wrong() -> None:
    env = ArithEnv()
    env.reset(5, {**TOOL, "max_turns": 3})
    (reply,) = env.step('<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>').observation
    assert reply.role == "tool" and reply.name == "calc" and "expression" in reply.content
    (reply,) = env.step('<tool_call>{"name": "sqrt", "arguments": {}}</tool_call>').observation
    assert "unknown tool 'sqrt'" in reply.content


def test_without_tool_no_tools_are_advertised_and_calls_are_answers() -> None:
    env = ArithEnv()
    assert env.reset(5, {**TOOL, "tool": False}).tools_json == "[]"
    step = env.step('{"name": "calc", "parameters": {"expression": "1+1"}}')
    assert step.observation == [Message(role="user", content="answer with a number")]


def test_the_calc_schema_shows_no_expression_a_copy_could_take_for_the_question() -> None:
    """The schema is in every tools prompt (Qwen's system prompt lists it), and the tool call must
    copy the question's operands. With `e.g. "12*7"` in it, a 0.36M-parameter Qwen2 in the Qwen2.5
    tools format (examples/own_format) never learned the copy: its SFT plateaued at 0.82 of the
    target tokens, 0 held-out rows exact after 600 steps, calls with operands taken from the
    example; without it, 0.8 of the held-out rows exact by step 300."""
    import re

    from services.env_gateway.envs.arith import TOOLS
    from services.env_gateway.tool_schema import tools_json

    assert not re.search(r"\d\s*[-+*/%]+\s*\d", tools_json(TOOLS))
