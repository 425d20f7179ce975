"""Code correctness: run the response's program against the task's tests in the sandbox.

The tests come from `metadata["tests"]` (one string of Python asserts, or a list of separate
snippets for partial credit) or, failing that, from `reference`. A harness runs in the
sandbox: it compiles the solution, executes it (as module `solution`, so a `__main__` guard
does not run), then each snippet in a copy of its namespace, and reports each verdict on a
private copy of stdout, each line prefixed by a random nonce the solution never sees in its
code or environment. The solution's own prints go to /dev/null. So a solution that exits
early (`sys.exit(0)`, `os._exit(0)`) or prints "pass" earns nothing, where "exit status 0"
would have paid it in full.

A sandbox failure raises (the reward service reports it as an ERROR, never as a 0).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from arlo.sandbox import Sandbox, SandboxError
from services.reward.verifiers.base import RewardFn, Verdict

_PYTHON_TAGS = ("python", "python3", "py")
SOLUTION_FILE = "solution.py"
TESTS_FILE = "tests.json"

# Runs in the sandbox interpreter. `write` is bound before the solution runs, so patching
# os.write cannot rewrite the verdicts.
HARNESS = '''\
def main():
    # Everything is local: the solution finds no nonce in __main__'s globals.
    import json, os, sys, traceback
    nonce = sys.stdin.readline().strip()
    write, verdicts = os.write, os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

    def say(word, index=-1):
        write(verdicts, f"{nonce} {word} {index}\\n".encode())

    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    try:
        program = compile(source, "solution.py", "exec")
    except Exception:
        traceback.print_exc()
        return 1
    say("compiled")
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(program, namespace)
    except BaseException:
        traceback.print_exc()
        return 1
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{index}.py", "exec"), dict(namespace))
        except BaseException:
            traceback.print_exc()
            say("fail", index)
        else:
            say("pass", index)
    return 0


raise SystemExit(main())
'''


def _fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(info string, body, closed) of each ``` block, by lines as Markdown reads them."""
    blocks: list[tuple[str, str, bool]] = []
    info, body = None, []  # info is None outside a block
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if info is None and stripped.startswith("```"):
            info, body = stripped[3:].strip().lower(), []
        elif info is not None and stripped == "```":
            blocks.append((info, "".join(body), True))
            info = None
        elif info is not None:
            body.append(line)
    if info is not None:
        blocks.append((info, "".join(body), False))
    return blocks


def extract_code(response: str) -> str:
    """The last closed ```python block; else the last closed untagged one; else an unclosed
    ```python block (a response cut at max tokens); else the whole text."""
    blocks = _fenced_blocks(response)
    for wanted in (lambda info, closed: closed and info in _PYTHON_TAGS,
                   lambda info, closed: closed and not info,
                   lambda info, closed: not closed and info in _PYTHON_TAGS):
        bodies = [body for info, body, closed in blocks if wanted(info, closed)]
        if bodies:
            return bodies[-1]
    return response


def split_tests(reference: str, metadata: Mapping[str, Any]) -> list[str]:
    """The separate tests: metadata["tests"] (a string is one test), else `reference`."""
    tests = metadata.get("tests")
    if isinstance(tests, str) and tests.strip():
        return [tests]
    if isinstance(tests, Sequence) and not isinstance(tests, str) and tests:
        if not all(isinstance(t, str) for t in tests):
            raise ValueError("metadata['tests'] must be a string or a list of strings")
        return list(tests)
    if tests not in (None, "", [], ()):
        raise ValueError(f"metadata['tests'] must be a string or a list of strings, got {type(tests).__name__}")
    if reference.strip():
        return [reference]
    raise ValueError("no tests: metadata['tests'] is missing and the reference is empty")


def _verdicts(stdout: str, nonce: str) -> tuple[bool, set[int]]:
    compiled, passed = False, set()
    for line in stdout.split("\n")[:-1]:  # only whole lines: a killed run may end mid-line
        parts = line.split()
        if len(parts) != 3 or parts[0] != nonce:
            continue
        if parts[1] == "compiled":
            compiled = True
        elif parts[1] == "pass" and parts[2].isdigit():
            passed.add(int(parts[2]))
    return compiled, passed


def make_code_verifier(sandbox: Sandbox) -> RewardFn:
    """A RewardFn: reward = fraction of tests passed; components tests_passed and compiled."""

    def code_tests(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        tests = split_tests(reference, metadata)
        nonce = secrets.token_hex(16)
        result = sandbox.run_python(HARNESS, stdin=nonce + "\n",
                                    files={SOLUTION_FILE: extract_code(response), TESTS_FILE: json.dumps(tests)})
        if result.status == "sandbox_error":
            raise SandboxError(f"the code sandbox failed: {result.stderr.strip()[-500:]}")
        compiled, passed = _verdicts(result.stdout, nonce)
        fraction = len(passed & set(range(len(tests)))) / len(tests)
        return Verdict(reward=fraction, components={"tests_passed": fraction, "compiled": float(compiled)})

    return code_tests
