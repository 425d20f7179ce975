"""arlo.distributed: which environments mean "several processes", mesh shapes, and real JAX runs on CPU.

XLA reads `--xla_force_host_platform_device_count` once, when JAX starts its CPU backend, so
every test that needs 8 fake devices (or a second process) runs Python in a subprocess.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from arlo.config import ConfigError, MeshConfig
from arlo.distributed import DEFAULT_COORDINATOR_PORT, DistributedEnv, detect, hybrid_shapes

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, *, devices: int = 8, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_", "MEGASCALE_", "JOB_COMPLETION"))}
    full = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, cwd=ROOT, timeout=timeout)


def last_json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- detect(): pure, no JAX -------------------------------------------------------------------

def test_no_variables_means_one_process() -> None:
    assert detect({}) is None


def test_explicit_variables_as_the_gpu_jobset_sets_them() -> None:
    env = {"JAX_COORDINATOR_ADDRESS": "arlo-trainer-trainer-0-0.arlo-trainer", "JAX_NUM_PROCESSES": "4",
           "JOB_COMPLETION_INDEX": "2"}
    assert detect(env) == DistributedEnv(coordinator_address=f"arlo-trainer-trainer-0-0.arlo-trainer:{DEFAULT_COORDINATOR_PORT}",
                                         num_processes=4, process_id=2, source="explicit")
    # JAX_PROCESS_ID wins over the Job index; an explicit port is kept.
    env |= {"JAX_PROCESS_ID": "3", "JAX_COORDINATOR_ADDRESS": "10.0.0.5:1234"}
    found = detect(env)
    assert found is not None and (found.process_id, found.coordinator_address) == (3, "10.0.0.5:1234")


def test_jobset_with_several_jobs_numbers_processes_job_major() -> None:
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "8", "JAX_PROCESSES_PER_JOB": "4",
           "JOBSET_JOB_INDEX": "1", "JOB_COMPLETION_INDEX": "2"}
    found = detect(env)
    assert found is not None and (found.process_id, found.num_processes) == (6, 8)
    with pytest.raises(ValueError, match="JAX_PROCESSES_PER_JOB"):
        detect(env | {"JOB_COMPLETION_INDEX": "4"})


def test_one_explicit_process_is_a_no_op() -> None:
    assert detect({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None


def test_gke_tpu_single_host_slice_is_a_no_op() -> None:
    assert detect({"TPU_WORKER_HOSTNAMES": "host-0", "TPU_WORKER_ID": "0"}) is None


def test_gke_tpu_multi_host_slice() -> None:
    env = {"TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc,w-2.svc,w-3.svc", "TPU_WORKER_ID": "1"}
    assert detect(env) == DistributedEnv(coordinator_address=f"w-0.svc:{DEFAULT_COORDINATOR_PORT}", num_processes=4,
                                         process_id=1, source="gke-tpu")
    assert detect(env | {"JAX_COORDINATOR_PORT": "9999"}).coordinator_address == "w-0.svc:9999"  # type: ignore[union-attr]


def test_gke_tpu_multislice_numbers_processes_slice_major() -> None:
    env = {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "3",
           "MEGASCALE_SLICE_ID": "2", "MEGASCALE_COORDINATOR_ADDRESS": "slice0-w0:8080"}
    found = detect(env)
    assert found is not None
    assert (found.num_processes, found.process_id) == (6, 5)
    assert found.coordinator_address == f"slice0-w0:{DEFAULT_COORDINATOR_PORT}"  # megascale's port is not JAX's


@pytest.mark.parametrize("env, match", [
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "outside"),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "TPU_WORKER_ID"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "5"}, "outside"),
])
def test_contradictory_variables_fail_loudly(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        detect(env)


# --- MeshConfig: pure -------------------------------------------------------------------------

@pytest.mark.parametrize("sizes, devices, shape", [
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((-1, 2, 2), 8, (2, 2, 2)),
    ((2, -1, 1), 8, (2, 4, 1)),
    ((2, 2, 2), 8, (2, 2, 2)),
    ((-1, 1, 1), 1, (1, 1, 1)),
])
def test_mesh_shape_resolves_the_rest(sizes: tuple[int, ...], devices: int, shape: tuple[int, ...]) -> None:
    assert MeshConfig(axis_sizes=sizes).shape(devices) == shape


def test_mesh_shape_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="does not divide 8"):
        MeshConfig(axis_sizes=(-1, 3, 1)).shape(8)
    with pytest.raises(ValueError, match="has 4 devices, but there are 8"):
        MeshConfig(axis_sizes=(2, 2, 1)).shape(8)


@pytest.mark.parametrize("kwargs, field", [
    ({"axis_sizes": (-1, -1, 1)}, "axis_sizes"),
    ({"axis_sizes": (0, 1, 1)}, "axis_sizes"),
    ({"axis_sizes": (-1, 1)}, "axis_sizes"),
    ({"axis_names": ("data", "data", "tensor")}, "axis_names"),
    ({"dcn_axis": "pipeline"}, "dcn_axis"),
])
def test_mesh_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"trainer\.mesh\.{field}"):
        MeshConfig(**kwargs).validate("trainer.mesh")


def test_multislice_splits_the_dcn_axis_across_slices() -> None:
    assert hybrid_shapes(MeshConfig(axis_sizes=(-1, 4, 1)), 32, 2) == ((4, 4, 1), (2, 1, 1))
    with pytest.raises(ValueError, match="multiple of the 3 slices"):
        hybrid_shapes(MeshConfig(axis_sizes=(-1, 4, 1)), 32, 3)  # 8 devices of data: not a multiple of 3


def test_mesh_config_loads_from_yaml_shaped_data() -> None:
    """The shape arlo.config's from_dict builds (tuples from YAML lists), as RunConfig will embed it."""
    from arlo.config import from_dict

    cfg = from_dict(MeshConfig, {"axis_names": ["data", "tensor"], "axis_sizes": [-1, 2]})
    assert cfg == MeshConfig(axis_names=("data", "tensor"), axis_sizes=(-1, 2))


# --- real JAX on 8 fake CPU devices (subprocess) -----------------------------------------------

def test_meshes_and_a_sharded_array_on_8_cpu_devices() -> None:
    result = run_python("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from arlo.config import MeshConfig
        from arlo.distributed import make_mesh, initialize_from_env

        out = {"devices": jax.device_count()}
        for sizes in [(-1, 1, 1), (-1, 2, 2), (2, 4, 1)]:
            mesh = make_mesh(MeshConfig(axis_sizes=sizes))
            out[str(sizes)] = [dict(mesh.shape), len(set(mesh.devices.flat))]

        mesh = make_mesh(MeshConfig(axis_sizes=(-1, 2, 2)))
        x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), "tensor")))
        w = jax.device_put(np.ones((6, 4), np.float32), NamedSharding(mesh, P("tensor", None)))
        y = jax.jit(lambda a, b: jnp.tanh(a @ b))(xs, w)
        out["shard_shape"] = list(xs.sharding.shard_shape(xs.shape))
        out["num_shards"] = len(xs.addressable_shards)
        out["matmul_ok"] = bool(np.allclose(np.asarray(y), np.tanh(x @ np.ones((6, 4), np.float32)), atol=1e-5))
        out["y_sharded_over"] = len(y.sharding.device_set)
        out["sub_mesh"] = dict(make_mesh(MeshConfig(axis_names=("data",), axis_sizes=(-1,)), jax.devices()[:4]).shape)

        # One host: no-op, and JAX's distributed client stays off.
        out["noop"] = initialize_from_env({}) is None
        out["noop_tpu"] = initialize_from_env({"TPU_WORKER_HOSTNAMES": "h0", "TPU_WORKER_ID": "0"}) is None
        out["initialized"] = jax.distributed.is_initialized()
        print(json.dumps(out))
    """)
    out = last_json(result)
    assert out["devices"] == 8
    assert out["(-1, 1, 1)"] == [{"data": 8, "fsdp": 1, "tensor": 1}, 8]
    assert out["(-1, 2, 2)"] == [{"data": 2, "fsdp": 2, "tensor": 2}, 8]
    assert out["(2, 4, 1)"] == [{"data": 2, "fsdp": 4, "tensor": 1}, 8]
    assert out["shard_shape"] == [2, 3]  # 8 rows over data*fsdp=4, 6 columns over tensor=2
    assert out["num_shards"] == 8
    assert out["matmul_ok"] is True
    assert out["y_sharded_over"] == 8
    assert out["sub_mesh"] == {"data": 4}
    assert out["noop"] is True and out["noop_tpu"] is True
    assert out["initialized"] is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_join_through_the_jobset_variables() -> None:
    """Two real processes on loopback, configured the way the GPU JobSet configures its pods."""
    port = _free_port()
    code = """
        import json
        import jax
        from arlo.config import MeshConfig
        from arlo.distributed import initialize_from_env, make_mesh

        found = initialize_from_env(timeout_s=60)
        again = initialize_from_env(timeout_s=60)  # a second call is a no-op
        mesh = make_mesh(MeshConfig(axis_sizes=(-1, 2, 1)))
        print(json.dumps({"pid": found.process_id, "count": jax.process_count(), "index": jax.process_index(),
                          "global": jax.device_count(), "local": jax.local_device_count(), "again": again == found,
                          "mesh": dict(mesh.shape)}))
        jax.distributed.shutdown()
    """
    procs = []
    for index in range(2):
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JOB_COMPLETION_INDEX": str(index)}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_", "MEGASCALE_"))}
        full = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "PYTHONPATH": str(ROOT), **env}
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=150)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(o["index"] for o in outs) == [0, 1]
    for o in outs:
        assert o["pid"] == o["index"]
        assert (o["count"], o["global"], o["local"], o["again"]) == (2, 4, 2, True)
        assert o["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
