"""The step every tool-using environment shares, written once: refuse a step after the episode,
read the agent's tool calls, let the environment play the turn, count it, and end the episode on
an answer or when the turns run out.

An environment says only what is its own: `_calls` (or `_call`, one tool call, and
`_answer_call`, what an `answer` call gives) for a turn with tool calls, `_plain` for one
without, and how an answer is judged (`_judge`) or the episode ends (`_finish`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import EpisodeOverError, Message, StepResult
from services.env_gateway.tool_calls import BadToolCall, ParsedTurn, ToolCall, error_message, parse_tool_calls

Played = tuple[list[Message], str | None]
"""A turn's replies, and its final answer (None: the episode goes on)."""


def final_number(value: Any) -> str:
    """An `answer(value)` call's answer: its last integer, canonical, else the text as written."""
    text = str(value)
    return last_integer(text) or text.strip()


class ToolEnv:
    TOOLS: ClassVar[Sequence[Mapping[str, Any]]] = ()

    def __init__(self, *, tool_format: str = "auto") -> None:
        self._tool_format = tool_format
        """How the agent's calls are read (`EnvContext.tool_format`)."""
        self._max_turns = 0
        self._turns = 0
        self._done = True  # no step before the first reset
        self._reference = ""
        """What the default `_judge` compares the answer with."""

    def _start(self, max_turns: int) -> None:
        """A new episode (reset calls it)."""
        self._max_turns, self._turns, self._done = max_turns, 0, False

    def step(self, action: str) -> StepResult:
        if self._done:
            raise EpisodeOverError("the episode is over; call Reset to start another")
        parsed = parse_tool_calls(action, self.TOOLS, format=self._tool_format)
        replies, answer = self._calls(parsed.calls) if parsed.calls else self._plain(parsed, action)
        # Counted after the turn is played: a step that fails (a sandbox down) does not use one up.
        self._turns += 1
        if answer is not None:
            return self._finish(answer)
        if self._turns >= self._max_turns:
            return self._finish("", out_of_turns=True)
        return StepResult(observation=replies, done=False, info=self._info())

    def _calls(self, calls: Sequence[ToolCall | BadToolCall]) -> Played:
        """In order: a malformed call is answered with its error, `answer` ends the turn (later
        calls are not run), any other call is run by `_call`."""
        replies: list[Message] = []
        for call in calls:
            if isinstance(call, BadToolCall):
                replies.append(error_message(call))
            elif call.name == "answer":
                return replies, self._answer_call(call)
            else:
                replies.append(self._call(call))
        return replies, None

    def _call(self, call: ToolCall) -> Message:
        raise NotImplementedError

    def _answer_call(self, call: ToolCall) -> str:
        return final_number(call.arguments["value"])

    def _plain(self, parsed: ParsedTurn, action: str) -> Played:
        """A turn without a tool call."""
        raise NotImplementedError

    def _judge(self, answer: str) -> tuple[str, str, bool]:
        """The answer and the reference as returned, and whether the answer is right."""
        return answer, self._reference, answer == self._reference

    def _finish(self, answer: str, *, out_of_turns: bool = False) -> StepResult:
        self._done = True
        answer, reference, correct = self._judge(answer)
        return StepResult(observation=[], done=True, reward=1.0 if correct else 0.0, answer=answer,
                          reference=reference, info={**self._info(), "correct": correct, "out_of_turns": out_of_turns})

    def _info(self) -> dict[str, Any]:
        return {"turns": self._turns}
