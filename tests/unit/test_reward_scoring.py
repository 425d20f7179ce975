"""Scoring core: verifiers, explicit statuses (never a silent 0), deadlines on real threads."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from services.reward.registry import RewardRegistry, RewardSpec, builtin_specs
from services.reward.runner import DeadlineRunner
from services.reward.scoring import ScoreOutcome, Scorer, ScoreStatus, check_verdict, parse_metadata
from services.reward.verifiers.base import RewardFn, Verdict
from services.reward.verifiers.exact import exact_match


@pytest.mark.parametrize(("response", "reference", "score"), [
    ("7", "7", 1.0), ("  7\n", "7", 1.0), ("a  b\tc", "a b c", 1.0), ("", "", 1.0),
    ("7", "8", 0.0), ("7.0", "7", 0.0), ("ab", "a b", 0.0),
])
def test_exact_match(response: str, reference: str, score: float) -> None:
    assert exact_match(response, reference, {}) == Verdict(reward=score, components={"exact_match": score})


def test_registry() -> None:
    registry = RewardRegistry(builtin_specs())
    assert registry.names() == ["exact_match", "format_regex", "format_think", "math_equiv", "math_think"]
    assert registry.get("exact_match").fn is exact_match and registry.fn("exact_match") is exact_match
    assert registry.get("nope") is None and registry.fn("nope") is None
    with pytest.raises(ValueError, match="already registered"):
        registry.register(RewardSpec(name="exact_match", fn=exact_match, description=""))


def test_parse_metadata() -> None:
    assert parse_metadata("") == {}
    assert parse_metadata('{"k": [1]}') == {"k": [1]}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_metadata("{")
    with pytest.raises(ValueError, match="JSON object"):
        parse_metadata("[]")


@pytest.mark.parametrize("verdict", [
    1.0, None, Verdict(reward=math.nan), Verdict(reward=math.inf), Verdict(reward=True),  # type: ignore[arg-type]
    Verdict(reward=1.0, components={"x": math.nan}), Verdict(reward=1.0, components={"x": "1"}),  # type: ignore[dict-item]
])
def test_unusable_verdicts_are_errors(verdict: Any) -> None:
    outcome = check_verdict(verdict)
    assert outcome.status is ScoreStatus.ERROR and outcome.error


def test_integer_reward_is_ok() -> None:
    assert check_verdict(Verdict(reward=1, components={"a": 0})) == ScoreOutcome(
        status=ScoreStatus.OK, reward=1.0, components={"a": 0.0})


async def test_ok() -> None:
    outcome = await Scorer(timeout_s=5).score(exact_match, " 4 ", "4", {})
    assert outcome == ScoreOutcome(status=ScoreStatus.OK, reward=1.0, components={"exact_match": 1.0})


async def test_raising_verifier_is_error_with_reason() -> None:
    def broken(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        raise KeyError("sympy exploded")

    outcome = await Scorer(timeout_s=5).score(broken, "1", "1", {})
    assert outcome.status is ScoreStatus.ERROR
    assert "KeyError" in outcome.error and "sympy exploded" in outcome.error


async def test_verifier_raising_timeouterror_is_an_error_not_a_timeout() -> None:
    def own_timeout(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        raise TimeoutError("inner")

    outcome = await Scorer(timeout_s=5).score(own_timeout, "1", "1", {})
    assert outcome.status is ScoreStatus.ERROR and "inner" in outcome.error


async def test_verifier_calling_sys_exit_does_not_escape() -> None:
    def exits(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        sys.exit(3)

    outcome = await Scorer(timeout_s=5).score(exits, "1", "1", {})
    assert outcome.status is ScoreStatus.ERROR and "SystemExit" in outcome.error


def hanging_verifier(release: threading.Event) -> RewardFn:
    """A verifier that blocks until `release` is set (10 s at most)."""
    def hangs(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        release.wait(10)
        return Verdict(reward=1.0)
    return hangs


async def until_none_stuck(runner: DeadlineRunner) -> None:
    for _ in range(100):
        if runner.stuck == 0:
            break
        await asyncio.sleep(0.02)
    assert runner.stuck == 0


async def test_slow_verifier_times_out_and_its_thread_is_counted() -> None:
    release = threading.Event()
    hangs = hanging_verifier(release)
    runner = DeadlineRunner(max_concurrency=2, max_stuck=1)
    scorer = Scorer(timeout_s=0.2, runner=runner)
    start = time.perf_counter()
    outcome = await scorer.score(hangs, "1", "1", {})
    assert time.perf_counter() - start < 2
    assert outcome.status is ScoreStatus.TIMEOUT and "0.2s" in outcome.error and outcome.reward == 0.0
    assert runner.stuck == 1
    saturated = await scorer.score(exact_match, "1", "1", {})  # max_stuck reached: refuse, loudly
    assert saturated.status is ScoreStatus.ERROR and "past their deadlines" in saturated.error
    release.set()
    await until_none_stuck(runner)
    assert (await scorer.score(exact_match, "1", "1", {})).status is ScoreStatus.OK


async def test_worker_threads_are_reused_and_a_stuck_one_is_replaced_not_waited_for() -> None:
    """A thread per call cost ~115 us each: a ScoreBatch of 32 spent ~4 ms starting threads."""
    release = threading.Event()
    hangs = hanging_verifier(release)
    runner = DeadlineRunner(max_concurrency=2, max_stuck=2)
    scorer = Scorer(timeout_s=0.3, runner=runner)
    for _ in range(5):
        outcomes = await asyncio.gather(*(scorer.score(exact_match, "1", "1", {}) for _ in range(16)))
        assert all(o.status is ScoreStatus.OK for o in outcomes)
    assert runner.threads <= 2  # 80 calls, two at a time, on the same two threads
    stuck = await scorer.score(hangs, "1", "1", {})
    assert stuck.status is ScoreStatus.TIMEOUT and runner.stuck == 1
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(scorer.score(exact_match, "1", "1", {}) for _ in range(16)))
    assert all(o.status is ScoreStatus.OK for o in outcomes) and time.perf_counter() - started < 0.3
    assert runner.threads <= 3  # one more beside the stuck one
    release.set()
    await until_none_stuck(runner)
    for _ in range(5):  # the freed worker serves again: no new threads
        await asyncio.gather(*(scorer.score(exact_match, "1", "1", {}) for _ in range(16)))
    assert runner.threads <= 3


async def test_a_worker_that_fails_to_start_leaves_no_call_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS refusing a thread (out of threads or memory) fails that call alone; before the fix
    its call stayed queued for the next worker, whose own call then ran past its deadline."""
    runner = DeadlineRunner(max_concurrency=2)
    start = threading.Thread.start
    failures = iter([RuntimeError("can't start new thread")])

    def flaky_start(thread: threading.Thread) -> None:
        error = next(failures, None)
        if error is not None:
            raise error
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", flaky_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await runner.run(lambda: "lost", 1.0)
    assert runner.threads == 0
    assert [await runner.run(lambda i=i: i, 0.5) for i in range(4)] == [0, 1, 2, 3]
    assert runner.threads == 1


async def test_deadline_starts_when_the_verifier_starts() -> None:
    def slowish(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        time.sleep(0.15)
        return Verdict(reward=1.0)

    # Six 0.15 s calls, one at a time: the last finishes ~0.9 s after the batch began, but
    # none ran longer than its 0.5 s deadline.
    scorer = Scorer(timeout_s=0.5, runner=DeadlineRunner(max_concurrency=1))
    outcomes = await asyncio.gather(*(scorer.score(slowish, "", "", {}) for _ in range(6)))
    assert [o.status for o in outcomes] == [ScoreStatus.OK] * 6


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Scorer(timeout_s=0)
    with pytest.raises(ValueError):
        DeadlineRunner(max_concurrency=0)
    with pytest.raises(ValueError, match="already registered"):
        RewardRegistry([RewardSpec(name="a", fn=exact_match, description=""),
                        RewardSpec(name="a", fn=exact_match, description="")])
