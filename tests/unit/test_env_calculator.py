"""The `calculator` environment and its ast-based evaluator (no eval, bounded sizes)."""

from __future__ import annotations

import json
import re
import time

import pytest

from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import EpisodeOverError
from services.env_gateway.envs.calculator import TOOLS, CalculatorConfig, CalculatorEnv, make_task
from services.env_gateway.envs.safe_eval import EvalError, evaluate, format_number


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": {json.dumps(expression)}}}}}</tool_call>'


@pytest.mark.parametrize(("expression", "value"), [
    ("4821 * 337 + 9152 * 46", 4821 * 337 + 9152 * 46), ("-(3 - 10) ** 2", -49), ("7 / 2", 3.5),
    ("7 // 2", 3), ("-7 % 3", 2), ("2 ** -1", 0.5), ("1,234 + 1", 1235), ("  +5 ", 5), ("2 ** 1000", 2**1000),
    ("0.1 + 0.2", 0.1 + 0.2),
])
def test_evaluate_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "fragment"), [
    ("__import__('os').system('true')", "a function call is not allowed"),
    ("x + 1", "name 'x' is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("'a' * 3", "constant 'a' is not allowed"),
    ("[1, 2]", "List is not allowed"), ("max(1, 2)", "a function call"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("3 ^ 2", "write ** for powers"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("9 ** 9 ** 9", "exponent 387420489 is too large"),
    ("2 ** 1024 * 2 ** 1024 * 2 ** 1024", "too large"),
    ("99999999999 ** 999", "too large"),
    ("10.0 ** 400", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not a valid expression"),
    ("", "empty"),
    ("1+" * 300 + "1", "characters; the limit is 500"),
    ("(" * 240 + "1" + ")" * 240, "not a valid expression"),
    ("-" * 250 + "1", "parts; the limit is 200"),
], ids=lambda v: v[:20] if isinstance(v, str) else None)
def test_evaluate_refuses_with_a_reason(expression: str, fragment: str) -> None:
    started = time.monotonic()
    with pytest.raises(EvalError, match=re.escape(fragment)):
        evaluate(expression)
    assert time.monotonic() - started < 0.5  # refused before any expensive work


def test_format_number() -> None:
    assert [format_number(v) for v in (12, 3.0, 2.5, -0.0, 1e20)] == ["12", "3", "2.5", "0", "1e+20"]


@pytest.mark.parametrize(("text", "value"), [
    ("The answer is 1,234,567.", "1234567"), ("so 12 then 34", "34"), ("-0012", "-12"), ("none", None),
    ("\\boxed{42}", "42"), ("-0", "0"),
])
def test_last_integer(text: str, value: str | None) -> None:
    assert last_integer(text) == value


def test_tasks_are_deterministic_and_sized_by_config() -> None:
    cfg = CalculatorConfig(num_terms=3, min_digits=3, max_digits=4)
    text, total = make_task(5, cfg)
    assert make_task(5, cfg) == (text, total) and make_task(6, cfg) != (text, total)
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    assert len(numbers) == 6 and all(100 <= n <= 9999 for n in numbers)
    assert evaluate(text) == total


def started(seed: int = 0, **config: object) -> tuple[CalculatorEnv, str, int]:
    env = CalculatorEnv()
    reset = env.reset(seed, config)
    expression = reset.observation[0].content.removeprefix("Compute ").split(".")[0]
    assert json.loads(reset.tools_json) == list(TOOLS)
    return env, expression, int(evaluate(expression))


def test_tool_then_plain_text_answer() -> None:
    env, expression, total = started(seed=1)
    step = env.step(f"I will use the tool. {call(expression)}")
    assert not step.done and step.reward == 0.0
    (reply,) = step.observation
    assert reply.role == "tool" and reply.name == "calculator" and reply.content == str(total)
    final = env.step(f"The result is {total:,}.")
    assert final.done and final.reward == 1.0 and final.answer == final.reference == str(total)
    assert final.info == {"turns": 2, "tool_calls": 1, "correct": True, "out_of_turns": False}
    with pytest.raises(EpisodeOverError):
        env.step("1")


def test_answer_tool_and_several_calls_per_turn() -> None:
    env, _, total = started(seed=2)
    step = env.step(call("2+2") + call("3*3") + call("1/0"))
    assert [m.content for m in step.observation] == ["4", "9", "error: division by zero"]
    wrong = env.step(f'<tool_call>{{"name": "answer", "arguments": {{"value": {total + 1}}}}}</tool_call>')
    assert wrong.done and wrong.reward == 0.0 and wrong.answer == str(total + 1) and wrong.reference == str(total)


def test_malformed_call_is_an_observation_and_the_episode_goes_on() -> None:
    env, _, _ = started(seed=3)
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>')
    (reply,) = step.observation
    assert not step.done and reply.role == "tool"
    assert "unexpected argument(s) ['expr']" in reply.content and "missing required" in reply.content
    step = env.step("hmm, let me think")
    assert not step.done and "as a number" in step.observation[0].content


def test_out_of_turns_ends_unanswered() -> None:
    env, expression, _ = started(seed=4, max_turns=2)
    assert not env.step(call(expression)).done
    last = env.step(call(expression))
    assert last.done and last.reward == 0.0 and last.answer == "" and last.info["out_of_turns"]


@pytest.mark.parametrize(("config", "fragment"), [
    ({"num_terms": 0}, "num_terms must be in [1, 10]"), ({"max_digits": 1}, "max_digits must be in [2, 9]"),
    ({"max_turns": 99}, "max_turns"), ({"num_terms": "3"}, "num_terms must be int"), ({"digits": 3}, "unknown key(s) ['digits']"),
])
def test_bad_config_names_the_key(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"calculator config: {fragment}")):
        CalculatorEnv().reset(0, config)
