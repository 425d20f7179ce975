"""Every bench refuses a bad flag at parse time (argparse's exit 2, one line, no traceback), before
a run spends minutes; --json is checked before the run and written whole at its end.

Nothing here starts a bench run: each case fails in the bench's `parse_args`, which runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import common

ROOT = Path(__file__).resolve().parents[2]

Parse = Callable[[list[str]], argparse.Namespace]


def parse(module: str) -> Parse:
    """The bench's argument handling (module.parse_args), imported on first use."""
    def run(argv: list[str]) -> argparse.Namespace:
        import importlib

        mod = importlib.import_module(f"bench.{module}")
        if module in ("grpo_inprocess", "grpo_inprocess_agent"):
            from bench.grpo_inprocess import parse_args, parser

            p = mod.agent_parser() if module == "grpo_inprocess_agent" else parser(mod.__doc__)
            return parse_args(p, argv)
        return mod.parse_args(argv)
    return run


def refused(module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The bench's refusal of `argv`: exit 2, its message (stderr's last line)."""
    with pytest.raises(SystemExit) as exit_:
        parse(module)(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# (bench, bad arguments, what the message must say)
BAD = [
    # The outside tester's grpo_tiny cases.
    ("grpo_tiny", ["--steps", "0", "--no-inprocess"], "--steps: must be >= 1"),
    ("grpo_tiny", ["--steps", "1"], "--steps must be >= 2 with the in-process baseline"),
    ("grpo_tiny", ["--steps", "-1"], "--steps: must be >= 1"),
    ("grpo_tiny", ["--warmup", "-5"], "--warmup: must be >= 1"),
    ("grpo_tiny", ["--warmup", "0"], "initial weights are never published"),
    ("grpo_tiny", ["--workloads", "bogus"], "unknown 'bogus'"),
    ("grpo_tiny", ["--workloads", ""], "got nothing"),
    ("grpo_tiny", ["--workloads", "76k,76k"], "given twice"),
    ("grpo_tiny", ["--modes", "x"], "--modes: expected a whole number, got 'x'"),
    ("grpo_tiny", ["--modes", "-1"], "--modes: must be >= 0"),
    ("grpo_tiny", ["--cpus", "bogus"], "local.cpus"),
    ("grpo_tiny", ["--cpus", "trainer=999"], "may not use"),
    ("grpo_tiny", ["--compute-nice", "999"], "local.compute_nice"),
    ("grpo_tiny", ["--batch-window-s", "nan"], "rollout.batch_window_s"),
    ("grpo_tiny", ["--inprocess-cpus", "a-b"], "--inprocess-cpus a-b: expected CPUs"),
    ("grpo_tiny", ["--inprocess-cpus", "9999"], "not among this process's"),
    ("grpo_tiny", ["--json", ""], "--json needs a path"),
    ("step_anatomy", ["--steps", "0"], "--steps: must be >= 1"),
    ("step_anatomy", ["--warmup", "0", "--steps", "1"], "no previous version cut"),
    ("step_anatomy", ["--workload", "bogus"], "invalid choice"),
    ("step_anatomy", ["--modes", "0,x"], "--modes"),
    ("step_anatomy", ["--cpus", "bogus"], "local.cpus"),
    ("pipeline", ["--modes", ""], "--modes"),
    ("pipeline", ["--rl-seconds", "nan"], "--rl-seconds: must be a finite number > 0"),
    ("pipeline", ["--rl-seconds", "0"], "--rl-seconds"),
    ("pipeline", ["--sft-steps", "-1"], "--sft-steps: must be >= 0"),
    ("pipeline", ["--cpus", "bogus"], "local.cpus"),
    ("pipeline", ["--plot", "/nonexistent-arlo-dir/p.png"], "--plot"),
    ("env", ["--envs", "bogus"], "--envs: unknown 'bogus'"),
    ("env", ["--envs", "", "--episodes", ""], "leave nothing to run"),
    ("env", ["--steps", "0"], "--steps: must be >= 1"),
    ("env", ["--episodes", "1,0"], "--episodes: must be >= 1"),
    ("env", ["--episode-steps", "0"], "--episode-steps"),
    ("first_step", ["--steps", "0"], "--steps: must be >= 1"),
    ("first_step", ["--cache", "/etc/hostname"], "is not a folder"),
    ("load", ["--episodes", "0"], "--episodes: must be >= 1"),
    ("load", ["--seconds", "inf"], "--seconds: must be a finite number"),
    ("load", ["--warmup-s", "-1"], "--warmup-s"),
    ("load", ["--max-backlog", "0"], "--max-backlog"),
    ("load", ["--flood-only", "--flood-calls", "0"], "--flood-calls"),
    ("load", ["--no-rollout"], "leaves nothing to run"),
    ("openai_load", ["--max-tokens", "0"], "--max-tokens"),
    ("openai_load", ["--seconds", "-5"], "--seconds"),
    ("mcp_load", ["--calls", "0"], "--calls"),
    ("mcp_load", ["--rounds", "0"], "--rounds"),
    ("load_memory", ["--layers", "0"], "--layers"),
    ("weight_sync", ["--sizes-mb", "0"], "--sizes-mb"),
    ("weight_sync", ["--sizes-mb", "1,x"], "--sizes-mb"),
    ("weight_sync", ["--pulls", "0"], "--pulls: must be >= 1"),
    ("real_model", ["--groups", "0"], "--groups"),
    ("real_model", ["--batches", "1,0"], "--batches"),
    ("real_model", ["--rl-steps", "0"], "--rl-steps"),
    ("real_model", ["--step-cpus", "bogus"], "local.cpus"),
    ("decode", ["--model", "bogus"], "unknown model config 'bogus'"),
    ("decode", ["--batches", "2", "--swap-batch", "4"], "must be among --batches"),
    ("decode", ["--steps", "0"], "--steps"),
    ("train_step", ["--max-len", "100"], "--max-len: must be >= 256"),
    ("train_step", ["--model", "bogus"], "unknown model config"),
    ("grpo_inprocess", ["--steps", "1"], "the median step needs two timed steps"),
    ("grpo_inprocess", ["--warmup", "-1"], "--warmup"),
    ("grpo_inprocess", ["--model", "bogus"], "unknown model config"),
    ("grpo_inprocess_agent", ["--turns", "0"], "--turns"),
    ("lora_sft_rates", ["--runs", "8"], "--runs: expected RANK:LEARNING_RATE pairs"),
    ("lora_sft_rates", ["--steps", "0"], "--steps: must be >= 1"),
]


@pytest.mark.parametrize(("module", "argv", "says"), BAD, ids=[f"{m}:{' '.join(a)}" for m, a, _ in BAD])
def test_a_bad_argument_is_refused_before_the_run(module: str, argv: list[str], says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert says in refused(module, argv, capsys)


JSON_BENCHES = ["grpo_tiny", "step_anatomy", "pipeline", "env", "first_step", "load", "openai_load", "mcp_load",
                "load_memory", "weight_sync", "real_model", "decode", "train_step", "lora_sft_rates", "accelerator",
                "long_context", "long_context_throughput", "lora", "moe_decode"]


def test_every_bench_that_takes_json_is_listed_here() -> None:
    takes = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if 'add_argument("--json"' in p.read_text())
    assert takes == sorted(JSON_BENCHES)


@pytest.mark.parametrize("module", JSON_BENCHES)
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(
        module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "folder" / "x.json"
    assert "no folder" in refused(module, ["--json", str(missing)], capsys)
    assert "is a folder" in refused(module, ["--json", str(tmp_path)], capsys)
    assert list(tmp_path.iterdir()) == []  # nothing written, no probe left behind


def test_a_good_json_path_passes_and_is_not_created_by_the_check(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    args = parse("grpo_tiny")(["--workloads", "76k,agent", "--modes", "0,2", "--warmup", "1", "--steps", "2",
                               "--json", str(out)])
    assert args.workloads == ["76k", "agent"] and args.modes == [0, 2] and args.json == str(out)
    assert not out.exists()
    # Arlo alone may time a single step, and pins no baseline.
    assert parse("grpo_tiny")(["--no-inprocess", "--steps", "1", "--inprocess-cpus", "9999"]).steps == 1


def test_write_json_replaces_the_file_whole_and_writes_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    common.write_json(str(link), {"steps_per_s": 1.5})
    assert link.is_symlink() and json.loads(target.read_text())["steps_per_s"] == 1.5
    assert "machine" in json.loads(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no partial file left
    common.write_json(None, {"x": 1})  # no --json: nothing


def test_a_bench_cluster_deletes_its_run_namespace_from_a_shared_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    from arlo.app import local

    wiped: list[str] = []
    monkeypatch.setattr(local, "wipe_run", lambda cfg: wiped.append(cfg.run_id) or 3)
    events: list[str] = []
    shared = SimpleNamespace(cfg=SimpleNamespace(run_id="bench-grpo-76k-s0"), redis=None,
                             stop=lambda: events.append("stop"))
    common.stop_cluster(shared)
    assert events == ["stop"] and wiped == ["bench-grpo-76k-s0"]
    # A Redis the cluster started itself went with it: nothing to connect to.
    own = SimpleNamespace(cfg=SimpleNamespace(run_id="other"), redis=object(), stop=lambda: events.append("stop"))
    common.stop_cluster(own)
    assert wiped == ["bench-grpo-76k-s0"]


def test_a_failed_wipe_is_logged_not_raised_over_the_runs_result(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from arlo.app import local

    def gone(cfg: object) -> int:
        raise ConnectionError("Redis went away")

    monkeypatch.setattr(local, "wipe_run", gone)
    common.wipe_namespace(SimpleNamespace(run_id="bench-x"))
    assert "bench-x" in caplog.text and "Redis went away" in caplog.text


def test_ctrl_c_ends_a_bench_with_130_and_no_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        common.run_main(interrupted)
    assert exit_.value.code == 130 and capsys.readouterr().err.strip() == "interrupted"


@pytest.mark.parametrize(("module", "argv", "says"), [
    ("grpo_tiny", ["--steps", "1"], "needs two timed steps"),
    ("grpo_tiny", ["--workloads", "bogus"], "unknown 'bogus'"),
    ("step_anatomy", ["--warmup", "0", "--steps", "1"], "no previous version cut"),
])
@pytest.mark.timeout(60)
def test_python_m_bench_exits_2_with_one_line_and_writes_nothing(module: str, argv: list[str], says: str,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", *argv, "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
