"""arlo/hostmem.py: the glibc malloc settings the XLA processes run with, and where they come from."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from arlo.hostmem import GLIBC_TUNABLES, merged_tunables, with_tunables

ROOT = Path(__file__).resolve().parents[2]


def test_merge_adds_ours_and_keeps_what_the_user_set() -> None:
    assert merged_tunables(None) == GLIBC_TUNABLES
    assert merged_tunables("") == GLIBC_TUNABLES
    mine = merged_tunables("glibc.malloc.arena_max=4:glibc.cpu.hwcaps=-AVX512F")
    items = mine.split(":")
    assert items[:2] == ["glibc.malloc.arena_max=4", "glibc.cpu.hwcaps=-AVX512F"]
    assert "glibc.malloc.arena_max=1" not in items
    assert {"glibc.malloc.hugetlb=1", "glibc.malloc.mmap_threshold=268435456"} <= set(items)
    assert merged_tunables(mine) == mine  # idempotent: a second merge changes nothing


def test_with_tunables_copies() -> None:
    env = {"PATH": "/bin"}
    assert with_tunables(env) == {"PATH": "/bin", "GLIBC_TUNABLES": GLIBC_TUNABLES}
    assert env == {"PATH": "/bin"}


def test_local_services_start_with_them(tmp_path: Path) -> None:
    from arlo.app.local import LocalCluster
    from arlo.app.supervisor import Supervisor
    from arlo.config import RunConfig

    cluster = LocalCluster(cfg=RunConfig(), config_path=tmp_path / "run.yaml", home=tmp_path, token=None,
                           redis=None, supervisor=Supervisor([]))
    assert cluster.service_env("inference")["GLIBC_TUNABLES"] == merged_tunables(os.environ.get("GLIBC_TUNABLES"))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the re-exec applies to glibc Linux only")
def test_reexec_applies_them_once_keeping_pid_and_argv() -> None:
    script = ("import os, sys; from arlo.hostmem import reexec_with_tunables; "
              "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:], flush=True); "
              "reexec_with_tunables()")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ARLO_DEFAULT_MALLOC")}
    out = subprocess.run([sys.executable, "-c", script, "x", "--y"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    assert len(out) == 2  # the first run re-execs; the second finds the settings and goes on
    first, second = (line.split(" ", 2) for line in out)
    assert first[0] == second[0]  # same process
    assert first[1] == "None" and second[1] == GLIBC_TUNABLES
    assert first[2] == second[2] == "['x', '--y']"

    opted_out = subprocess.run([sys.executable, "-c", script], env={**env, "ARLO_DEFAULT_MALLOC": "1"}, cwd=ROOT,
                               capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert len(opted_out) == 1
