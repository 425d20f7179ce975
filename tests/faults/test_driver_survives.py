"""The driver and the processes `arlo up` owns ride out faults (issue 16, items 2, 11, 12).

Real processes throughout: `arlo up -c X` and `arlo train -c X` as subprocesses, the Redis that
`arlo up` starts itself (supervised, persistent under $ARLO_HOME), every service a
`python -m services.<name>` child. One run takes, in turn: a kill -9 of the trainer (the
supervisor restarts it paused; the driver's calls retry and it resumes the trainer), a SIGSTOP
of the trainer (a hang shorter than the driver's `--outage-s`) and a kill -9 of Redis (restarted
on X's port from its append-only file: the pointer survives). `arlo train` still finishes its
steps with rc 0. Then a SIGTERM of a second `arlo train` stops its rollout worker, and a kill -9
of `arlo up` takes every child (services and Redis) down with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
import yaml

from arlo.app.redis_server import free_port, redis_answers
from arlo.app.supervisor import ProcessSpec, Supervisor, is_serving
from tests.support.procs import gone, processes

pytestmark = [pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
INFRA = ("env_gateway", "reward", "inference", "trainer")


def find(fragment: str, *, under: str) -> list[int]:
    """Pids whose command line holds `fragment` and `under` (e.g. this test's $ARLO_HOME)."""
    return [pid for pid, (_, cmd) in processes().items() if fragment in cmd and under in cmd]


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_children_die_with_their_parent_and_redis_restarts_from_its_aof(tmp_path: Path) -> None:
    """Fast: a supervisor in a subprocess starts a persistent Redis and a plain child; kill -9 of
    the Redis is repaired by `check()` with the data intact; kill -9 of the parent kills both."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from arlo.app.redis_server import redis_spec
        from arlo.app.supervisor import ProcessSpec, Supervisor
        sup = Supervisor([])
        sup.start(redis_spec({url!r}, Path({str(tmp_path / 'redis')!r}), Path({str(tmp_path)!r})), 30)
        sup.start(ProcessSpec(name="sleeper", argv=("sleep", "600"), address="", log_path=Path({str(tmp_path)!r}) / "s.log",
                              ready=lambda a, t: True), 30)
        print(" ".join(str(c.process.pid) for c in sup.children.values()), flush=True)
        for line in sys.stdin:   # each line: the Redis was killed; restart it, report the pids
            # Until check() sees it dead: a killed Redis's main thread shows as a zombie in /proc
            # (the test's "gone") while a thread still in fsync keeps waitpid from reporting it.
            deadline = time.monotonic() + 30
            while "redis" not in sup.check() and time.monotonic() < deadline:
                time.sleep(0.1)
            sup.wait_healthy("redis", 30)
            print(" ".join(str(c.process.pid) for c in sup.children.values()), flush=True)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        redis_pid, sleeper = map(int, parent.stdout.readline().split())
        client = redis.Redis.from_url(url)
        client.hset("arlo:t:weights", mapping={"version": 7})
        client.xadd("arlo:t:traj", {"pb": b"x"})
        os.kill(redis_pid, signal.SIGKILL)
        wait_for(lambda: gone([redis_pid]), 10, "redis to die")
        parent.stdin.write("check\n")
        parent.stdin.flush()
        new_redis, same_sleeper = map(int, parent.stdout.readline().split())
        assert new_redis != redis_pid and same_sleeper == sleeper
        assert redis_answers(url) and client.hget("arlo:t:weights", "version") == b"7"
        assert client.xlen("arlo:t:traj") == 1  # the AOF under the data dir replayed both writes
        client.close()
        parent.kill()
        parent.wait()
        wait_for(lambda: gone([new_redis, sleeper]), 10, "children to die with their parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_stop_all_never_raises_on_dead_or_stopped_children(tmp_path: Path) -> None:
    sup = Supervisor([])
    for name in ("a", "b"):
        sup.start(ProcessSpec(name=name, argv=("sleep", "600"), address="", log_path=tmp_path / f"{name}.log",
                              ready=lambda a, t: True), 10)
    os.kill(sup.children["a"].process.pid, signal.SIGKILL)
    os.kill(sup.children["b"].process.pid, signal.SIGSTOP)  # a hung child still stops
    codes = sup.stop_all(grace_s=5)
    assert codes == {"a": -signal.SIGKILL, "b": -signal.SIGTERM}


STOP_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from arlo.app.supervisor import ProcessSpec, Supervisor
    sup = Supervisor([])
    for name in ("a", "b"):  # children that ignore SIGTERM: a graceful stop waits out its grace
        log = Path(sys.argv[1]) / f"{name}.log"
        sup.start(ProcessSpec(name=name, argv=("sh", "-c", "trap '' TERM; echo up; sleep 600 & wait"), address="",
                              log_path=log, ready=lambda a, t, log=log: "up" in log.read_text()), 10)
    print(" ".join(str(c.process.pid) for c in sup.children.values()), flush=True)
    print(sup.stop_all(grace_s=300), flush=True)
""")


def test_a_ctrl_c_while_stopping_kills_the_children_and_does_not_raise(tmp_path: Path) -> None:
    """`stop_all` waiting out children's grace is cut short by Ctrl-C (a second Ctrl-C of `arlo
    demo`): every child is killed at once and it still returns their codes (the interrupt used
    to escape from the wait as a traceback)."""
    proc = subprocess.Popen([sys.executable, "-c", STOP_SCRIPT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        time.sleep(1.0)  # inside stop_all's wait now (the children ignore its SIGTERM)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert out.strip() == str({"b": -signal.SIGKILL, "a": -signal.SIGKILL}) or \
        out.strip() == str({"a": -signal.SIGKILL, "b": -signal.SIGKILL}), out
    assert gone(pids)


def write_config(path: Path, home: Path, redis_url: str) -> dict:
    cfg: dict = {"run_id": "drive", "redis": {"url": redis_url},
                 "trainer": {"groups_per_step": 2, "checkpoint_every": 2, "checkpoint_dir": str(home / "ckpt"),
                             "max_staleness": 1000},
                 "rollout": {"group_size": 4, "concurrent_groups": 2}}
    for name in (*INFRA, "rollout"):
        cfg.setdefault(name, {})["server"] = {"port": free_port(), "metrics_port": free_port(), "grace_s": 0.5}
    path.write_text(yaml.safe_dump(cfg))
    return cfg


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_train_rides_out_trainer_kill_hang_and_redis_kill(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    config = tmp_path / "run.yaml"
    cfg = write_config(config, home, f"redis://127.0.0.1:{port}/0")
    env = {**os.environ, "ARLO_HOME": str(home), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("ARLO_TOKEN", None)
    cli = [sys.executable, "-m", "arlo.app.cli"]
    up = subprocess.Popen([*cli, "up", "-c", str(config)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "up.err", "w"))  # noqa: SIM115
    train = None
    try:
        address = {n: f"127.0.0.1:{cfg[n]['server']['port']}" for n in INFRA}
        def serving() -> bool:
            assert up.poll() is None, (tmp_path / "up.err").read_text()[-3000:]
            return all(is_serving(a) for a in address.values())

        wait_for(serving, 400, "arlo up to serve")
        # Item 12: the Redis that `arlo up -c X` started answers at X's redis.url.
        assert redis_answers(cfg["redis"]["url"])
        client = redis.Redis.from_url(cfg["redis"]["url"], socket_timeout=5)
        pointer = f"arlo:{cfg['run_id']}:weights"

        def version() -> int:
            try:
                return int(client.hget(pointer, "version") or 0)
            except redis.RedisError:
                return 0

        # Enough to outlast every fault below on a fast machine: with 8, an idle CI machine's run
        # reached its last step right after the trainer's restart (resumed from its step-6
        # checkpoint), and `arlo train` had exited 0 before the hang it was to ride out.
        steps = 40
        train = subprocess.Popen([*cli, "train", "-c", str(config), "--steps", str(steps), "--no-eval",
                                  "--outage-s", "120", "--json", str(tmp_path / "train.json")],
                                 env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / "train.err", "w"))  # noqa: SIM115
        versions: list[int] = []

        def reached(v: int) -> bool:
            assert train.poll() is None, (tmp_path / "train.err").read_text()[-3000:]
            versions.append(version())
            return versions[-1] >= v

        wait_for(lambda: reached(3), 300, "3 versions")
        (trainer,) = find("services.trainer", under=str(home))
        os.kill(trainer, signal.SIGKILL)  # `arlo up` restarts it, paused
        restarted = wait_for(lambda: [p for p in find("services.trainer", under=str(home)) if p != trainer], 30,
                             "the supervised restart")
        wait_for(lambda: is_serving(address["trainer"]), 300, "the restarted trainer")
        after_kill = version()
        wait_for(lambda: reached(after_kill + 1), 300, "a step after the restart")
        os.kill(restarted[0], signal.SIGSTOP)  # a hang: every driver call times out meanwhile
        time.sleep(20)
        assert train.poll() is None, (tmp_path / "train.err").read_text()[-3000:]
        os.kill(restarted[0], signal.SIGCONT)
        (redis_pid,) = find("redis-server", under=str(port))
        before_redis = version()
        os.kill(redis_pid, signal.SIGKILL)  # `arlo up` restarts it on the same port from its AOF
        wait_for(lambda: redis_answers(cfg["redis"]["url"]), 30, "the restarted redis")
        assert version() >= before_redis  # the pointer survived the crash
        assert train.wait(timeout=400) == 0, (tmp_path / "train.err").read_text()[-3000:]
        report = json.loads((tmp_path / "train.json").read_text())
        assert report["pointer_version"] >= max(versions) and report["trainer_version"] >= report["pointer_version"]
        assert "resuming it" in (tmp_path / "train.err").read_text()  # the restarted trainer was re-resumed
        seen = [v for v in versions if v]  # 0: Redis was down for that sample
        assert seen == sorted(seen)  # the pointer never went back, through both restarts

        # Item 11: SIGTERM of `arlo train` stops its rollout worker, wherever it lands as the run
        # starts (CI: one landed in torch's import under tensorboardX and `arlo train` aborted,
        # SIGABRT; one repro hung: arlo/app/stopping.py).
        for delay_s in (0.0, 0.1, 0.3, 0.6, 1.2):
            err = tmp_path / "train-term.err"
            train = subprocess.Popen([*cli, "train", "-c", str(config), "--no-eval"], env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=open(err, "w"))  # noqa: SIM115
            rollout = wait_for(lambda pid=train.pid: [p for p, (pp, cmd) in processes().items()
                                                      if pp == pid and "services.rollout" in cmd], 300,
                               "the rollout worker")
            wait_for(lambda: is_serving(f"127.0.0.1:{cfg['rollout']['server']['port']}"), 300, "rollout serving")
            time.sleep(delay_s)
            train.send_signal(signal.SIGTERM)
            assert train.wait(timeout=120) == 130, (delay_s, err.read_text()[-3000:])
            assert wait_for(lambda pids=rollout: gone(pids), 30, "the rollout worker to stop")

        # Item 11: kill -9 of `arlo up` takes every child down, Redis included.
        children = [p for p, (pp, _) in processes().items() if pp == up.pid]
        assert len(children) == 5  # four services and Redis
        up.kill()
        up.wait()
        wait_for(lambda: gone(children), 20, "arlo up's children to die with it")
        assert not redis_answers(cfg["redis"]["url"], 0.5)
    finally:
        for p in (train, up):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for pid in find(str(home), under=str(home)):
            os.kill(pid, signal.SIGKILL)



async def test_resilient_stub_waits_out_a_server_that_comes_late_and_gives_up_after_the_outage() -> None:
    """The driver's calls (arlo/app/resilient.py) against a real server that is not there yet,
    then is: the call succeeds once it is; with nothing ever there it fails after `outage_s`."""
    import asyncio

    import grpc

    from arlo.app.resilient import ResilientStub, RetryPolicy
    from arlo.config import AuthConfig, ServerConfig
    from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
    from arlo.rpc import ServiceBinding, start_server
    from services.reward.registry import default_registry
    from services.reward.scoring import Scorer
    from services.reward.server import RewardServicer

    port = free_port()
    request = reward_pb2.ScoreRequest(reward_fn="exact_match", response="1", reference="1")
    policy = RetryPolicy(outage_s=30.0, call_timeout_s=2.0)

    async def start_late():
        await asyncio.sleep(1.5)
        name = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
        return await start_server("test", ServerConfig(port=port, metrics_port=-1), AuthConfig(disabled=True),
                                  [ServiceBinding(name, reward_pb2_grpc.add_RewardServicer_to_server,
                                                  RewardServicer(default_registry(), Scorer(timeout_s=5.0)))])

    late = asyncio.create_task(start_late())
    async with ResilientStub(reward_pb2_grpc.RewardStub, f"127.0.0.1:{port}", token=None, tls=None,
                             policy=policy) as stub:
        reply = await stub.Score(request, timeout=5)
    running = await late
    await running.stop(None)
    assert reply.reward == 1.0
    started = time.monotonic()
    async with ResilientStub(reward_pb2_grpc.RewardStub, f"127.0.0.1:{free_port()}", token=None, tls=None,
                             policy=RetryPolicy(outage_s=1.0, call_timeout_s=0.5)) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Score(request)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and 1.0 <= time.monotonic() - started < 10
