"""`calculator`: a sum of multi-digit products, hard in the head and easy with the tool.

The agent calls `calculator(expression)` (evaluated by `safe_eval`, never `eval`) as often as
it likes, then gives the final answer as plain text (its last integer) or via `answer(value)`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import Message, ResetResult, check_range, describe_config, parse_config
from services.env_gateway.envs.safe_eval import EvalError, evaluate, format_number
from services.env_gateway.envs.tool_env import Played, ToolEnv
from services.env_gateway.tool_calls import ParsedTurn, ToolCall
from services.env_gateway.tool_schema import function_tool, tools_json

NAME = "calculator"
MAX_TURNS = 32
TOOLS = (
    function_tool("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                  {"expression": {"type": "string", "maxLength": 500, "description": "e.g. \"4821 * 337 + 12\""}}),
    function_tool("answer", "Give the final answer and end the episode.",
                  {"value": {"type": ["integer", "string"], "description": "The final answer, a number."}}),
)
NO_NUMBER = "Give the final answer as a number, or call the calculator tool."


@dataclass(frozen=True, kw_only=True, slots=True)
class CalculatorConfig:
    num_terms: int = 3
    """Products summed in the task."""
    min_digits: int = 2
    max_digits: int = 4
    """Each factor has between min_digits and max_digits digits."""
    max_turns: int = 6

    def validate(self) -> None:
        check_range("num_terms", self.num_terms, 1, 10)
        check_range("min_digits", self.min_digits, 1, 9)
        check_range("max_digits", self.max_digits, self.min_digits, 9)
        check_range("max_turns", self.max_turns, 1, MAX_TURNS)


DESCRIPTION = ("Compute a sum of multi-digit products; tools calculator(expression) and answer(value); "
               f"the final answer may also be plain text. Config: {describe_config(CalculatorConfig)}.")


def make_task(seed: int, cfg: CalculatorConfig) -> tuple[str, int]:
    rng = random.Random(seed)

    def factor() -> int:
        digits = rng.randint(cfg.min_digits, cfg.max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    terms = [(factor(), factor()) for _ in range(cfg.num_terms)]
    signs = ["+"] + [rng.choice("+-") for _ in terms[1:]]
    text = " ".join(f"{s} {a} * {b}" for s, (a, b) in zip(signs, terms, strict=True)).removeprefix("+ ")
    total = sum((a * b) * (1 if s == "+" else -1) for s, (a, b) in zip(signs, terms, strict=True))
    return text, total


class CalculatorEnv(ToolEnv):
    TOOLS = TOOLS

    def __init__(self, *, tool_format: str = "auto") -> None:
        super().__init__(tool_format=tool_format)
        self._tool_calls = 0

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        cfg = parse_config(CalculatorConfig, config, NAME)
        expression, total = make_task(seed, cfg)
        self._reference = str(total)
        self._start(cfg.max_turns)
        self._tool_calls = 0
        prompt = (f"Compute {expression}. Use the calculator tool for the arithmetic, then give the final "
                  "answer as a number.")
        return ResetResult(observation=[Message(role="user", content=prompt)], task_id=f"{NAME}-{expression}",
                           tools_json=tools_json(TOOLS))

    def _plain(self, parsed: ParsedTurn, action: str) -> Played:
        answer = last_integer(parsed.text)
        return ([Message(role="user", content=NO_NUMBER)] if answer is None else []), answer

    def _call(self, call: ToolCall) -> Message:
        self._tool_calls += 1
        try:
            content = format_number(evaluate(call.arguments["expression"]))
        except EvalError as e:
            content = f"error: {e}"
        return Message(role="tool", name="calculator", content=content)

    def _info(self) -> dict[str, Any]:
        return {"turns": self._turns, "tool_calls": self._tool_calls}
