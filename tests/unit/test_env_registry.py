"""The registry's context, typed configs and tool schemas, and the gateway core's worker threads."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from arlo.config import EnvGatewayConfig, SandboxConfig
from services.env_gateway.envs.base import (
    EnvUnavailableError,
    Message,
    ResetResult,
    StepResult,
    describe_config,
    parse_config,
)
from services.env_gateway.gateway import Gateway, InvalidConfigError
from services.env_gateway.registry import EnvContext, EnvRegistry, EnvSpec, default_registry
from services.env_gateway.sessions import SessionBusyError, SessionStore


@dataclass(frozen=True, kw_only=True, slots=True)
class SleepConfig:
    seconds: float = 0.3
    label: str = "z"

    def validate(self) -> None:
        if not 0 <= self.seconds <= 5:
            raise ValueError(f"seconds must be in [0, 5], got {self.seconds}")


class SleepEnv:
    """Blocks in step(), like code execution; records the thread it ran on."""

    def __init__(self, ctx: EnvContext) -> None:
        self.ctx = ctx
        self.cfg = SleepConfig()
        self.threads: list[str] = []

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        self.cfg = parse_config(SleepConfig, config, "sleep")
        self.threads.append(threading.current_thread().name)
        return ResetResult(observation=[Message(role="user", content=self.ctx.config.retrieval_docs_dir)],
                           task_id=f"sleep-{seed}")

    def step(self, action: str) -> StepResult:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.cfg.seconds)
        return StepResult(observation=[], done=False, info={"thread": threading.current_thread().name})


def gateway(**spec: Any) -> Gateway:
    ctx = EnvContext(EnvGatewayConfig(retrieval_docs_dir="/from/ctx"))
    registry = EnvRegistry([EnvSpec(name="sleep", description="d", factory=SleepEnv, config_type=SleepConfig,
                                    **spec)], context=ctx)
    return Gateway(registry, SessionStore(idle_timeout_s=60, max_sessions=10), blocking_workers=2)


def test_factories_get_the_context_and_configs_are_typed() -> None:
    gw = gateway()
    started = gw.reset("sleep", '{"seconds": 0, "label": "x"}', 1)
    assert started.result.observation[0].content == "/from/ctx"
    assert isinstance(gw.sessions.get(started.session_id).env.cfg, SleepConfig)  # type: ignore[attr-defined]
    with pytest.raises(InvalidConfigError, match=r"sleep config: seconds must be in \[0, 5\], got 9.0"):
        gw.reset("sleep", '{"seconds": 9}', 1)  # an int is a fine float, then validate() runs
    with pytest.raises(InvalidConfigError, match="sleep config: label must be str, got 3"):
        gw.reset("sleep", '{"label": 3}', 1)
    assert describe_config(SleepConfig) == "seconds (float, default 0.3), label (str, default 'z')"


def test_builtin_specs_carry_tools_and_configs() -> None:
    registry = default_registry()
    assert registry.names() == ["arith", "calculator", "dataset", "guess_number", "long_doc", "python", "retrieval"]
    for spec in registry.specs():
        assert spec.config_type.__dataclass_params__.frozen  # type: ignore[attr-defined]
        for field in dataclasses.fields(spec.config_type):
            assert field.name in spec.description, (spec.name, field.name)
        env = registry.create(spec) if spec.name not in ("python", "dataset") else None  # these need a sandbox, a path
        if env is not None:
            assert env.reset(0, {}).tools_json == spec.tools_json
    assert [s.name for s in registry.specs() if s.blocking] == ["dataset", "python"]


async def test_blocking_steps_run_in_worker_threads_and_leave_the_loop_free() -> None:
    gw = gateway(blocking=True)
    ids = [(await gw.reset_async("sleep", '{"seconds": 1.0}', i)).session_id for i in range(2)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    results = await asyncio.gather(*(gw.step_async(s, "go") for s in ids))
    elapsed = time.monotonic() - started
    task.cancel()
    assert all(r.info["thread"].startswith("env-step") for r in results)
    assert elapsed < 1.9  # the two 1 s steps overlapped (one after the other: 2 s)
    assert ticks >= 15  # the loop kept running meanwhile
    gw.shutdown()


async def test_cheap_steps_stay_inline() -> None:
    gw = gateway()
    sid = (await gw.reset_async("sleep", '{"seconds": 0}', 0)).session_id
    result = await gw.step_async(sid, "go")
    assert result.info["thread"] == threading.current_thread().name


async def test_a_second_step_while_one_runs_is_refused() -> None:
    gw = gateway(blocking=True)
    sid = (await gw.reset_async("sleep", '{"seconds": 1.0}', 0)).session_id  # outlasts a stalled loop
    first = asyncio.ensure_future(gw.step_async(sid, "a"))
    await asyncio.sleep(0.05)
    with pytest.raises(SessionBusyError, match="one step at a time"):
        await gw.step_async(sid, "b")
    await first
    await gw.step_async(sid, "c")  # free again once the step ended
    gw.shutdown()


async def test_an_abandoned_step_keeps_the_session_busy_until_it_really_ends() -> None:
    gw = gateway(blocking=True)
    sid = (await gw.reset_async("sleep", '{"seconds": 1.0}', 0)).session_id  # outlasts a stalled loop
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gw.step_async(sid, "a"), 0.05)
    with pytest.raises(SessionBusyError):
        await gw.step_async(sid, "b")  # the first is still running in its thread
    await asyncio.sleep(1.1)
    await gw.step_async(sid, "c")
    gw.shutdown()


@pytest.mark.skipif(shutil.which("bwrap") is not None, reason="needs a machine without bubblewrap")
def test_no_sandbox_is_unavailable_not_a_crash() -> None:
    ctx = EnvContext(EnvGatewayConfig(sandbox=SandboxConfig(isolation="bwrap")))
    with pytest.raises(EnvUnavailableError, match="no code sandbox on this gateway"):
        _ = ctx.sandbox
