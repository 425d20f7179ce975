"""`letter_count`: an environment shipped as a plugin (docs/environments.md shows this file verbatim).

Register it with `env_gateway.plugins: [{name: letter_count, target: examples.env_plugin.letter_count:SPEC}]`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import (
    EpisodeOverError,
    Message,
    ResetResult,
    StepResult,
    check_range,
    describe_config,
    parse_config,
)
from services.env_gateway.spec import EnvSpec
from services.env_gateway.tool_calls import BadToolCall, error_message, parse_tool_calls
from services.env_gateway.tool_schema import function_tool, tools_json

NAME = "letter_count"
SENTENCES = ("the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
             "sphinx of black quartz judge my vow")
TOOLS = (function_tool("count", "Count how often `letter` occurs in `text`.",
                       {"text": {"type": "string", "maxLength": 1000},
                        "letter": {"type": "string", "minLength": 1, "maxLength": 1}}),)


@dataclass(frozen=True, kw_only=True, slots=True)
class LetterCountConfig:
    max_turns: int = 3
    """Turns before the episode ends unanswered."""

    def validate(self) -> None:
        check_range("max_turns", self.max_turns, 1, 10)  # ValueError -> INVALID_ARGUMENT, naming the key


class LetterCountEnv:
    """Count a letter in a sentence."""

    # Read when a plugin's target is this class instead of SPEC.
    config_type, tools, max_turns = LetterCountConfig, TOOLS, 10

    def __init__(self) -> None:
        self._cfg = LetterCountConfig()
        self._reference = ""
        self._turns = 0
        self._done = True

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        self._cfg = parse_config(LetterCountConfig, config, NAME)  # unknown keys, wrong types -> ValueError
        rng = random.Random(seed)  # the same seed gives the same task
        sentence, letter = rng.choice(SENTENCES), rng.choice("aeiou")
        self._reference = str(sentence.count(letter))
        self._turns, self._done = 0, False
        prompt = f"How many times does the letter '{letter}' occur in: {sentence}?"
        return ResetResult(observation=[Message(role="user", content=prompt)],
                           task_id=f"{NAME}-{SENTENCES.index(sentence)}-{letter}", tools_json=tools_json(TOOLS))

    def step(self, action: str) -> StepResult:
        if self._done:
            raise EpisodeOverError("the episode is over; call Reset")  # -> FAILED_PRECONDITION
        self._turns += 1
        parsed = parse_tool_calls(action, TOOLS)
        if parsed.calls and self._turns < self._cfg.max_turns:
            # Each call gets its result, or a message saying what was wrong with it.
            replies = [error_message(c) if isinstance(c, BadToolCall) else self._count(c.arguments)
                       for c in parsed.calls]
            return StepResult(observation=replies, done=False, info={"turns": self._turns})
        # Plain text is the final answer; a tool call on the last turn leaves none.
        answer = "" if parsed.calls else (last_integer(parsed.text) or "")
        self._done = True
        return StepResult(observation=[], done=True, reward=float(answer == self._reference), answer=answer,
                          reference=self._reference, info={"turns": self._turns})

    def _count(self, arguments: dict[str, Any]) -> Message:
        return Message(role="tool", name="count", content=str(arguments["text"].count(arguments["letter"])))


SPEC = EnvSpec(name=NAME, description=f"Count a letter in a sentence. Config: {describe_config(LetterCountConfig)}.",
               factory=lambda ctx: LetterCountEnv(), config_type=LetterCountConfig, tools=TOOLS,
               max_turns=10)
