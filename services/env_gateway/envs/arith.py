"""`arith`: a multi-turn arithmetic question. Short prompts, because the demo model is a tiny
byte-level model: the first observation is just "3+4=".

With `tool: true` the agent also has a calculator: an action `calc <expression>` is answered
by a "tool" message named "calc" holding the value (a turn of its own). The calculator is also
advertised as a `calc(expression)` function schema (ResetResult.tools_json, which the rollout
passes to the model's chat template), and a structured call to it in an open-model format
(`model.tool_format`: Hermes `<tool_call>{"name": "calc", "arguments": {...}}</tool_call>`, Llama 3.1
`{"name": "calc", "parameters": {...}}`, Qwen3-Coder, Mistral, Gemma) is answered the same way. Two-digit products are hard to
guess and easy with the tool, so this is the demo's agentic task: the policy must learn to
call the tool, copy the operands into the call and the result into its answer. `split`
partitions the operand pairs so a held-out evaluation never sees a pair trained on, and
`demonstration` writes the imperfect worked examples that SFT warm-starts from.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.base import EpisodeOverError, Message, ResetResult, StepResult, parse_config
from services.env_gateway.envs.safe_eval import EvalError, evaluate, format_number
from services.env_gateway.tool_calls import BadToolCall, error_message, parse_tool_calls
from services.env_gateway.tool_schema import function_tool, tools_json

NAME = "arith"
DESCRIPTION = "Answer 'a<op>b=' with an integer; 'no' after a wrong answer until max_turns. Config: " \
              "max_operand (int, default 9), max_turns (int, default 3), op ('+', '-' or '*'), " \
              "tool (bool: 'calc <expression>' or a calc(expression) tool call calls a calculator), split ('all', 'train' or 'eval')."
MAX_OPERAND = 1_000_000
MAX_TURNS = 16
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WRONG = "no"
NOT_A_NUMBER = "answer with a number"
TOOL_PREFIX = "calc"
TOOLS = (function_tool(TOOL_PREFIX, "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                       {"expression": {"type": "string", "maxLength": 200, "description": "the expression, as the question writes it"}}),)
SPLITS = ("all", "train", "eval")
EVAL_SHARE = 8
"""One operand pair in EVAL_SHARE belongs to the "eval" split."""

_LEADING_INT = re.compile(r"-?\d+")


def parse_answer(action: str) -> str | None:
    """The leading integer of `action` (after strip), canonical ("007" -> "7"), else None.

    Compared as text: int() refuses strings of more than 4300 digits, and actions may be 64 KiB.
    """
    match = _LEADING_INT.match(action.strip())
    if match is None:
        return None
    text = match.group()
    negative = text.startswith("-")
    digits = text.lstrip("-").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


@dataclass(frozen=True, kw_only=True, slots=True)
class ArithConfig:
    max_operand: int = 9
    """Operands are drawn from [0, max_operand]."""
    max_turns: int = 3
    """Answers allowed before the episode ends unsolved."""
    op: str = "+"
    """"+", "-" or "*"."""
    tool: bool = False
    """An action `calc <expression>`, or a structured calc(expression) tool call, is evaluated and
    answered as a "tool" message (using a turn)."""
    split: str = "all"
    """"train" or "eval": draw only operand pairs of that part of a fixed partition."""

    def validate(self) -> None:
        if not 0 <= self.max_operand <= MAX_OPERAND:
            raise ValueError(f"max_operand must be in [0, {MAX_OPERAND}], got {self.max_operand}")
        if not 1 <= self.max_turns <= MAX_TURNS:
            raise ValueError(f"max_turns must be in [1, {MAX_TURNS}], got {self.max_turns}")
        if self.op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {self.op!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {self.split!r}")
        if self.split != "all" and self.max_operand < 3:
            raise ValueError("split needs max_operand >= 3, so that both parts hold pairs")


def in_split(a: int, b: int, split: str) -> bool:
    """A fixed partition of operand pairs: held-out ("eval") pairs are never drawn for "train"."""
    held_out = (a * 7919 + b * 104_729) % EVAL_SHARE == 0
    return split == "all" or held_out == (split == "eval")


def draw_task(seed: int, cfg: ArithConfig) -> tuple[int, int]:
    rng = random.Random(seed)
    while True:  # rejection sampling: about EVAL_SHARE draws at most on average
        a = rng.randint(0, cfg.max_operand)
        b = rng.randint(0, cfg.max_operand)
        if in_split(a, b, cfg.split):
            return a, b


def demonstration(seed: int, config: Mapping[str, Any], *, tool_prob: float,
                  rng: random.Random) -> list[tuple[str, str]]:
    """A worked episode for SFT, from an imperfect demonstrator: with probability `tool_prob` it
    calls the calculator and copies the result; otherwise it answers a rough estimate (the
    result rounded to one significant digit), right only when rounding changes nothing."""
    cfg = parse_config(ArithConfig, config, NAME)
    a, b = draw_task(seed, cfg)
    question, result = f"{a}{cfg.op}{b}=", OPS[cfg.op](a, b)
    if cfg.tool and rng.random() < tool_prob:
        return [("user", question), ("assistant", f"{TOOL_PREFIX} {a}{cfg.op}{b}"), ("tool", str(result)),
                ("assistant", str(result))]
    return [("user", question), ("assistant", str(_estimate(result)))]


def _estimate(value: int) -> int:
    magnitude = 10 ** (len(str(abs(value))) - 1)
    return round(value / magnitude) * magnitude


class ArithEnv:
    def __init__(self, *, tool_format: str = "auto") -> None:
        self._tool_format = tool_format
        self._result = ""
        self._max_turns = 0
        self._turns = 0
        self._done = True
        self._tool = False

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        cfg = parse_config(ArithConfig, config, NAME)
        a, b = draw_task(seed, cfg)
        op = cfg.op
        self._tool = cfg.tool
        self._result = str(OPS[op](a, b))
        self._max_turns = cfg.max_turns
        self._turns = 0
        self._done = False
        return ResetResult(observation=[Message(role="user", content=f"{a}{op}{b}=")], task_id=f"{NAME}-{a}{op}{b}",
                           tools_json=tools_json(TOOLS) if cfg.tool else "[]")

    def step(self, action: str) -> StepResult:
        if self._done:
            raise EpisodeOverError("the episode is over; call Reset to start another")
        self._turns += 1
        out_of_turns = self._turns >= self._max_turns
        if self._tool and action.lstrip().startswith(TOOL_PREFIX):
            return self._calculate([action.lstrip()[len(TOOL_PREFIX):]], out_of_turns)
        calls = parse_tool_calls(action, TOOLS, format=self._tool_format).calls if self._tool else ()
        if calls:
            return self._calculate([c if isinstance(c, BadToolCall) else c.arguments["expression"] for c in calls],
                                   out_of_turns)
        answer = parse_answer(action)
        correct = answer == self._result
        info = {"turns": self._turns, "correct": correct}
        if correct or out_of_turns:
            self._done = True
            return StepResult(observation=[], done=True, reward=1.0 if correct else 0.0,
                              answer=answer if answer is not None else action.strip(),
                              reference=self._result, info=info)
        reply = WRONG if answer is not None else NOT_A_NUMBER
        return StepResult(observation=[Message(role="user", content=reply)], done=False, info=info)

    def _calculate(self, calls: list[str | BadToolCall], out_of_turns: bool) -> StepResult:
        """One "tool" message per call: an expression's value, or what was wrong with the call."""
        info = {"turns": self._turns, "tool_call": True}
        if out_of_turns:  # the last turn went to the tool: no answer given
            self._done = True
            return StepResult(observation=[], done=True, reward=0.0, answer="", reference=self._result,
                              info={**info, "correct": False})
        replies = []
        for call in calls:
            if isinstance(call, BadToolCall):
                replies.append(error_message(call))
                continue
            try:
                value = format_number(evaluate(call))
            except EvalError as e:
                value = f"error: {e}"
            replies.append(Message(role="tool", name=TOOL_PREFIX, content=value))
        return StepResult(observation=replies, done=False, info=info)
