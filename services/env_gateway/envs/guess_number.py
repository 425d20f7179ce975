"""`guess_number`: find a hidden integer from "higher"/"lower" hints. Multi-turn with a delayed
reward: nothing until the end, 1 for finding it within max_turns. Binary search needs
ceil(log2(high - low + 1)) guesses, so a good policy must plan over several turns."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import (
    Message,
    ResetResult,
    StepResult,
    check_range,
    describe_config,
    parse_config,
)
from services.env_gateway.envs.tool_env import Played, ToolEnv
from services.env_gateway.tool_calls import BadToolCall, ParsedTurn, ToolCall, error_message
from services.env_gateway.tool_schema import function_tool, tools_json

NAME = "guess_number"
MAX_TURNS = 64
MAX_RANGE = 10**9
TOOLS = (function_tool("guess", "Guess the hidden number.", {"number": {"type": "integer"}}),)
HIGHER, LOWER = "higher", "lower"
SPLITS = ("all", "train", "eval")
EVAL_SHARE = 8
"""One hidden number in EVAL_SHARE (one of any 8 consecutive ones) belongs to the "eval" split."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuessNumberConfig:
    low: int = 1
    high: int = 100
    """The hidden number is in [low, high]."""
    max_turns: int = 10
    """Guesses allowed; 7 suffice for 1..100 with binary search."""
    split: str = "all"
    """"train" or "eval": draw only hidden numbers of that part of a fixed partition (1 in 8 is "eval")."""

    def validate(self) -> None:
        check_range("low", self.low, -MAX_RANGE, MAX_RANGE)
        check_range("high", self.high, self.low + 1, self.low + MAX_RANGE)
        check_range("max_turns", self.max_turns, 1, MAX_TURNS)
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {self.split!r}")
        if self.split != "all" and self.high - self.low + 1 < EVAL_SHARE:
            raise ValueError(f"split needs high - low + 1 >= {EVAL_SHARE}, so that both parts hold numbers")


DESCRIPTION = ("Find a hidden integer from higher/lower hints; reply with a number or call guess(number); "
               f"reward 1 only when found. Config: {describe_config(GuessNumberConfig)}.")


def in_split(secret: int, split: str) -> bool:
    """A fixed partition of hidden numbers: the held-out ("eval") ones are never drawn for "train"."""
    held_out = secret % EVAL_SHARE == 0  # exactly one of any EVAL_SHARE consecutive: both parts never empty
    return split == "all" or held_out == (split == "eval")


def draw_secret(seed: int, cfg: GuessNumberConfig) -> int:
    rng = random.Random(seed)
    while True:  # rejection sampling: EVAL_SHARE draws at most on average
        secret = rng.randint(cfg.low, cfg.high)
        if in_split(secret, cfg.split):
            return secret


class GuessNumberEnv(ToolEnv):
    TOOLS = TOOLS

    def __init__(self, *, tool_format: str = "auto") -> None:
        super().__init__(tool_format=tool_format)
        self._cfg = GuessNumberConfig()
        self._secret = 0
        self._last_guess = ""

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        self._cfg = cfg = parse_config(GuessNumberConfig, config, NAME)
        self._secret = draw_secret(seed, cfg)
        self._start(cfg.max_turns)
        self._last_guess = ""
        prompt = (f"I am thinking of an integer between {cfg.low} and {cfg.high}. Guess it: reply with one "
                  f"number. After each guess I say '{HIGHER}' or '{LOWER}'. You have {cfg.max_turns} guesses.")
        return ResetResult(observation=[Message(role="user", content=prompt)],
                           task_id=f"{NAME}-{cfg.low}-{cfg.high}-{self._secret}", tools_json=tools_json(TOOLS))

    def _calls(self, calls: Sequence[ToolCall | BadToolCall]) -> Played:
        first = calls[0]  # one guess per turn: later calls are ignored
        if isinstance(first, BadToolCall):
            return [error_message(first)], None
        return self._guessed(int(first.arguments["number"]), tool=True)

    def _plain(self, parsed: ParsedTurn, action: str) -> Played:
        text = last_integer(parsed.text)
        if text is None or len(text) > 12:  # int() refuses 64 KiB of digits, and it is out of range anyway
            return [Message(role="user", content=f"Reply with one integer between {self._cfg.low} "
                                                 f"and {self._cfg.high}.")], None
        return self._guessed(int(text), tool=False)

    def _guessed(self, guess: int, *, tool: bool) -> Played:
        """Found (the guess is the answer), or the hint, answering the way the guess came."""
        self._last_guess = str(guess)
        if guess == self._secret:
            return [], self._last_guess
        hint = self._hint(guess)
        return [Message(role="tool", name="guess", content=hint) if tool else Message(role="user", content=hint)], None

    def _hint(self, guess: int) -> str:
        cfg = self._cfg
        if not cfg.low <= guess <= cfg.high:
            return f"{guess} is out of range: the number is between {cfg.low} and {cfg.high}."
        return HIGHER if self._secret > guess else LOWER

    def _finish(self, answer: str, *, out_of_turns: bool = False) -> StepResult:
        # Only a found number answers; an episode out of turns reports the last guess.
        self._done = True
        correct = not out_of_turns
        return StepResult(observation=[], done=True, reward=1.0 if correct else 0.0, answer=self._last_guess,
                          reference=str(self._secret), info={"turns": self._turns, "correct": correct})
