"""Which CPUs each local service may use (`local.cpus`, docs/quickstart.md): a pure function of
the setting, the host's CPUs, the run's mode and the JAX platform.

Why a layout at all (bench/step_anatomy.py at the 596k workload, 2 cores, one run each):

| layout | sync steps/s | async steps/s |
|---|---|---|
| none (the OS schedules; each XLA pool spans both cores) | 2.11 | 2.81 |
| inference and trainer on both cores | 2.91 | 2.54 |
| inference on one core, trainer on the other | 2.50 | 3.54 |

A synchronous run alternates generation and training, so each should have every core while it
runs; an asynchronous run runs both at once, and two XLA thread pools spanning the same cores
time-slice each other's threads (each pool waits on its slowest thread). The light services
(rollout, env gateway, reward: single-threaded Python) are kept off each other's cores: rollout
beside inference, which it feeds, the env gateway and reward on the other half.
"""

from __future__ import annotations

from collections.abc import Sequence

from arlo.config import ConfigError

Shares = dict[str, str]
"""Service -> its CPUs or GPUs, comma-separated ("0", "2,3"): its $ARLO_CPUS or CUDA_VISIBLE_DEVICES."""


def parse_shares(text: str) -> Shares:
    """"inference=0,trainer=1+2" -> {"inference": "0", "trainer": "1,2"} (validated by LocalConfig;
    CPUs of `local.cpus`, GPUs of `local.accelerators`)."""
    shares: Shares = {}
    for item in filter(None, text.split(",")):
        name, _, cpus = item.partition("=")
        shares[name.strip()] = ",".join(c.strip() for c in cpus.split("+"))
    return shares


def _join(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def is_cpu_platform(platform: str) -> bool:
    """Whether JAX_PLATFORMS `platform` ("cpu", "cuda,cpu") puts the services on the CPU: its first
    entry decides. "" counts as the CPU, the services' default (an accelerator is asked for by name)."""
    return platform.split(",")[0].strip().lower() in ("", "cpu")


def cpu_shares(setting: str, *, cpus: Sequence[int], synchronous: bool, platform: str) -> Shares | None:
    """The services' CPU shares for `local.cpus` = `setting`; None: nothing is pinned.

    `cpus`: the CPUs this process may use (os.sched_getaffinity); `platform`: the services'
    JAX_PLATFORMS. "auto" pins only on a CPU platform with 2+ CPUs: on an accelerator the XLA
    pools that matter are not the host's, and one CPU has nothing to share out.
    """
    if setting == "off":
        return None
    if setting != "auto":
        shares = parse_shares(setting)
        missing = sorted({int(c) for v in shares.values() for c in v.split(",")} - set(cpus))
        if missing:
            raise ConfigError(f"local.cpus {setting!r} names CPUs {missing} this process may not use "
                             f"(available: {_join(sorted(cpus))})")
        return shares
    ordered = sorted(cpus)
    if len(ordered) < 2 or not is_cpu_platform(platform):
        return None
    first, second = _join(ordered[: len(ordered) // 2]), _join(ordered[len(ordered) // 2:])
    big = _join(ordered) if synchronous else None
    return {"inference": big or first, "trainer": big or second, "rollout": first, "env_gateway": second,
            "reward": second}
