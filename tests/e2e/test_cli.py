"""End to end: every service as a real subprocess against a real Redis, driven by the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from arlo.app.redis_server import free_port
from arlo.tracing.summary import read_spans
from tests.support.procs import children_of, gone, processes

pytestmark = pytest.mark.e2e

SERVICES = ("inference", "trainer", "env_gateway", "reward", "rollout")
ROOT = Path(__file__).resolve().parents[2]


def write_config(path: Path, run_id: str, redis_url: str, *, fixed_ports: bool) -> Path:
    cfg: dict = {"run_id": run_id, "redis": {"url": redis_url}, "trainer": {"groups_per_step": 2},
                 "rollout": {"group_size": 4, "concurrent_groups": 2, "eval": {"num_tasks": 4, "samples": 1}}}
    if fixed_ports:
        for name in SERVICES:
            cfg.setdefault(name, {})["server"] = {"port": free_port(), "metrics_port": free_port()}
    path.write_text(yaml.safe_dump(cfg))
    return path


def arlo(*args: str, home: Path, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ARLO_HOME": str(home), "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "arlo.app.cli", *args], env=env, capture_output=True, text=True, **kw)


def wait_until_up(up: subprocess.Popen, home: Path, out: Path, timeout_s: float = 300) -> dict:
    """`arlo status --json` once every service but the rollout is healthy (or the last one seen
    at the deadline); `arlo up` exiting meanwhile fails with the end of its output."""
    deadline, status = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        assert up.poll() is None, out.read_text()[-4000:]
        result = arlo("status", "--json", home=home, timeout=60)
        if result.returncode == 0:
            status = json.loads(result.stdout)
            if all(s["healthy"] for s in status["services"] if s["name"] != "rollout"):
                break
        time.sleep(1)
    return status


@pytest.mark.slow  # ~6 min on an idle 2-core machine: 600 SFT steps, 30 RL steps, 5 evaluations
@pytest.mark.timeout(1600)  # above the demo's own 1500 s limit: never cut short by the suite's default
def test_demo_config_learns_through_every_service(tmp_path: Path, redis_url: str, run_id: str) -> None:
    """The built-in demo's config (SFT warm start, then RL), shortened to 30 RL steps: every
    service a subprocess, and held-out reward must rise over the warm start by RL alone."""
    demo = yaml.safe_load((ROOT / "arlo" / "data" / "demo.yaml").read_text())
    demo.update(run_id=run_id, redis={"url": redis_url})
    demo["rollout"]["eval"].update(num_tasks=32, samples=4)
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(demo))
    out = tmp_path / "demo.json"
    result = arlo("demo", "-c", str(config), "--steps", "30", "--json", str(out), home=tmp_path / "home", timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["steps"] == report["sft_steps"] + 30 and report["sft_steps"] == demo["trainer"]["sft"]["steps"]
    print({k: report[k] for k in ("reward_start", "reward_after_sft", "reward_end", "wall_s")})
    # Learning: random init scores ~0; the warm start helps; RL must add on its own.
    assert report["reward_start"] <= 0.05 < report["reward_after_sft"]
    assert report["reward_end"] >= report["reward_after_sft"] + 0.1
    # The fleet serves what the trainer published, and the evaluation at the end saw exactly that.
    assert report["inference_versions"] and all(v == report["pointer_version"]
                                                 for v in report["inference_versions"].values())
    assert report["evals"]["end"]["served_version"] == report["pointer_version"] >= 31
    # every_versions: evaluations on the way, by the same workers, none skipped; each names the
    # versions its episodes were actually sampled from (at least the one asked for).
    for tag in ("v10", "v20", "v30"):
        e = report["evals"][tag]
        assert "error" not in e, e
        assert e["requested_version"] <= e["min_version"] <= e["max_version"] <= report["pointer_version"], e
    client = redis.Redis.from_url(redis_url)
    assert int(client.hget(f"arlo:{run_id}:weights", "version")) == report["pointer_version"]
    (run_dir,) = (tmp_path / "home" / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert {r["phase"] for r in steps} == {"sft", "rl"} and len([r for r in rows if r["kind"] == "eval"]) >= 4
    # One row per trainer step, none skipped, each the trainer's own record of it.
    assert [r["step"] for r in steps] == list(range(steps[0]["step"], steps[-1]["step"] + 1))
    assert len(steps) == report["steps"]
    rl = [r for r in steps if r["phase"] == "rl"]
    # The documented bound, exactly: no trained token more than max_staleness versions behind.
    assert all(0 <= r["staleness_max"] <= demo["trainer"]["max_staleness"] for r in rl)
    # The warm start is a boundary (issue 32): the first RL step trains on nothing sampled before
    # it, so on-policy tokens only, and its sampler and trainer agree (was staleness 1.0, mismatch 9.4).
    assert rl[0]["staleness_mean"] == 0 and rl[0]["logprob_mismatch"] < 1, rl[0]
    assert all(r["generated_tokens"] > 0 and "reward_components" in r and "grad_norm" in r for r in rl)
    assert [r["generated_tokens"] for r in rl] == sorted(r["generated_tokens"] for r in rl)
    assert all(r["step"] <= steps[-1]["step"] for r in rows if r["kind"] == "eval")
    assert (run_dir / "reward.png").read_bytes().startswith(b"\x89PNG")
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.timeout(1200)  # the waits inside: 300 s for health, 600 s for training, 60 s each for the rest
def test_up_status_train_and_clean_shutdown(tmp_path: Path, redis_url: str, run_id: str) -> None:
    config = write_config(tmp_path / "run.yaml", run_id, redis_url, fixed_ports=True)
    config.write_text(config.read_text() + "tracing:\n  enabled: true\n")
    home = tmp_path / "home"
    env = {**os.environ, "ARLO_HOME": str(home), "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_TOKEN", None)
    up = subprocess.Popen([sys.executable, "-m", "arlo.app.cli", "up", "-c", str(config)], env=env,
                          # A file, not a pipe nobody reads: once `arlo up` had written 64 KiB its writes
                          # blocked, and so did its shutdown (CI: no exit 60 s after SIGINT).
                          stdout=open(tmp_path / "up.out", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        status = wait_until_up(up, home, tmp_path / "up.out")
        assert {s["name"] for s in status["services"]} == set(SERVICES)
        assert status["queue_depth"] >= 0 and "trainer_version" in status
        train = arlo("train", "--steps", "2", "--json", str(tmp_path / "train.json"), home=home, timeout=600)
        assert train.returncode == 0, train.stderr[-4000:]
        report = json.loads((tmp_path / "train.json").read_text())
        assert report["steps"] >= 2 and report["pointer_version"] >= 2
        # Throughput over the RL phase: 2 prompts x 4 samples a step (write_config).
        assert report["interrupted"] is False and report["rl_steps"] == report["steps"]
        assert report["trajectories"] == 8 * report["rl_steps"] and report["generated_tokens"] > 0
        assert report["rl_steps_per_s"] == pytest.approx(report["rl_steps"] / report["rl_wall_s"], rel=1e-3)
        assert report["generated_tokens_per_s"] > report["trajectories_per_s"] > 0
        after = json.loads(arlo("status", "--json", home=home, timeout=60).stdout)
        inference = next(s for s in after["services"] if s["name"] == "inference")
        assert inference["weight_version"] == after["pointer_version"] >= 2
        # The OpenAI endpoint is on by default in `arlo up`, and `status --json` gives its URL.
        token = (home / "token").read_text().strip()
        request = urllib.request.Request(f"{inference['openai_url']}/models", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            models = json.loads(reply.read())
        assert models["data"][0]["policy_version"] >= 2
        diagnostics = after["trainer_diagnostics"]  # the trainer's last step record
        assert diagnostics["phase"] == "rl" and diagnostics["version"] == after["trainer_version"]
        assert {"loss", "reward_mean", "grad_norm", "staleness_max", "queue_depth"} <= set(diagnostics)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(timeout=90)  # its stop is bounded at 2 x 15 s grace, plus a loaded machine
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert code == 0
    # With tracing.enabled, `arlo up` writes a span file per service, flushed by the services' graceful stop.
    traces = home / "traces"
    assert sorted(p.name for p in traces.iterdir()) == sorted(f"{name}.jsonl" for name in SERVICES)
    spans = read_spans(traces)
    steps = [s for s in spans if s["name"] == "trainer.step"]
    assert len(steps) >= 2 and all(s["service"] == "trainer" and s["parent_id"] is None for s in steps)
    assert {s["name"] for s in spans if s["parent_id"] in {x["span_id"] for x in steps}} >= {
        "trainer.batch", "trainer.train", "trainer.publish"}
    episode_traces = {s["trace_id"] for s in spans if s["name"] == "rollout.episode"}
    assert any(s["service"] == "inference" and s["kind"] == "SERVER" and s["trace_id"] in episode_traces
               for s in spans)


@pytest.mark.timeout(600)  # the waits inside: 300 s for the first steps, 120 s for the stop
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_demo_interrupted_keeps_its_report_and_a_second_ctrl_c_kills_the_services(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    """Ctrl-C of `arlo demo` mid-run, twice: exit 130 and a `--json` report of what the run did
    (it was not written at all; then a second Ctrl-C while the run record closed lost it),
    throughput included; no traceback, no process left."""
    config = write_config(tmp_path / "run.yaml", run_id, redis_url, fixed_ports=False)
    home, out, err = tmp_path / "home", tmp_path / "demo.json", tmp_path / "demo.err"
    with demo_process(home, err, "-c", str(config), "--steps", "100000", "--no-eval", "--json", str(out)) as demo:
        deadline = time.monotonic() + 300
        while not rl_rows(home, at_least=2):
            assert demo.poll() is None and time.monotonic() < deadline, err.read_text()[-4000:]
            time.sleep(0.2)
        services = children_of(demo.pid)
        assert len(services) == 5, services  # four services and the rollout worker (Redis is the test's)
        demo.send_signal(signal.SIGINT)
        time.sleep(0.3)  # an impatient second Ctrl-C: while the drive unwinds, the record closes or they stop
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 130, err.read_text()[-4000:]
    text = err.read_text()
    assert "Traceback" not in text, text[-4000:]
    assert gone(services)
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["rl_steps"] >= 2 and report["steps"] >= report["rl_steps"]
    assert report["trajectories"] == 8 * report["rl_steps"] and report["generated_tokens_per_s"] > 0
    assert report["rl_steps_per_s"] > 0 and len(report["rewards"]) == report["rl_steps"]
    assert 0 < report["first_rl_step_s"] < 300 and report["failed"] is None
    assert len(rl_rows(home, at_least=0)) >= report["rl_steps"]  # the run record has every step it reports


@contextlib.contextmanager
def demo_process(home: Path, err: Path, *args: str) -> Iterator[subprocess.Popen]:
    """`arlo demo ARGS` as a subprocess (stderr to `err`), killed at the end if still running."""
    env = {**os.environ, "ARLO_HOME": str(home), "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_TOKEN", None)
    with open(err, "w") as stderr:
        demo = subprocess.Popen([sys.executable, "-m", "arlo.app.cli", "demo", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            yield demo
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()


def rl_rows(home: Path, *, at_least: int) -> list[dict]:
    """The RL step rows of the run record under `home` (empty until there are `at_least`)."""
    rows = [json.loads(line) for path in (home / "runs").glob("*/metrics.jsonl")
            for line in path.read_text().splitlines() if line.strip()]
    rl = [r for r in rows if r.get("kind") == "step" and r.get("phase") == "rl"]
    return rl if len(rl) >= at_least else []


@pytest.mark.timeout(300)
def test_demo_stopped_while_its_services_start_stops_them_cleanly(tmp_path: Path, redis_url: str,
                                                                    run_id: str) -> None:
    """SIGHUP (its terminal closed) while `arlo demo` waits for its services: exit 130, no
    traceback (a Ctrl-C escaped from the supervisor's wait; SIGHUP's default ended the demo at once,
    129, without a report), no service left, and a `--json` report of no steps that says so."""
    config = write_config(tmp_path / "run.yaml", run_id, redis_url, fixed_ports=False)
    home, out, err = tmp_path / "home", tmp_path / "demo.json", tmp_path / "demo.err"
    with demo_process(home, err, "-c", str(config), "--no-eval", "--json", str(out)) as demo:
        deadline = time.monotonic() + 120
        while len(services := children_of(demo.pid)) < 4:  # the four backends, starting
            assert demo.poll() is None and time.monotonic() < deadline, err.read_text()[-4000:]
            time.sleep(0.05)
        demo.send_signal(signal.SIGHUP)
        assert demo.wait(timeout=120) == 130, err.read_text()[-4000:]
    assert "Traceback" not in err.read_text(), err.read_text()[-4000:]
    assert gone(services)
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["failed"] is None and report["rl_steps"] == 0


@pytest.mark.timeout(300)
def test_demo_refuses_what_it_could_not_finish_before_it_starts_and_reports_a_failed_start(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    """Bad `--json` paths and `--steps` are refused (exit 2) before anything starts; a start that
    fails (ARLO_HOME is a file) is one line, not a traceback, and `--json` says why."""
    config = write_config(tmp_path / "run.yaml", run_id, redis_url, fixed_ports=False)
    home = tmp_path / "home"
    for bad, says in ((["--json", str(tmp_path)], "is a folder"),
                      (["--json", str(tmp_path / ("a" * 256 + ".json"))], "cannot be written"),
                      (["--json", str(tmp_path / "r.json") + "/"], "names a folder"),
                      (["--steps", "99999999999999999999"], "--steps must be in")):
        refused = arlo("demo", "-c", str(config), *bad, home=home, timeout=60)
        assert refused.returncode == 2 and says in " ".join(refused.stderr.split()), (bad, refused.stderr[-2000:])
        assert "Traceback" not in refused.stderr and not (home / "logs").exists()
    home.write_text("not a folder")
    out = tmp_path / "failed.json"
    failed = arlo("demo", "-c", str(config), "--json", str(out), home=home, timeout=60)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert str(home) in "".join(failed.stderr.split())
    report = json.loads(out.read_text())
    assert report["failed"].startswith("FileExistsError") and report["interrupted"] is False
    no_redis = tmp_path / "no_redis.yaml"
    no_redis.write_text(yaml.safe_dump({"run_id": run_id, "redis": {"url": f"redis://127.0.0.1:{free_port()}"}}))
    # At once, not after the ~37 s a service rides out a Redis outage for.
    status = arlo("status", "-c", str(no_redis), home=tmp_path / "home2", timeout=30)
    assert status.returncode == 1 and "Traceback" not in status.stderr and "Redis" in status.stderr, status.stderr


@pytest.mark.slow  # ~2 min: `arlo up`, then a run that fails when its trainer hangs
@pytest.mark.timeout(900)  # the waits inside: 300 s for health, 300 s for RL steps, 120 s for the failure
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_run_that_fails_mid_way_keeps_its_report(tmp_path: Path, redis_url: str, run_id: str) -> None:
    """`arlo train` whose trainer hangs past `--outage-s`: exit 1 with one line saying why, and the
    `--json` report holds the steps it saw (it was lost with any error but a signal)."""
    config = write_config(tmp_path / "run.yaml", run_id, redis_url, fixed_ports=True)
    home, out = tmp_path / "home", tmp_path / "train.json"
    env = {**os.environ, "ARLO_HOME": str(home), "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_TOKEN", None)
    with open(tmp_path / "up.out", "w") as up_out:
        up = subprocess.Popen([sys.executable, "-m", "arlo.app.cli", "up", "-c", str(config)], env=env,
                              stdout=up_out, stderr=subprocess.STDOUT)
    trainer = None
    try:
        deadline = time.monotonic() + 300
        while arlo("status", "-c", str(config), home=home, timeout=60).returncode != 0 or not all(
                s["healthy"] for s in json.loads(arlo("status", "-c", str(config), "--json", home=home,
                                                      timeout=60).stdout)["services"] if s["name"] != "rollout"):
            assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()[-4000:]
            time.sleep(1)
        trainer = next(pid for pid in children_of(up.pid) if "services.trainer" in processes()[pid][1])
        with open(tmp_path / "train.err", "w") as err:
            train = subprocess.Popen([sys.executable, "-m", "arlo.app.cli", "train", "-c", str(config), "--steps",
                                      "100000", "--no-eval", "--outage-s", "2", "--json", str(out)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 300
            while not rl_rows(home, at_least=2):
                assert train.poll() is None and time.monotonic() < deadline, (tmp_path / "train.err").read_text()
                time.sleep(0.2)
            os.kill(trainer, signal.SIGSTOP)  # hung: every call to it times out
            assert train.wait(timeout=120) == 1, (tmp_path / "train.err").read_text()[-4000:]
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
    finally:
        if trainer is not None:
            os.kill(trainer, signal.SIGCONT)
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    text = (tmp_path / "train.err").read_text()
    assert "Traceback" not in text and "arlo train:" in text, text[-4000:]
    report = json.loads(out.read_text())
    assert report["failed"] and report["interrupted"] is False, report
    assert report["rl_steps"] >= 2 and len(report["rewards"]) == report["rl_steps"]
