"""Which accelerator chips, and how much of their memory, each local service uses
(`local.accelerators`, `local.accelerator_memory`, docs/quickstart.md): pure functions of the
settings, the visible GPUs, the JAX platform and the environment the user set.

Why. On one GPU, two JAX processes left to JAX's defaults fail: the first preallocates 75% of
the memory and the second finds too little. Sharing one chip also makes the two take turns on
it: on one H200 at the 596k workload the trainer's step took 30 ms in an async run, where the
engine decodes beside it, and 21 ms in a sync one, where the engine is idle while it trains. With two or more GPUs, inference and the trainer each
get GPUs of their own, so generation and training run at once without slowing each other. The
light services (rollout, env gateway, reward) run no model: JAX, if they ever import it, stays
on the CPU. Device splitting is CUDA's (CUDA_VISIBLE_DEVICES). Two processes cannot share a TPU
chip, and a TPU host's chips are not split here: run the services on Kubernetes, one pod each.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from arlo.app.cpu_layout import Shares, is_cpu_platform, parse_shares
from arlo.config import ConfigError, MeshConfig

COMPUTE_SERVICES = ("inference", "trainer")
"""The services that run the model: on the accelerator, at `local.compute_nice`."""

MEMORY_ENV = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")
"""What the user may set to size the services' accelerator memory themselves (JAX's GPU memory docs)."""

SPLIT_PLATFORMS = ("cuda", "gpu")
"""JAX platforms whose devices CUDA_VISIBLE_DEVICES selects."""

GPU_ID = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z/-]+")
"""A CUDA_VISIBLE_DEVICES entry CUDA takes: an index or a UUID. It stops at the first other one ("-1")."""


def on_gpus(platform: str) -> bool:
    """Whether JAX_PLATFORMS `platform` puts the services on CUDA GPUs (its first entry decides)."""
    return platform.split(",")[0].strip().lower() in SPLIT_PLATFORMS


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPU ids the services could use: CUDA_VISIBLE_DEVICES' entries up to the first CUDA
    does not take (as CUDA reads it) when set, else one per GPU `nvidia-smi -L` lists; [] without
    either (the services then share what JAX finds)."""
    configured = environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        out = []
        for entry in (e.strip() for e in configured.split(",")):
            if not GPU_ID.fullmatch(entry):
                break
            out.append(entry)
        return out
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def halves(gpus: Sequence[str]) -> Shares:
    """`auto`'s split: inference the first half of `gpus` (rounded up), the trainer the rest."""
    half = (len(gpus) + 1) // 2
    return {"inference": ",".join(gpus[:half]), "trainer": ",".join(gpus[half:])}


def mesh_misfit(shares: Shares, *, gpus: Sequence[str], meshes: Mapping[str, MeshConfig]) -> str | None:
    """Why a compute service's mesh (inference.mesh, trainer.mesh) cannot be laid over the GPUs
    `shares` gives it (every GPU when it is left out); None when each fits."""
    for name in COMPUTE_SERVICES:
        count = len(shares[name].split(",")) if name in shares else len(gpus)
        try:
            meshes[name].shape(count)
        except ValueError as e:
            return f"{name} would see {count} GPU(s): {e}"
    return None


def gpu_shares(setting: str, *, gpus: Sequence[str], platform: str,
               meshes: Mapping[str, MeshConfig]) -> Shares | None:
    """Compute service -> the GPU ids it sees (its CUDA_VISIBLE_DEVICES); None: each sees all.

    "auto" splits 2+ GPUs of a CUDA platform into `halves`, unless a service's mesh does not fit
    its half (then they share, as before); "shared" never splits; explicit shares
    ("inference=0+1,trainer=2") must name visible GPUs and fit the meshes (ConfigError).
    """
    if setting == "shared" or not on_gpus(platform):
        return None
    if setting == "auto":
        if len(gpus) < 2:
            return None
        split = halves(gpus)
        return None if mesh_misfit(split, gpus=gpus, meshes=meshes) else split
    shares = parse_shares(setting)
    unknown = sorted({g for ids in shares.values() for g in ids.split(",")} - set(gpus))
    if unknown:
        raise ConfigError(f"local.accelerators {setting!r} names GPUs {unknown} this host does not show "
                          f"(visible: {','.join(gpus) or 'none'}; CUDA_VISIBLE_DEVICES, else nvidia-smi -L, "
                          "says which: set CUDA_VISIBLE_DEVICES where nvidia-smi is missing)")
    misfit = mesh_misfit(shares, gpus=gpus, meshes=meshes)
    if misfit:
        raise ConfigError(f"local.accelerators {setting!r}: {misfit}")
    return shares


def _sharers(name: str, shares: Shares | None) -> int:
    """How many compute services use one of `name`'s GPUs (itself included); one left out of
    explicit shares sees every GPU."""
    mine = set(shares[name].split(",")) if shares and name in shares else None
    count = 0
    for other in COMPUTE_SERVICES:
        theirs = set(shares[other].split(",")) if shares and other in shares else None
        count += mine is None or theirs is None or bool(mine & theirs)
    return count


def accelerator_env(name: str, platform: str, *, memory_share: float, shares: Shares | None,
                    environ: Mapping[str, str]) -> dict[str, str]:
    """What service `name` adds to its environment for the JAX `platform` of the local services:
    its GPUs, and its part of `memory_share` of their memory (split between the compute
    services that share a GPU), unless the user sized the memory in `environ` themselves."""
    if is_cpu_platform(platform):
        return {}
    if name not in COMPUTE_SERVICES:
        return {"JAX_PLATFORMS": "cpu"}
    env = {}
    if shares and name in shares:
        env["CUDA_VISIBLE_DEVICES"] = shares[name]
    if not any(key in environ for key in MEMORY_ENV):
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_share / _sharers(name, shares):.3f}"
    return env
