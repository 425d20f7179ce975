"""`local.accelerators` / `local.accelerator_memory`: which GPUs, and how much of their memory, the
services `arlo up`/`demo` start on an accelerator use (arlo/app/accelerator_layout.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arlo.app.accelerator_layout import MEMORY_ENV, gpu_shares, visible_gpus
from arlo.config import ConfigError, MeshConfig, load_config
from arlo.config.base import SERVICE_NAMES

LIGHT = ("rollout", "env_gateway", "reward")
ANY = {"inference": MeshConfig(), "trainer": MeshConfig()}  # data=-1: any number of devices
TENSOR_2 = MeshConfig(axis_sizes=(1, 1, 2))  # exactly 2 devices


@pytest.mark.parametrize(("gpus", "inference", "trainer"), [
    (["0", "1"], "0", "1"), (["0", "1", "2"], "0,1", "2"), ([str(i) for i in range(8)], "0,1,2,3", "4,5,6,7"),
    (["GPU-aa", "GPU-bb"], "GPU-aa", "GPU-bb"),  # CUDA_VISIBLE_DEVICES may hold UUIDs
])
def test_auto_gives_inference_and_the_trainer_gpus_of_their_own(gpus: list[str], inference: str, trainer: str) -> None:
    assert gpu_shares("auto", gpus=gpus, platform="cuda", meshes=ANY) == {"inference": inference, "trainer": trainer}


@pytest.mark.parametrize(("setting", "gpus", "platform"), [
    ("auto", ["0"], "cuda"), ("auto", [], "cuda"), ("shared", ["0", "1"], "cuda"),
    ("auto", ["0", "1"], "cpu"), ("auto", ["0", "1"], "tpu"), ("inference=0,trainer=1", ["0", "1"], "tpu"),
])
def test_one_gpu_shared_on_request_or_not_cuda_splits_nothing(setting: str, gpus: list[str], platform: str) -> None:
    assert gpu_shares(setting, gpus=gpus, platform=platform, meshes=ANY) is None


def test_explicit_shares_are_taken_as_written_and_must_name_visible_gpus() -> None:
    assert gpu_shares("inference=0+1,trainer=2", gpus=["0", "1", "2"], platform="cuda", meshes=ANY) == {
        "inference": "0,1", "trainer": "2"}
    with pytest.raises(ConfigError, match=r"names GPUs \['5'\] this host does not show \(visible: 0,1;"):
        gpu_shares("inference=0,trainer=5", gpus=["0", "1"], platform="cuda", meshes=ANY)


def test_a_mesh_that_does_not_fit_its_half_keeps_auto_shared_and_refuses_explicit_shares() -> None:
    """trainer.mesh tensor=2 ran on 2 shared GPUs before the split existed; one GPU cannot hold it."""
    meshes = {"inference": MeshConfig(), "trainer": TENSOR_2}
    assert gpu_shares("auto", gpus=["0", "1"], platform="cuda", meshes=meshes) is None
    assert gpu_shares("auto", gpus=["0", "1", "2", "3"], platform="cuda", meshes=meshes) == {
        "inference": "0,1", "trainer": "2,3"}
    with pytest.raises(ConfigError, match="trainer would see 1 GPU"):
        gpu_shares("inference=0,trainer=1", gpus=["0", "1"], platform="cuda", meshes=meshes)
    # A service left out of explicit shares sees every GPU: its mesh is checked against all.
    assert gpu_shares("inference=0", gpus=["0", "1"], platform="cuda", meshes=meshes) == {"inference": "0"}


@pytest.mark.parametrize(("setting", "error"), [
    ("rollout=0", "expected 'auto', 'shared' or service=gpu"),
    ("inference=0,inference=1", "inference is given twice"),
    ("trainer=a", "GPUs are numbers or UUIDs joined by"),
])
def test_malformed_shares_are_refused_when_the_config_loads(setting: str, error: str) -> None:
    with pytest.raises(ConfigError, match=f"local.accelerators: {error}"):
        load_config(None, {"local": {"accelerators": setting}})
    with pytest.raises(ConfigError, match="local.accelerator_memory: must be in"):
        load_config(None, {"local": {"accelerator_memory": 1.5}})


def test_visible_gpus_reads_cuda_visible_devices_else_nvidia_smi(tmp_path: Path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # CUDA hides every GPU
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}) == ["0", "1"]  # CUDA stops at the first invalid id
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2c1a,MIG-GPU-8f2c1a/1/0"}) == ["GPU-8f2c1a", "MIG-GPU-8f2c1a/1/0"]
    assert visible_gpus({"PATH": str(tmp_path)}) == []  # no nvidia-smi
    # This machine has no GPU: a script prints what `nvidia-smi -L` prints on a 2-GPU host, then
    # fails as it does where the driver is missing.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    assert visible_gpus({"PATH": str(tmp_path)}) == ["0", "1"]
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n")
    assert visible_gpus({"PATH": str(tmp_path)}) == []


def _envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str, local: dict) -> dict[str, dict[str, str]]:
    from arlo.app.local import prepare_cluster

    monkeypatch.setenv("JAX_PLATFORMS", platform)
    cfg = load_config(None, {"run_id": "test-accel", "auth": {"disabled": True}, "local": local})
    cluster = prepare_cluster(cfg, home=tmp_path, free_ports=True)
    return {name: cluster.service_env(name) for name in SERVICE_NAMES}


@pytest.fixture
def no_memory_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in MEMORY_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.usefixtures("no_memory_env")
def test_on_one_gpu_the_compute_services_split_its_memory_and_the_light_ones_stay_off_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two JAX processes on one GPU with JAX's defaults: the first preallocates 75% of its memory
    and the second fails for want of it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    envs = _envs(tmp_path, monkeypatch, "cuda", {"accelerator_memory": 0.8})
    assert {name: env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") for name, env in envs.items()} == {
        "inference": "0.400", "trainer": "0.400", "rollout": None, "env_gateway": None, "reward": None}
    assert {name: env["JAX_PLATFORMS"] for name, env in envs.items()} == {
        "inference": "cuda", "trainer": "cuda", "rollout": "cpu", "env_gateway": "cpu", "reward": "cpu"}
    assert all("CUDA_VISIBLE_DEVICES" not in env and "ARLO_CPUS" not in env for env in envs.values())


@pytest.mark.usefixtures("no_memory_env")
def test_on_two_gpus_each_compute_service_gets_one_and_its_memory_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    envs = _envs(tmp_path, monkeypatch, "cuda", {})
    assert {n: (envs[n].get("CUDA_VISIBLE_DEVICES"), envs[n].get("XLA_PYTHON_CLIENT_MEM_FRACTION")) for n in envs} == {
        "inference": ("4", "0.900"), "trainer": ("6", "0.900"), **{n: (None, None) for n in LIGHT}}
    overlapping = _envs(tmp_path, monkeypatch, "cuda", {"accelerators": "inference=4+6,trainer=6"})
    assert [overlapping[n]["XLA_PYTHON_CLIENT_MEM_FRACTION"] for n in ("inference", "trainer")] == ["0.450", "0.450"]
    shared = _envs(tmp_path, monkeypatch, "cuda", {"accelerators": "shared"})
    assert [shared[n].get("CUDA_VISIBLE_DEVICES") for n in ("inference", "trainer")] == [None, None]
    assert [shared[n]["XLA_PYTHON_CLIENT_MEM_FRACTION"] for n in ("inference", "trainer")] == ["0.450", "0.450"]
    with pytest.raises(ConfigError, match="names GPUs"):  # refused before anything starts
        _envs(tmp_path, monkeypatch, "cuda", {"accelerators": "inference=0,trainer=1"})


@pytest.mark.usefixtures("no_memory_env")
def test_the_users_own_memory_sizing_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    envs = _envs(tmp_path, monkeypatch, "cuda", {})
    assert all("XLA_PYTHON_CLIENT_MEM_FRACTION" not in env for env in envs.values())


def test_on_the_cpu_nothing_about_accelerators_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    envs = _envs(tmp_path, monkeypatch, "cpu", {})
    for env in envs.values():
        assert env["JAX_PLATFORMS"] == "cpu"
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env and "CUDA_VISIBLE_DEVICES" not in env


def test_uuid_shares_load_and_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    envs = _envs(tmp_path, monkeypatch, "cuda", {"accelerators": "inference=GPU-bb,trainer=GPU-aa"})
    assert [envs[n]["CUDA_VISIBLE_DEVICES"] for n in ("inference", "trainer")] == ["GPU-bb", "GPU-aa"]


def test_explicit_shares_on_a_platform_that_is_not_cuda_are_ignored_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="arlo.app.local"):
        envs = _envs(tmp_path, monkeypatch, "tpu", {"accelerators": "inference=0,trainer=1"})
    assert "local.accelerators 'inference=0,trainer=1' ignored" in caplog.text
    assert all("CUDA_VISIBLE_DEVICES" not in env for env in envs.values())


def test_auto_on_gpus_a_mesh_cannot_split_says_why_they_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from arlo.app.local import prepare_cluster

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg = load_config(None, {"run_id": "test-accel", "auth": {"disabled": True},
                             "trainer": {"mesh": {"axis_sizes": [1, 1, 2]}}})
    with caplog.at_level("WARNING", logger="arlo.app.local"):
        cluster = prepare_cluster(cfg, home=tmp_path, free_ports=True)
    assert cluster.gpu_shares is None
    assert "inference and the trainer share GPUs 0,1: trainer would see 1 GPU(s)" in caplog.text
