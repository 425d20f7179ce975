"""A background task that stops with MustRestart (arlo/background.py) is not restarted in place:
the service stops and its process exits 1 saying why, so its supervisor restarts it from durable
state (the trainer's newest good checkpoint, a replica following a pointer that went back)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from arlo.background import FIRST_BACKOFF_S, MustRestart, TaskGroup, keep_running, restart_delay

SERVICE = textwrap.dedent("""
    import asyncio
    from arlo.background import MustRestart, TaskGroup
    from arlo.config import load_config
    from arlo.rpc import run_until_signal, start_server

    cfg = load_config(overrides={"auth": {"disabled": True}})
    tasks = TaskGroup()

    async def damaged():
        await asyncio.sleep(0.3)
        raise MustRestart("state damaged: weights hold NaN")

    async def start():
        running = await start_server("trainer", cfg.trainer.server.__class__(port=0, metrics_port=-1), cfg.auth, [])
        tasks.spawn("training-loop", damaged)
        return running

    run_until_signal(start, on_stop=tasks.cancel_all, grace_s=0.1, tasks=tasks)
    print("not reached")
""")


def test_a_service_whose_task_must_restart_stops_and_exits_1_saying_why() -> None:
    done = subprocess.run([sys.executable, "-c", SERVICE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == "error: state damaged: weights hold NaN"
    assert "not reached" not in done.stdout


def test_a_service_that_must_restart_while_starting_exits_1_in_one_line() -> None:
    script = SERVICE.replace("    tasks.spawn(\"training-loop\", damaged)\n    return running",
                             "    raise MustRestart(\"publishing version 4 refused: another trainer holds the run\")")
    assert script != SERVICE
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "error: publishing version 4 refused: another trainer holds the run" in done.stderr.splitlines()
    assert "MustRestart" not in done.stderr  # one line, not its traceback


async def test_keep_running_restarts_errors_but_hands_must_restart_on() -> None:
    calls: list[str] = []
    fatal: list[MustRestart] = []

    async def body() -> None:
        calls.append("run")
        if len(calls) == 1:
            raise RuntimeError("a Redis outage")  # restarted after a backoff
        raise MustRestart("lease lost")

    restarts: dict[str, int] = {}
    await asyncio.wait_for(keep_running("loop", body, restarts=restarts, on_fatal=fatal.append), 10)
    assert calls == ["run", "run"] and restarts == {"loop": 1} and str(fatal[0]) == "lease lost"
    group = TaskGroup()
    group.spawn("loop", lambda: body())
    await asyncio.sleep(0.1)
    assert group.fatal is not None and str(group.fatal) == "lease lost"
    await group.cancel_all()


def test_a_failure_after_a_long_good_run_restarts_quickly_again() -> None:
    """The backoff doubled for the life of the process: after a few isolated failures over a long
    run, every later one waited max_backoff_s (a renewal loop let its lease lapse that way)."""
    waits, backoff = [], FIRST_BACKOFF_S
    for ran_s in (0.1, 0.1, 0.1, 0.1, 0.1, 3600.0, 0.1):
        waits.append(restart_delay(backoff, ran_s, 10.0))
        backoff = waits[-1] * 2
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 0.5, 1.0]
