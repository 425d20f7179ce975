"""`python`: code runs in the real sandbox (arlo.sandbox); task references checked against sympy."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
import sympy

from arlo.config import SandboxConfig
from arlo.sandbox import Sandbox
from services.env_gateway.envs import tasks
from services.env_gateway.envs.base import EnvUnavailableError
from services.env_gateway.envs.python_exec import TOOLS, PythonEnv, render_result


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(wall_timeout_s=2.0, cpu_seconds=2))


def python_call(code: str) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": {json.dumps(code)}}}}}</tool_call>'


def reference_of(task: tasks.Task) -> int:
    """The answer again, from sympy (an implementation we did not write)."""
    numbers = [int(n) for n in re.findall(r"\d+", task.id)]
    kind = task.id.split("-")[0]
    if kind == "sum":
        return int(sum(sympy.primerange(2, numbers[0])))
    if kind == "divisors":
        return int(sympy.divisor_count(numbers[0]))
    if kind == "fib":
        return int(sympy.fibonacci(numbers[0]) % 1_000_000_007)
    if kind == "digits":
        return sum(map(int, str(sympy.Integer(2) ** numbers[1])))
    if kind == "divisible":
        n, a, b = numbers
        return n // a + n // b - n // int(sympy.ilcm(a, b))
    assert kind == "collatz"
    n, steps = numbers[0], 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def test_every_task_family_has_the_right_reference() -> None:
    rng = random.Random(0)
    for family in tasks.FAMILIES:
        for difficulty in (1, 2, 3):
            task = family(rng, difficulty)
            assert task.answer == reference_of(task), task


def started(sandbox: Sandbox, seed: int = 0, **config: object) -> tuple[PythonEnv, str]:
    env = PythonEnv(sandbox)
    reset = env.reset(seed, config)
    assert json.loads(reset.tools_json) == list(TOOLS) and "```python" in reset.observation[0].content
    # The task id names the puzzle, so the test can play well without peeking at the environment.
    return env, str(reference_of(tasks.Task(id=reset.task_id.removeprefix("python-"), question="", answer=0)))


def test_code_block_runs_and_the_answer_scores(sandbox: Sandbox) -> None:
    env, reference = started(sandbox, seed=1)
    step = env.step(f"Let me compute.\n```python\nprint({reference})\n```\n")
    (reply,) = step.observation
    assert not step.done and reply.role == "user"
    assert reply.content.startswith("status: ok, exit code 0") and f"--- stdout ---\n{reference}\n" in reply.content
    final = env.step(f"The answer is {reference}.")
    assert final.done and final.reward == 1.0 and final.answer == final.reference == reference
    assert final.info == {"turns": 2, "runs": 1, "correct": True, "out_of_turns": False}


def test_tool_call_errors_and_limits(sandbox: Sandbox) -> None:
    env, _ = started(sandbox, seed=2, max_runs_per_turn=1, max_observation_chars=100)
    step = env.step(python_call("print('x' * 1000)\n1/0") + python_call("print(1)"))
    first, second = step.observation
    assert first.role == second.role == "tool" and first.name == "python"
    assert first.content.startswith("status: error, exit code 1")
    assert "[... 901 more characters]" in first.content and first.content.endswith("ZeroDivisionError: division by zero\n")
    assert "at most 1 programs run per turn" in second.content
    silent = env.step(python_call("x = 1"))
    assert "(no output: print the values you want to see)" in silent.observation[0].content


def test_timeouts_are_reported_not_raised(sandbox: Sandbox) -> None:
    env, _ = started(sandbox, seed=3)
    step = env.step(python_call("import time\ntime.sleep(30)"))
    assert step.observation[0].content.startswith("status: timeout")


def test_answer_tool_and_out_of_turns(sandbox: Sandbox) -> None:
    env, reference = started(sandbox, seed=4)
    final = env.step(f'<tool_call>{{"name": "answer", "arguments": {{"value": "{reference}"}}}}</tool_call>')
    assert final.done and final.reward == 1.0
    env, _ = started(sandbox, seed=5, max_turns=1)
    last = env.step("thinking...")
    assert last.done and last.reward == 0.0 and last.info["out_of_turns"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Broken:
    status: str = "sandbox_error"
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = "bwrap: cannot create namespace"
    wall_s: float = 0.0
    truncated: bool = False


class BrokenSandbox:
    """A sandbox that fails as a sandbox (not as the agent's program): we cannot make the real one."""

    def run_python(self, code: str, *, stdin: str = "", files: Mapping[str, str] | None = None,
                   args: Sequence[str] = ()) -> _Broken:
        return _Broken()


def test_a_failing_sandbox_fails_the_step_without_using_a_turn() -> None:
    env = PythonEnv(BrokenSandbox())
    env.reset(0, {"max_turns": 1})
    with pytest.raises(EnvUnavailableError, match="cannot create namespace"):
        env.step("```python\nprint(1)\n```")
    final = env.step("42")
    assert final.done and final.info["turns"] == 1 and final.info["runs"] == 0  # the failed step used no turn


def test_render_result_keeps_the_tail_of_stderr() -> None:
    text = render_result(_Broken(status="error", exit_code=1, stderr="a" * 50 + "LAST"), 10)
    assert text.endswith("[... 44 more characters]\naaaaaaLAST")
