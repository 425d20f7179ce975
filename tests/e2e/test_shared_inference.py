"""Two runs on one inference service, end to end (issue 35's bar for item 3): one inference
process serves run A (its config's `run_id`) and run B (`inference.runs: [B]`), each on its own
LoRA adapter slot over the same `tiny` base; one env_gateway and one reward service serve both;
each run has its own trainer and rollout worker, run id and Redis keys. Every service is a real
subprocess on a real Redis (docs/deploy.md#several-runs-on-one-inference-fleet).

The bar: both runs step (20 RL steps each), neither trainer drops a trajectory as stale (a
run alone drops none here: its admission rule keeps it within its own staleness bound; a drop
would mean the other run's publishes paused or replaced this run's adapter), and the adapters
never mix: every model token of a run's trajectories carries a version its own trainer published.

Run A starts first and is LEAD versions ahead when run B's rollout worker starts, and the runs
take different batches (A one group a step, B three), so their version numbers stay apart. A
trajectory at index i of a run's stream can only carry version v if that run's trainer had
consumed v of its batches before it was written (i >= v x batch): the test checks this for
every trajectory, and that it would have failed for B's had they carried the version A served
when they were written (a mix-up cannot pass unseen). A's trajectories carrying B's older
versions would be dropped as stale by A's trainer.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import yaml

from arlo.app.redis_server import free_port
from arlo.app.supervisor import ProcessSpec, ServiceFailed, Supervisor, log_tail
from arlo.compile_cache import ENV as COMPILE_CACHE_ENV
from arlo.coord import codec

pytestmark = pytest.mark.e2e

STEPS = 20
LEAD = 10
"""Run A's version when run B's rollout worker starts."""
RUN_TIMEOUT_S = 300  # start-up and both runs' 20 steps: ~1 min on 2 cores, 4 at a load of 20
GROUP_SIZE = 4
RUNS = {"a": {"groups": 1, "max_staleness": 1}, "b": {"groups": 3, "max_staleness": 1}}
"""Each run's own batch (groups_per_step) and staleness bound."""


def run_config(path: Path, *, run_id: str, other: str | None, redis_url: str, ports: dict[str, int],
               trainer_port: int, rollout_port: int, groups: int, max_staleness: int) -> Path:
    """A run's config: the shared services' addresses, its own trainer and rollout ports.
    `other`: the run the inference service serves beside this one (only the config it starts with)."""
    def server(port: int) -> dict:
        return {"host": "127.0.0.1", "port": port, "metrics_port": -1, "grace_s": 1.0}

    cfg = {
        "run_id": run_id, "redis": {"url": redis_url}, "auth": {"disabled": True},
        "model": {"name": "tiny", "tokenizer": "byte"},
        # Every run the same base and LoRA shape (the inference service holds one base for all).
        "inference": {"max_n": GROUP_SIZE, "max_tokens": 8, "max_prompt_tokens": 32, "max_batch": 16,
                      "decode_steps": 4, "runs": [other] if other else [], "server": server(ports["inference"])},
        "env_gateway": {"server": server(ports["env_gateway"])},
        "reward": {"server": server(ports["reward"])},
        # A step waits for a slow group of the floor version rather than leave it to go stale
        # (services/trainer/core/expiring.py); the default 10 s can run out under a CI load of
        # ~20 (the likeliest cause of a run that dropped 12), and such drops are the run's own,
        # not the other run's. Waiting out the run keeps a drop here meaning what the test says.
        "trainer": {"groups_per_step": groups, "learning_rate": 0.01, "max_staleness": max_staleness,
                    "expiring_wait_s": float(RUN_TIMEOUT_S), "lora": {"rank": 4}, "server": server(trainer_port)},
        "rollout": {"env_name": "arith", "env_config_json": json.dumps({"op": "+", "max_operand": 9}),
                    "group_size": GROUP_SIZE, "concurrent_groups": 2 * groups, "max_turns": 1,
                    "max_episode_tokens": 40, "sampling": {"temperature": 1.0, "max_tokens": 8},
                    "rpc_timeout_s": 120.0, "server": server(rollout_port)},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def spec(name: str, module: str, config: Path, port: int, logs: Path, env: dict[str, str]) -> ProcessSpec:
    return ProcessSpec(name=name, argv=(sys.executable, "-m", f"services.{module}", "-c", str(config)),
                       address=f"127.0.0.1:{port}", log_path=logs / f"{name}.log", env=env)


def trainer_status(client: redis.Redis, run_id: str) -> dict[str, str]:
    """The trainer's heartbeat hash ({} before its first beat)."""
    for key in client.scan_iter(f"arlo:{run_id}:status:trainer:*"):
        return {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
    return {}


class StreamTap:
    """A run's trajectory stream, read while the run goes: each entry's index over the stream's
    life (XINFO STREAM entries-added, Redis 7), its Redis time and its model tokens' oldest and
    newest versions. No consumer group of its own: one that never reads would stop the trainer
    trimming (it trims what every group acknowledged), and with one a run alone dropped
    trajectories as stale (4 of ~400 at run B's settings; none without it). So it polls faster
    than the trainer trims (an entry lives until a step trained on it); a trimmed entry is only
    a gap here."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client, self.run_id, self.key = client, run_id, f"arlo:{run_id}:traj"
        self.last = "-"
        self.added = 0
        self.entries: list[tuple[int, int, int, int]] = []
        """(index, Redis time in ms, oldest, newest model-token version), in stream order."""

    def poll(self) -> None:
        if not self.client.exists(self.key):
            return
        pipe = self.client.pipeline(transaction=True)  # both at one instant: the indices hold
        pipe.xrange(self.key, min=self.last, max="+")
        pipe.xinfo_stream(self.key)
        raw, info = pipe.execute()
        if "entries-added" not in info:
            pytest.skip("needs Redis >= 7 (XINFO STREAM entries-added)")
        self.added = int(info["entries-added"])
        raw = [(i, f) for i, f in raw if i.decode() != self.last.lstrip("(")]
        for k, (entry_id, fields) in enumerate(raw):
            traj = codec.decode(fields)
            assert traj.run_id == self.run_id, (self.run_id, traj.run_id)
            versions = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
            assert versions and min(versions) >= 0, traj
            index = self.added - len(raw) + k  # what XRANGE gave ends at the newest entry
            self.entries.append((index, int(entry_id.split(b"-")[0]), min(versions), max(versions)))
        if raw:
            self.last = "(" + raw[-1][0].decode()


def step_records(client: redis.Redis, run_id: str) -> list[dict]:
    """The trainer's record of each RL step (the run's metrics stream), in order."""
    rows = [json.loads(f[b"json"]) for _, f in client.xrange(f"arlo:{run_id}:metrics")]
    return [r for r in rows if r.get("kind", "step") == "step" and r.get("phase", "rl") == "rl"]


def served_version(client: redis.Redis, run_id: str) -> int:
    """The version the shared inference service reports serving for this run (its heartbeat
    under the run's own status keys), -1 when it reports none."""
    for key in client.scan_iter(f"arlo:{run_id}:status:inference:*"):
        return int(client.hget(key, "weight_version") or -1)
    return -1


@pytest.mark.slow  # seven services, 20 RL steps per run: ~70 s on 2 cores (most of it start-up compiles)
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # the run's own deadline, then the services' stop (15 s grace)
def test_two_runs_share_one_inference_service_without_mixing_or_stale_drops(
        tmp_path: Path, redis_url: str) -> None:
    suffix = os.urandom(4).hex()
    runs = {"a": f"shared-a-{suffix}", "b": f"shared-b-{suffix}"}
    batch = {name: RUNS[name]["groups"] * GROUP_SIZE for name in runs}
    ports = {name: free_port() for name in ("inference", "env_gateway", "reward", "trainer_a", "trainer_b",
                                            "rollout_a", "rollout_b")}
    configs = {name: run_config(tmp_path / f"{name}.yaml", run_id=runs[name], other=runs["b"] if name == "a" else None,
                                redis_url=redis_url, ports=ports, trainer_port=ports[f"trainer_{name}"],
                                rollout_port=ports[f"rollout_{name}"], **RUNS[name])
               for name in runs}
    logs = tmp_path / "logs"
    env = {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", COMPILE_CACHE_ENV: str(tmp_path / "jax-cache")}
    client = redis.Redis.from_url(redis_url)
    taps = {name: StreamTap(redis.Redis.from_url(redis_url), run) for name, run in runs.items()}
    tapping, tap_errors = threading.Event(), []

    def tap_all() -> None:
        """Polls every run's stream until told to stop, also while services start (the runs go on)."""
        try:
            while not tapping.wait(0.02):
                for tap in taps.values():
                    tap.poll()
        except BaseException as e:  # noqa: BLE001 (raised again in the test's thread)
            tap_errors.append(e)

    tapper = threading.Thread(target=tap_all, name="stream-taps", daemon=True)
    # The shared services (from run A's config, which lists run B) and both trainers start
    # together; the rollout workers follow once they serve.
    backends = [spec("inference", "inference", configs["a"], ports["inference"], logs, env),
                spec("env_gateway", "env_gateway", configs["a"], ports["env_gateway"], logs, env),
                spec("reward", "reward", configs["a"], ports["reward"], logs, env),
                *(spec(f"trainer_{n}", "trainer", configs[n], ports[f"trainer_{n}"], logs, env) for n in runs)]
    rollouts = [spec(f"rollout_{n}", "rollout", configs[n], ports[f"rollout_{n}"], logs, env) for n in runs]
    # Every child dies with this process (die_with_parent) and is stopped below, SIGKILL after 15 s.
    supervisor = Supervisor(backends + rollouts, max_restarts=0)

    def pointers() -> dict[str, int]:
        return {n: int(client.hget(f"arlo:{run}:weights", "version") or 0) for n, run in runs.items()}

    def wait_for(versions: dict[str, int], deadline: float) -> None:
        """Until each run's weight pointer reaches its version; fails at once if a service exits."""
        while not all(pointers()[n] >= v for n, v in versions.items()):
            if tap_errors:
                raise tap_errors[0]
            for child in supervisor.children.values():
                if child.process.poll() is not None:
                    raise ServiceFailed(f"{child.spec.name} exited with {child.process.returncode}:\n"
                                        f"{log_tail(child.spec.log_path, 40)}")
            assert time.monotonic() < deadline, (pointers(), {
                c.spec.name: log_tail(c.spec.log_path, 10) for c in supervisor.children.values()})
            time.sleep(0.2)

    started = time.monotonic()
    deadline = started + RUN_TIMEOUT_S
    tapper.start()
    try:
        supervisor.start_many(backends, timeout_s=300)
        # Run A first, so that its versions lead B's by LEAD all along: B's trajectories carrying
        # A's adapter would then name versions B had not reached (checked below). Run B joins a
        # service already generating for A, as a run added to a live fleet does.
        supervisor.start_many(rollouts[:1], timeout_s=120)
        wait_for({"a": LEAD}, deadline)
        supervisor.start_many(rollouts[1:], timeout_s=120)
        wait_for({"a": STEPS, "b": STEPS}, deadline)
        wall_s = time.monotonic() - started
        time.sleep(2.5)  # a heartbeat period, so each one is from after the last wait
        status = {name: trainer_status(client, run) for name, run in runs.items()}
        served = {name: served_version(client, run) for name, run in runs.items()}
        pointer = pointers()
    finally:
        codes = supervisor.stop_all(grace_s=15.0)
        tapping.set()
        tapper.join(30)
    assert all(c.process.poll() is not None for c in supervisor.children.values()), codes
    if tap_errors:
        raise tap_errors[0]
    try:
        for tap in taps.values():
            tap.poll()
            tap.client.close()
        trajectories = {name: tap.entries for name, tap in taps.items()}
        records = {name: step_records(client, run) for name, run in runs.items()}
        stale = {name: int(client.get(f"arlo:{run}:traj:dropped_stale") or 0) for name, run in runs.items()}
    finally:
        for run in runs.values():
            for key in client.scan_iter(f"arlo:{run}:*"):
                client.delete(key)
        client.close()

    # The check below would catch B's trajectories carrying A's adapter: a B trajectory written
    # when A had already served version v may not name v unless B's trainer had consumed v of
    # its own batches before it (i >= v x batch), and A, LEAD versions ahead, had served
    # versions B's stream could not yet hold. (A's carrying B's older versions would be dropped
    # as stale by A's trainer, checked below too.)
    a_times = [t for _, t, _, _ in trajectories["a"]]
    a_newest = [max(h for _, _, _, h in trajectories["a"][:k + 1]) for k in range(len(a_times))]
    caught = 0
    for i, t, _, _ in trajectories["b"]:
        k = bisect.bisect_right(a_times, t) - 1
        caught += k >= 0 and i < a_newest[k] * batch["b"]
    print({"wall_s": round(wall_s, 1), "pointer": pointer, "served": served,
           "trajectories": {n: (len(t.entries), t.added) for n, t in taps.items()}, "b_would_catch_a": caught})

    for name in runs:
        # Both stepped, each its own sequence of versions (1, 2, ...), one per RL step, each
        # step's tokens within this run's own staleness bound.
        rows = records[name]
        assert [r["version"] for r in rows][:STEPS] == list(range(1, STEPS + 1)), [r["version"] for r in rows]
        assert all(0 <= r["staleness_max"] <= RUNS[name]["max_staleness"] for r in rows), rows
        # Neither dropped anything as stale: its own admission rule keeps its own bound, and
        # the other run's publishes neither paused nor replaced this run's adapter.
        assert stale[name] == 0 and int(status[name].get("dropped_stale", 0)) == 0, (
            name, stale, status[name], {"expiring_timeouts": rows[-1].get("expiring_timeouts") if rows else None})
        # The shared service reports, under each run's own keys, that run's own version.
        assert 1 <= served[name] <= pointer[name], (name, served, pointer)
        # Every model token's version is one this run's trainer published (or the base's 0),
        # and could only have been sampled after this run had trained that many batches.
        own = {0, *(r["version"] for r in rows)}
        # Read while the run went: most entries (one trimmed before a poll is only a gap; run A's
        # one-group steps take ~0.1 s, and a trained entry is trimmed at once).
        assert len(trajectories[name]) >= 0.5 * taps[name].added, (name, len(trajectories[name]), taps[name].added)
        for i, _, low, high in trajectories[name]:
            assert {low, high} <= own, (name, i, low, high)
            assert i >= high * batch[name], (name, i, high, batch[name])
    assert caught >= 0.9 * len(trajectories["b"]), (caught, len(trajectories["b"]))
