"""One trace per episode across processes: rollout, inference, env_gateway and reward as real
subprocesses (`python -m services.<name>`) writing span files; SIGTERM flushes them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from arlo.app.redis_server import free_port
from arlo.app.supervisor import is_serving
from arlo.tracing.summary import read_spans

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("env_gateway", "reward", "inference", "rollout")


def start(name: str, config: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ARLO_TOKEN": "trace-token", "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_CONFIG", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    log = (tmp_path / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{name}", "-c", str(config)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def wait_until(
    predicate, timeout_s: float, what: str, procs: dict[str, subprocess.Popen[bytes]], tmp_path: Path
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout_s}s")


def descendants(spans: list[dict], root: dict) -> list[dict]:
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    out, frontier = [], [root["span_id"]]
    while frontier:
        found = children.get(frontier.pop(), [])
        out += found
        frontier += [s["span_id"] for s in found]
    return out


@pytest.mark.timeout(400)
def test_an_episode_is_one_trace_across_rollout_inference_env_and_reward(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    traces = tmp_path / "traces"
    ports = {name: free_port() for name in SERVICES}
    cfg = {
        "run_id": run_id,
        "redis": {"url": redis_url},
        "tracing": {"enabled": True, "dir": str(traces)},
        # One arith turn: the environment ends each episode with an answer, so each is scored.
        "rollout": {
            "group_size": 2,
            "concurrent_groups": 1,
            "max_turns": 2,
            "env_config_json": '{"max_turns": 1}',
        },
    }
    for name, port in ports.items():
        cfg.setdefault(name, {})["server"] = {"port": port, "metrics_port": -1}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in SERVICES[:3]:
            procs[name] = start(name, config, tmp_path)
        wait_until(
            lambda: all(is_serving(f"127.0.0.1:{ports[n]}") for n in SERVICES[:3]),
            240,
            "healthy services",
            procs,
            tmp_path,
        )
        procs["rollout"] = start("rollout", config, tmp_path)
        stream = redis.Redis.from_url(redis_url)
        wait_until(
            lambda: stream.exists(f"arlo:{run_id}:traj") and stream.xlen(f"arlo:{run_id}:traj") >= 4,
            120,
            "two groups of trajectories",
            procs,
            tmp_path,
        )
    finally:
        codes = {}
        for name in reversed(list(procs)):  # rollout first, as the supervisor stops them
            procs[name].send_signal(signal.SIGTERM)
            try:
                codes[name] = procs[name].wait(timeout=30)
            except subprocess.TimeoutExpired:
                procs[name].kill()
                procs[name].wait()
    assert all(code == 0 for code in codes.values()), codes

    # The files are written by the flush on SIGTERM at the latest.
    assert sorted(p.name for p in traces.iterdir()) == sorted(f"{n}.jsonl" for n in SERVICES)
    spans = read_spans(traces)
    episodes = [s for s in spans if s["name"] == "rollout.episode" and s["service"] == "rollout"]
    assert all(e["parent_id"] is None for e in episodes)
    # Episodes in flight at the SIGTERM end cancelled (no result attributes, no later RPCs): the
    # checks below are of the finished ones, of which the stream held at least four.
    episodes = [e for e in episodes if "arlo.status" in e["attributes"]]
    assert len(episodes) >= 4
    finished = {e["span_id"] for e in episodes}
    # Steps, Generates and Scores that arrived together left as one StepBatch / GenerateBatch /
    # ScoreBatch: a root span linked to each episode it carried. One that carried a finished episode
    # reached its service; one the SIGTERM cancelled (carrying only episodes that then never finished)
    # may not have, so only the former are held to it.
    carried: dict[str, set[str]] = {}
    for kind, service, rpc in (
        ("step", "env_gateway", "/arlo.v1.Environment/StepBatch"),
        ("generate", "inference", "/arlo.v1.Inference/GenerateBatch"),
        ("score", "reward", "/arlo.v1.Reward/ScoreBatch"),
    ):
        roots = [s for s in spans if s["name"] == f"rollout.{kind}_batch"]
        assert all(r["parent_id"] is None and r["links"] for r in roots)
        for root in roots:
            if finished & {link["span_id"] for link in root["links"]}:
                reached = [
                    c for c in descendants(spans, root)
                    if c["name"] == rpc and c["service"] == service and c["kind"] == "SERVER"
                ]
                assert reached, (kind, root)
        carried[kind] = {link["span_id"] for r in roots for link in r["links"]}
    batched = carried["step"]
    for episode in episodes:
        tree = descendants(spans, episode)
        assert all(s["trace_id"] == episode["trace_id"] for s in tree)
        served = {(s["service"], s["name"]) for s in tree if s["kind"] == "SERVER"}
        assert ("env_gateway", "/arlo.v1.Environment/Reset") in served, served
        # Its step went alone (a child) or inside a StepBatch with others' (a root linked to it).
        assert ("env_gateway", "/arlo.v1.Environment/Step") in served or episode["span_id"] in batched, served
        assert ("inference", "/arlo.v1.Inference/Generate") in served or episode["span_id"] in carried["generate"]
        assert ("reward", "/arlo.v1.Reward/Score") in served or episode["span_id"] in carried["score"], served
        attributes = episode["attributes"]
        assert (attributes["arlo.env"], attributes["arlo.turns"], attributes["arlo.finish_reason"]) == (
            "arith",
            1,
            "done",
        )
        assert attributes["arlo.reward"] in (0.0, 1.0) and attributes["arlo.policy_version"] == 0
    assert not [s for s in spans if "Health" in s["name"]]
