"""`arith`: a multi-turn arithmetic question. Short prompts, because the demo model is a tiny
byte-level model: the first observation is just "3+4="."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.base import EpisodeOverError, Message, ResetResult, StepResult, parse_config

NAME = "arith"
DESCRIPTION = "Answer 'a<op>b=' with an integer; 'no' after a wrong answer until max_turns. Config: " \
              "max_operand (int, default 9), max_turns (int, default 3), op ('+', '-' or '*')."
MAX_OPERAND = 1_000_000
MAX_TURNS = 16
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WRONG = "no"
NOT_A_NUMBER = "answer with a number"

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

    def validate(self) -> None:
        if not 0 <= self.max_operand <= MAX_OPERAND:
            raise ValueError(f"max_operand must be in [0, {MAX_OPERAND}], got {self.max_operand}")
        if not 1 <= self.max_turns <= MAX_TURNS:
            raise ValueError(f"max_turns must be in [1, {MAX_TURNS}], got {self.max_turns}")
        if self.op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {self.op!r}")


class ArithEnv:
    def __init__(self) -> None:
        self._result = ""
        self._max_turns = 0
        self._turns = 0
        self._done = True

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        cfg = parse_config(ArithConfig, config, NAME)
        rng = random.Random(seed)
        a = rng.randint(0, cfg.max_operand)
        b = rng.randint(0, cfg.max_operand)
        op = cfg.op
        self._result = str(OPS[op](a, b))
        self._max_turns = cfg.max_turns
        self._turns = 0
        self._done = False
        return ResetResult(observation=[Message(role="user", content=f"{a}{op}{b}=")], task_id=f"{NAME}-{a}{op}{b}")

    def step(self, action: str) -> StepResult:
        if self._done:
            raise EpisodeOverError("the episode is over; call Reset to start another")
        self._turns += 1
        answer = parse_answer(action)
        correct = answer == self._result
        out_of_turns = self._turns >= self._max_turns
        info = {"turns": self._turns, "correct": correct}
        if correct or out_of_turns:
            self._done = True
            return StepResult(observation=[], done=True, reward=1.0 if correct else 0.0,
                              answer=answer if answer is not None else action.strip(),
                              reference=self._result, info=info)
        reply = WRONG if answer is not None else NOT_A_NUMBER
        return StepResult(observation=[Message(role="user", content=reply)], done=False, info=info)
