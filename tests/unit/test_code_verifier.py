"""The code verifier on a real sandbox: full and partial credit, extraction, compile errors,
reward hacks that must earn nothing, and a sandbox failure that must raise (never a silent 0)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arlo.config import SandboxConfig
from arlo.sandbox import Sandbox, SandboxError
from services.reward.verifiers.base import Verdict
from services.reward.verifiers.code import extract_code, make_code_verifier, split_tests

UID = 56000 + os.getpid() % 3000
DOUBLE = "def double(x):\n    return 2 * x\n"


def _config() -> SandboxConfig:
    return SandboxConfig(cpu_seconds=1, memory_mb=256, wall_timeout_s=3.0, uid=UID)


@pytest.fixture(scope="module")
def verify():  # type: ignore[no-untyped-def]
    return make_code_verifier(Sandbox(_config()))


def _verdict(reward: float, compiled: float) -> Verdict:
    return Verdict(reward=reward, components={"tests_passed": reward, "compiled": compiled})


def test_passing_code_scores_one(verify) -> None:  # type: ignore[no-untyped-def]
    assert verify(DOUBLE, "", {"tests": "assert double(2) == 4\nassert double(-1) == -2"}) == _verdict(1.0, 1.0)


def test_failing_code_scores_zero(verify) -> None:  # type: ignore[no-untyped-def]
    wrong = "def double(x):\n    return x + 2\n"
    assert verify(wrong, "", {"tests": "assert double(2) == 4\nassert double(3) == 6"}) == _verdict(0.0, 1.0)


def test_separate_snippets_give_partial_credit(verify) -> None:  # type: ignore[no-untyped-def]
    wrong_for_zero = "def double(x):\n    if x == 0:\n        raise ValueError\n    return x * 2\n"
    tests = ["assert double(1) == 2", "assert double(0) == 0", "assert double(5) == 10", "x = 1\nassert x == 2"]
    assert verify(wrong_for_zero, "", {"tests": tests}) == _verdict(0.5, 1.0)


def test_reference_is_the_fallback_test_code(verify) -> None:  # type: ignore[no-untyped-def]
    assert verify(DOUBLE, "assert double(21) == 42", {}) == _verdict(1.0, 1.0)
    assert verify(DOUBLE, "assert double(21) == 41", {}) == _verdict(0.0, 1.0)


def test_fenced_block_is_extracted(verify) -> None:  # type: ignore[no-untyped-def]
    response = ("Here is my solution:\n\n```python\n" + DOUBLE + "```\n\nIt doubles x, e.g. `double(2)`.")
    assert verify(response, "", {"tests": "assert double(3) == 6"}) == _verdict(1.0, 1.0)


def test_syntax_error_is_not_compiled(verify) -> None:  # type: ignore[no-untyped-def]
    assert verify("def double(x) return 2x", "", {"tests": "assert double(1) == 2"}) == _verdict(0.0, 0.0)


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "print('pass 0')\nraise SystemExit",
    "import os\n_w = os.write\nos.write = lambda fd, b: _w(fd, b.replace(b'fail', b'pass'))\n"
    "def double(x):\n    return 0\n",
])
def test_reward_hacks_earn_nothing(verify, cheat: str) -> None:  # type: ignore[no-untyped-def]
    assert verify(cheat, "", {"tests": ["assert double(1) == 2"]}).reward == 0.0


def test_slow_code_keeps_the_tests_it_passed(verify) -> None:  # type: ignore[no-untyped-def]
    tests = ["assert double(1) == 2", "while True:\n    pass", "assert double(2) == 4"]
    assert verify(DOUBLE, "", {"tests": tests}).reward == pytest.approx(1 / 3)


def test_prints_do_not_disturb_the_verdict(verify) -> None:  # type: ignore[no-untyped-def]
    chatty = "for i in range(100000):\n    print('noise', i)\n" + DOUBLE
    assert verify(chatty, "", {"tests": "assert double(4) == 8"}) == _verdict(1.0, 1.0)


def test_sandbox_failure_raises(request: pytest.FixtureRequest) -> None:
    # An interpreter that works at start and then vanishes: the sandbox, not the code, is broken.
    # It lives in pytest's cache dir (not /tmp: that is private inside the namespaces).
    cache = getattr(request.config, "cache", None)
    if cache is None:
        pytest.skip("needs pytest's cache dir (cacheprovider is disabled)")
    home = cache.mkdir("sandbox-failure")
    python = Path(home) / f"python3-{os.getpid()}"
    python.unlink(missing_ok=True)
    python.symlink_to("/usr/bin/python3")
    try:
        verify = make_code_verifier(Sandbox(_config(), python=str(python)))
    except SandboxError as exc:
        pytest.skip(f"the cache dir is not visible to the sandbox uid here: {exc}")
    finally:
        python.unlink()
    with pytest.raises(SandboxError, match="sandbox failed"):
        verify(DOUBLE, "", {"tests": "assert double(1) == 2"})


@pytest.mark.parametrize(("response", "code"), [
    ("```python\nA = 1\n```", "A = 1\n"),
    ("```py\nA = 1\n```\ntext\n```python\nA = 2\n```", "A = 2\n"),  # the last python block
    ("```\nA = 3\n```", "A = 3\n"),
    ("```bash\nls\n```\n```\nA = 4\n```", "A = 4\n"),
    ("```python\nA = 5\n", "A = 5\n"),  # cut off at max tokens
    ("A = 6", "A = 6"),
    ("Use `x`:\n```Python\nA = 7\n```\nthen ```\n", "A = 7\n"),
])
def test_extract_code(response: str, code: str) -> None:
    assert extract_code(response) == code


def test_split_tests() -> None:
    assert split_tests("ref", {"tests": "assert 1"}) == ["assert 1"]
    assert split_tests("ref", {"tests": ["a", "b"]}) == ["a", "b"]
    assert split_tests("assert ref", {}) == ["assert ref"]
    with pytest.raises(ValueError, match="list of strings"):
        split_tests("", {"tests": [1, 2]})
    with pytest.raises(ValueError, match="no tests"):
        split_tests("  ", {})
