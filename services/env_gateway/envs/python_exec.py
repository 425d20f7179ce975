"""`python`: compute a number by writing code. The agent sends a ```python block or calls
`python(code)`; the sandbox runs it and the observation is its exit status, stdout and
stderr. The final answer is plain text (its last integer) or `answer(value)`.

step() blocks for as long as the code runs, so the registry marks this environment
`blocking` and the gateway calls it in a worker thread.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.env_gateway.envs import tasks
from services.env_gateway.envs.answers import last_integer
from services.env_gateway.envs.base import (
    EnvUnavailableError,
    Message,
    ResetResult,
    check_range,
    describe_config,
    parse_config,
)
from services.env_gateway.envs.tool_env import Played, ToolEnv
from services.env_gateway.tool_calls import BadToolCall, ParsedTurn, ToolCall
from services.env_gateway.tool_schema import function_tool, tools_json

NAME = "python"
MAX_TURNS = 32
MAX_CODE_CHARS = 32 * 1024
TOOLS = (
    function_tool("python", "Run a Python 3 program and see its exit status, stdout and stderr. No network; "
                  "print what you want to see.", {"code": {"type": "string", "maxLength": MAX_CODE_CHARS}}),
    function_tool("answer", "Give the final answer and end the episode.",
                  {"value": {"type": ["integer", "string"], "description": "The final answer, a number."}}),
)
_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


class RunResult(Protocol):
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool


class CodeRunner(Protocol):
    """What the environment needs of `arlo.sandbox.Sandbox`."""

    def run_python(self, code: str, *, stdin: str = "", files: Mapping[str, str] | None = None,
                   args: Sequence[str] = ()) -> RunResult: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class PythonConfig:
    max_turns: int = 6
    max_runs_per_turn: int = 2
    """Programs run per turn; more calls in one turn are answered with an error."""
    max_observation_chars: int = 4000
    """stdout and stderr are each cut to this many characters in the observation."""
    difficulty: int = 1
    """1..3: scales the task's numbers (and how long a naive program takes)."""

    def validate(self) -> None:
        check_range("max_turns", self.max_turns, 1, MAX_TURNS)
        check_range("max_runs_per_turn", self.max_runs_per_turn, 1, 8)
        check_range("max_observation_chars", self.max_observation_chars, 100, 1 << 20)
        check_range("difficulty", self.difficulty, 1, 3)


DESCRIPTION = ("Compute a number by running Python in a sandbox (```python blocks or python(code)); "
               f"final answer as plain text or answer(value). Config: {describe_config(PythonConfig)}.")


def render_result(result: RunResult, limit: int) -> str:
    """What the agent sees of one run: status first, then the head of stdout and the tail of stderr
    (a traceback's last line is the useful one)."""
    code = "" if result.exit_code is None else f", exit code {result.exit_code}"
    parts = [f"status: {result.status}{code}, {result.wall_s:.2f}s"]
    if result.truncated:
        parts.append("(output was cut by the sandbox's output limit)")
    for label, text, keep_head in (("stdout", result.stdout, True), ("stderr", result.stderr, False)):
        if text:
            parts.append(f"--- {label} ---\n{_cut(text, limit, keep_head)}")
    if not result.stdout and not result.stderr:
        parts.append("(no output: print the values you want to see)")
    return "\n".join(parts)


def _cut(text: str, limit: int, keep_head: bool) -> str:
    if len(text) <= limit:
        return text
    dropped = f"[... {len(text) - limit} more characters]"
    return f"{text[:limit]}\n{dropped}" if keep_head else f"{dropped}\n{text[-limit:]}"


class PythonEnv(ToolEnv):
    TOOLS = TOOLS

    def __init__(self, runner: CodeRunner, *, tool_format: str = "auto") -> None:
        super().__init__(tool_format=tool_format)
        self._runner = runner
        self._cfg = PythonConfig()
        self._runs = 0
        self._turn_runs = 0

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        self._cfg = cfg = parse_config(PythonConfig, config, NAME)
        task = tasks.make_task(random.Random(seed), cfg.difficulty)
        self._reference = str(task.answer)
        self._start(cfg.max_turns)
        self._runs = 0
        prompt = (f"{task.question} You can run Python: write a ```python code block (or call the python tool) "
                  "and I will run it and show you its output. When you know the result, reply with just the "
                  "number.")
        return ResetResult(observation=[Message(role="user", content=prompt)], task_id=f"{NAME}-{task.id}",
                           tools_json=tools_json(TOOLS))

    def _plain(self, parsed: ParsedTurn, action: str) -> Played:
        if blocks := _CODE_BLOCK.findall(action):
            # The last block is the agent's latest version; earlier ones are usually drafts.
            return [Message(role="user", content=self._run(blocks[-1]))], None
        answer = last_integer(parsed.text)
        return ([] if answer is not None else [Message(role="user", content=(
            "Reply with the number, or run code in a ```python block."))]), answer

    def _calls(self, calls: Sequence[ToolCall | BadToolCall]) -> Played:
        self._turn_runs = 0
        return super()._calls(calls)

    def _call(self, call: ToolCall) -> Message:  # python(code), at most max_runs_per_turn a turn
        if self._turn_runs >= self._cfg.max_runs_per_turn:
            return Message(role="tool", name="python", content=(
                f"error: at most {self._cfg.max_runs_per_turn} programs run per turn; this one did not run"))
        self._turn_runs += 1
        return Message(role="tool", name="python", content=self._run(call.arguments["code"]))

    def _run(self, code: str) -> str:
        if len(code) > MAX_CODE_CHARS:
            return f"error: the program has {len(code)} characters; the limit is {MAX_CODE_CHARS}"
        result = self._runner.run_python(code)
        if result.status == "sandbox_error":
            # Not the agent's fault: fail the step (UNAVAILABLE) rather than train on it.
            raise EnvUnavailableError(f"the code sandbox failed: {result.stderr.strip()[-500:]}")
        self._runs += 1
        return render_result(result, self._cfg.max_observation_chars)

    def _info(self) -> dict[str, Any]:
        return {"turns": self._turns, "runs": self._runs}
