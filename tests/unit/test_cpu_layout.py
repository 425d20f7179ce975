"""`local.cpus`: the CPU layout of the services `arlo up`/`demo` start (arlo/app/cpu_layout.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arlo.app.cpu_layout import cpu_shares, parse_shares
from arlo.config import ConfigError, load_config, replace_config
from arlo.config.base import SERVICE_NAMES

BIG = ("inference", "trainer")
LIGHT = ("rollout", "env_gateway", "reward")


def cpu_list(text: str) -> set[int]:
    """/proc's "0-2,5" form."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpus_of(shares: dict[str, str], name: str) -> set[int]:
    return {int(c) for c in shares[name].split(",")}


@pytest.mark.parametrize("n", [2, 3, 8])
def test_synchronous_runs_give_inference_and_trainer_every_cpu(n: int) -> None:
    shares = cpu_shares("auto", cpus=list(range(n)), synchronous=True, platform="cpu")
    assert shares is not None
    for name in BIG:
        assert cpus_of(shares, name) == set(range(n))  # they take turns: each gets the whole host
    # The light services stay apart: rollout on one half, the env gateway and reward on the other.
    assert cpus_of(shares, "rollout").isdisjoint(cpus_of(shares, "env_gateway"))
    assert cpus_of(shares, "env_gateway") == cpus_of(shares, "reward")


@pytest.mark.parametrize("n", [2, 3, 8])
def test_asynchronous_runs_split_the_cpus_between_inference_and_trainer(n: int) -> None:
    cpus = [c + 4 for c in range(n)]  # not necessarily from 0 (a cgroup or taskset may leave others)
    shares = cpu_shares("auto", cpus=cpus, synchronous=False, platform="cpu")
    assert shares is not None
    inference, trainer = cpus_of(shares, "inference"), cpus_of(shares, "trainer")
    assert inference and trainer and inference.isdisjoint(trainer)
    assert inference | trainer == set(cpus)
    assert cpus_of(shares, "rollout") == inference  # it feeds inference
    assert cpus_of(shares, "env_gateway") == cpus_of(shares, "reward") == trainer


@pytest.mark.parametrize(("cpus", "platform"), [([0], "cpu"), ([0, 1], "cuda"), ([0, 1, 2, 3], "tpu"), ([], "cpu")])
def test_auto_pins_nothing_on_one_cpu_or_an_accelerator(cpus: list[int], platform: str) -> None:
    for synchronous in (True, False):
        assert cpu_shares("auto", cpus=cpus, synchronous=synchronous, platform=platform) is None


def test_an_empty_jax_platforms_counts_as_the_cpu_as_it_always_has() -> None:
    assert cpu_shares("auto", cpus=[0, 1], synchronous=False, platform="") is not None


def test_off_pins_nothing_and_explicit_shares_are_taken_as_written() -> None:
    assert cpu_shares("off", cpus=[0, 1], synchronous=False, platform="cpu") is None
    explicit = "inference=0+1,trainer=1"
    assert cpu_shares(explicit, cpus=[0, 1], synchronous=True, platform="cuda") == {"inference": "0,1", "trainer": "1"}
    assert parse_shares(explicit) == {"inference": "0,1", "trainer": "1"}


def test_explicit_shares_of_cpus_this_host_lacks_are_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"local.cpus .*\[7\].*available: 0,1"):
        cpu_shares("inference=0,trainer=7", cpus=[0, 1], synchronous=False, platform="cpu")


@pytest.mark.parametrize(("value", "message"), [
    ("infer=0", "expected 'auto', 'off' or service=cpu"),
    ("inference", "expected 'auto', 'off' or service=cpu"),
    ("inference=0+x", "CPUs are numbers joined by '\\+'"),
    ("trainer=", "CPUs are numbers"),
    ("trainer=\u00b2", "CPUs are numbers"),  # a superscript two passes str.isdigit, not int()
    ("trainer=0,trainer=1", "trainer is given twice"),
])
def test_bad_settings_are_refused_at_load(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"local.cpus: {message}"):
        load_config(None, {"local": {"cpus": value}})


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2+ CPUs to split")
def test_a_service_started_by_the_local_cluster_runs_on_its_share(tmp_path: Path) -> None:
    """The real path: prepare_cluster reads local.cpus, the reward service starts pinned there."""
    from arlo.app.local import prepare_cluster

    cpus = sorted(os.sched_getaffinity(0))
    cfg = load_config(None, {"run_id": "test-cpu-layout", "trainer": {"max_staleness": 1}, "auth": {"disabled": True}})
    cluster = prepare_cluster(cfg, home=tmp_path, free_ports=True)
    assert cluster.cpu_shares is not None
    try:
        cluster.start(("reward",), timeout_s=120.0)
        pid = cluster.supervisor.children["reward"].process.pid
        allowed = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("Cpus_allowed_list:")).split()[1]
    finally:
        cluster.stop()
    assert cpu_list(allowed) == set(cpus[len(cpus) // 2:])  # the second half: the env gateway's and reward's
    assert cluster.service_env("trainer")["ARLO_CPUS"] != cluster.service_env("inference")["ARLO_CPUS"]


def test_the_compute_services_run_at_the_configured_niceness_and_the_light_ones_do_not(tmp_path: Path) -> None:
    from arlo.app.local import prepare_cluster

    cfg = load_config(None, {"run_id": "test-nice", "auth": {"disabled": True}, "local": {"compute_nice": 7}})
    cluster = prepare_cluster(cfg, home=tmp_path, free_ports=True)
    assert {name: cluster.service_env(name)["ARLO_NICE"] for name in SERVICE_NAMES} == {
        "inference": "7", "trainer": "7", "rollout": "0", "env_gateway": "0", "reward": "0"}
    off = prepare_cluster(replace_config(cfg, {"local": {"compute_nice": 0}}), home=tmp_path, free_ports=True)
    assert all(off.service_env(name)["ARLO_NICE"] == "0" for name in SERVICE_NAMES)
    with pytest.raises(ConfigError, match="local.compute_nice: must be in"):
        load_config(None, {"local": {"compute_nice": 20}})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness and autogroups as Linux has them")
def test_a_service_process_lowers_its_own_priority_and_its_sessions_before_any_thread_starts() -> None:
    """The real path a service takes at start (arlo.service_args), in a session of its own as
    the supervisor starts it: the thread nice, inherited by threads started after, and the
    session's autogroup nice, which is what the kernel weighs sessions by."""
    probe = (
        "import os, threading; from arlo.service_args import apply_niceness; apply_niceness(); "
        "seen = []; t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0))); "
        "t.start(); t.join(); group = open('/proc/self/autogroup').read().split() "
        "if os.path.exists('/proc/self/autogroup') else []; "
        "print(os.getpriority(os.PRIO_PROCESS, 0) - BASE, seen[0] - BASE, group[-1] if group else 'none')"
    ).replace("BASE", str(os.getpriority(os.PRIO_PROCESS, 0)))
    raised = str(min(os.getpriority(os.PRIO_PROCESS, 0) + 5, 19) - os.getpriority(os.PRIO_PROCESS, 0))
    # 'none': no autogroup weighs this process. The file is absent (another OS, the kernel
    # option off) or reads empty: a process in a cgroup of its own with the cpu controller (as
    # CI runs the suite) is weighed by that cgroup, and the kernel prints no autogroup for it.
    nice, thread_nice, group = run_probe(probe, own_session=True)
    assert [nice, thread_nice] == [raised, raised] and group in ("5", "none"), (nice, thread_nice, group)
    if autogroup_of_this_process():
        assert group == "5"  # the kernel weighs the test's sessions by autogroup: so is the probe's
    # In someone else's session (here: the test's) only the process's own threads are lowered.
    if autogroup_of_this_process():
        before = Path("/proc/self/autogroup").read_text()
        assert run_probe(probe, own_session=False)[:2] == [raised, raised]
        assert Path("/proc/self/autogroup").read_text() == before


def autogroup_of_this_process() -> str:
    """This process's autogroup as the kernel prints it; '' where none weighs it."""
    try:
        return Path("/proc/self/autogroup").read_text().strip()
    except OSError:
        return ""


def run_probe(probe: str, *, own_session: bool) -> list[str]:
    """The probe's printed words, run with ARLO_NICE=5; a failed probe fails with its stderr
    (a CI run once saw exit status 1 and nothing else)."""
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "ARLO_NICE": "5"}, capture_output=True,
                          text=True, start_new_session=own_session, timeout=60)
    print(done.stderr, file=sys.stderr)  # shown if the test fails for any reason
    assert done.returncode == 0, f"probe exited {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout.split()
