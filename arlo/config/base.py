"""The config basics: ConfigError, the frozen-dataclass decorator, the run-id rule, and the
sections every service shares (redis, auth and TLS, tracing, where a server listens, the device mesh)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

T = TypeVar("T")
N = TypeVar("N")

_RUN_ID_EXTRA = frozenset("-_.")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def _frozen(cls: type[T]) -> type[T]:
    return dataclass(frozen=True, kw_only=True, slots=True)(cls)


def check_run_id(run_id: str, path: str = "run_id") -> None:
    """The one rule for run ids: non-empty, ASCII letters, digits, '-', '_' and '.' (they name Redis
    keys, and keep glob characters out of SCAN patterns). Raises ConfigError naming `path`."""
    ok = bool(run_id) and all((c.isascii() and c.isalnum()) or c in _RUN_ID_EXTRA for c in run_id)
    _check(path, ok, f"must be non-empty and use only letters, digits, '-', '_' and '.', got {run_id!r}")


def _check(path: str, ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


MAX_INT = 2**63 - 1
"""The largest magnitude an int setting may have (protobuf, numpy and JAX stop at int64)."""
MIN_POLL_S = 0.01
"""The shortest: a waiter's fallback re-check more often than this only hammers Redis."""
MAX_POLL_S = 300.0
"""The longest re-check interval of a waiter that an event normally wakes (`*_poll_s`): the
re-check is what recovers a lost event, so one slower than this is a wait that never ends."""
MAX_WAIT_S = 7 * 24 * 3600.0
"""The longest any timeout, deadline, lease or grace may be, a week: nothing in a run waits that
long for one thing, and far longer ones (1e300) overflow socket and deadline arithmetic."""
RANGE = "arlo.range"
"""The dataclass field metadata key under which `ranged` declares a numeric field's Range."""


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric setting may take: from `lo` to `hi` (None: unbounded on that side;
    an int stays within +-MAX_INT anyway), each end included unless open, plus `special` values
    outside that span with a meaning of their own (0 = off, -1 = the rest)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[tuple[float, str], ...] = ()

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        if any(value == v for v, _ in self.special):
            return True
        # Written as what must hold, so that NaN (every comparison false) is out.
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def describe(self) -> str:
        """As errors say it: `in [0, 1]`, `> 0`, `0 (off) or > 1`."""
        if self.lo is not None and self.hi is not None:
            span = f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            span = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            span = f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            span = "a number"
        return " or ".join([*(f"{_num(v)} ({meaning})" for v, meaning in self.special), span])


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(float(x))


def ranged(default: N, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, special: dict[float, str] | None = None) -> N:
    """A numeric field (int, float, optional, or a tuple of them: each item) with its valid range,
    which `check_ranges` enforces at load: `ge`/`gt` the lower end (inclusive/open), `le`/`lt` the
    upper, `special` values outside it that mean something ({0: "off"}). Every int and float
    setting declares one (tests/unit/test_config_ranges.py)."""
    if (ge is not None and gt is not None) or (le is not None and lt is not None):
        raise TypeError("give one of ge/gt and one of le/lt")
    bounds = Range(lo=gt if gt is not None else ge, hi=lt if lt is not None else le, lo_open=gt is not None,
                   hi_open=lt is not None, special=tuple((special or {}).items()))
    items = default if isinstance(default, tuple) else (default,)
    if not all(v is None or v in bounds for v in items):
        raise TypeError(f"default {default!r} is not {bounds.describe()}")
    return cast(N, field(default=default, metadata={RANGE: bounds}))


def range_of(f: dataclasses.Field[Any]) -> Range | None:
    """The Range a field declares (`ranged`), or None."""
    return f.metadata.get(RANGE)


def check_ranges(cfg: Any, path: str) -> None:
    """Checks each ranged field of the section `cfg` (not of the sections in it: each checks its
    own in its validate). ConfigError naming the field and the range, e.g.
    `rollout.rpc_timeout_s: must be in (0, 604800], got 0.0`."""
    for f in dataclasses.fields(cfg):
        bounds = range_of(f)
        if bounds is None:
            continue
        value = getattr(cfg, f.name)
        where = f"{path}.{f.name}" if path else f.name
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, tuple) else [(where, value)]
        for item_path, item in items:
            _check(item_path, item is None or item in bounds, f"must be {bounds.describe()}, got {item!r}")


def longest_block_ms(socket_timeout_s: float) -> int:
    """The longest blocking stream read a client with this socket timeout may ask for: Redis
    answers a block that ran out a little after its deadline, so min(1 s, half the timeout) is
    left for that (the config checks trainer.read_block_ms with it, the stream every read)."""
    return math.floor((socket_timeout_s - min(1.0, socket_timeout_s / 2)) * 1000)


@_frozen
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL; `arlo up` starts a local, persistent redis-server at this port when nothing answers here."""
    socket_timeout_s: float = ranged(10.0, gt=0, le=MAX_WAIT_S)
    """Socket timeout; blocking reads always block for less than this (redis-py raises otherwise):
    trainer.read_block_ms must stay below it by min(1 s, half of it)."""
    max_backlog: int = ranged(4096, ge=1)
    """Unread trajectories allowed in the stream before producers are told to back off."""
    reconnect_max_s: float = ranged(5.0, ge=MIN_POLL_S, le=MAX_POLL_S)
    """Cap of the exponential reconnect backoff (seconds between retries, at most)."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.url", self.url.startswith(("redis://", "rediss://", "unix://")), "must be a redis:// URL")


@_frozen
class TlsConfig:
    """TLS for every server and client channel (PEM files; a pod mounts its own at these paths)."""

    enabled: bool = False
    """Serve and dial TLS instead of plaintext."""
    cert_file: str = ""
    """Certificate chain this process presents: as a server, and as a client under mTLS."""
    key_file: str = ""
    """Private key of cert_file."""
    ca_file: str = ""
    """CA bundle that verifies peers: servers for clients (empty: system roots), clients for mTLS servers."""
    require_client_cert: bool = False
    """mTLS: servers refuse clients without a certificate signed by ca_file."""
    server_name: str = ""
    """Name clients check in the server certificate instead of the target host (e.g. a shared service cert)."""

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        _check(f"{path}.cert_file", bool(self.cert_file), "must be set when tls is enabled")
        _check(f"{path}.key_file", bool(self.key_file), "must be set when tls is enabled")
        _check(f"{path}.ca_file", not self.require_client_cert or bool(self.ca_file),
               "must be set with require_client_cert (it verifies client certificates)")


@_frozen
class AuthConfig:
    token_env: str = "ARLO_TOKEN"
    """Environment variable holding the bearer token."""
    token_file: str = ""
    """File holding the token (used when the variable is unset)."""
    disabled: bool = False
    """Serve without auth. Only ever on when set explicitly."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """Transport security of every RPC (the token alone travels in the clear without it)."""

    def validate(self, path: str) -> None:
        self.tls.validate(f"{path}.tls")


@_frozen
class TracingConfig:
    """OpenTelemetry traces: a span per RPC on both ends, per rollout episode and per RL step
    (docs/architecture.md, Traces). Off, no tracing code is loaded at all."""

    enabled: bool = False
    """Record traces. Opt-in: a traced RPC costs ~0.4 ms more on both ends (a pipeline bench of short
    episodes ran 153 trajectories/s untraced, 106 traced). Under `arlo up` and `arlo demo` the span
    files go to $ARLO_HOME/traces unless `dir` is set."""
    dir: str = ""
    """Directory of span files, `<service>.jsonl` (one JSON line per span); empty: no files. `arlo up` and `demo` default it to $ARLO_HOME/traces."""
    otlp_endpoint: str = ""
    """OTLP/gRPC collector the spans also go to, e.g. http://otel-collector:4317; empty: $OTEL_EXPORTER_OTLP_ENDPOINT when set, else none."""
    sample_ratio: float = ranged(1.0, ge=0, le=1)
    """Share of traces kept, decided where a trace starts (a rollout episode, a trainer step); the services it calls follow that decision."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.otlp_endpoint", not self.otlp_endpoint or self.otlp_endpoint.startswith(("http://", "https://")),
               f"must start with http:// or https:// (plaintext or TLS to the collector), got {self.otlp_endpoint!r}")


@_frozen
class ServerConfig:
    """Where one service listens. Port 0 picks a free port (tests)."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 for all (others then dial $ARLO_ADVERTISE_HOST or the host name)."""
    port: int = ranged(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (`arlo up`/`demo` choose it before the start and record it in
    $ARLO_HOME/config.yaml, which `arlo train` and `arlo status` read)."""
    metrics_port: int = ranged(0, ge=0, le=65535, special={-1: "off"})
    """Prometheus /metrics port; 0 picks a free port (recorded likewise), -1 disables it."""
    max_message_bytes: int = ranged(64 * 1024 * 1024, ge=1024, lt=2**31)
    """Largest gRPC message sent or received (weights travel in chunks below it), in [1 KiB, 2 GiB)."""
    grace_s: float = ranged(5.0, ge=0, le=MAX_WAIT_S)
    """On SIGTERM: NOT_SERVING, then this long for in-flight RPCs to finish; 0 cancels them at once."""
    max_concurrent_rpcs: int = ranged(0, ge=0)
    """RPCs in flight on the whole server (health included); the excess gets RESOURCE_EXHAUSTED. 0 = no cap."""
    max_rpcs_per_client: int = ranged(1024, ge=0)
    """RPCs in flight from one client connection (health exempt); the excess gets RESOURCE_EXHAUSTED. 0 = no cap."""
    max_health_watches: int = ranged(256, ge=1)
    """Open grpc.health.v1 Watch streams on the server (unauthenticated, long-lived); the excess gets RESOURCE_EXHAUSTED."""
    max_health_watches_per_client: int = ranged(16, ge=1)
    """Open health Watch streams from one client host (all its connections); the excess gets RESOURCE_EXHAUSTED."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def validate(self, path: str) -> None:
        check_ranges(self, path)


@_frozen
class MeshConfig:
    """Named device mesh axes, e.g. data x fsdp x tensor.

    One size may be -1: "all the devices the other axes leave". The defaults put every
    device on `data` (pure data parallelism), which is right on one device too.
    """

    axis_names: tuple[str, ...] = ("data", "fsdp", "tensor")
    """Names of the mesh axes, outermost first."""
    axis_sizes: tuple[int, ...] = ranged((-1, 1, 1), ge=1, special={-1: "the rest"})
    """Size of each axis; one may be -1 (all the devices the others leave)."""
    dcn_axis: str = "data"
    """With devices of several TPU slices (multislice), this axis is split across slices
    (over the data-centre network); the others stay inside a slice (ICI)."""

    def validate(self, path: str = "mesh") -> None:
        check_ranges(self, path)
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise ConfigError(f"{path}.axis_sizes: needs one size per axis name "
                              f"({len(self.axis_names)} names, {len(self.axis_sizes)} sizes)")
        if len(set(self.axis_names)) != len(self.axis_names) or not all(self.axis_names):
            raise ConfigError(f"{path}.axis_names: must be distinct and non-empty, got {list(self.axis_names)}")
        if list(self.axis_sizes).count(-1) > 1:
            raise ConfigError(f"{path}.axis_sizes: at most one -1, got {list(self.axis_sizes)}")
        if self.dcn_axis not in self.axis_names:
            raise ConfigError(f"{path}.dcn_axis: {self.dcn_axis!r} is not one of {list(self.axis_names)}")

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """The concrete axis sizes for `num_devices` devices (-1 resolved); ValueError if they don't fit."""
        self.validate()
        known = math.prod(s for s in self.axis_sizes if s != -1)
        if -1 in self.axis_sizes:
            if num_devices % known:
                raise ValueError(f"mesh {self._describe()} does not divide {num_devices} devices "
                                 f"(the fixed axes need a multiple of {known})")
            return tuple(num_devices // known if s == -1 else s for s in self.axis_sizes)
        if known != num_devices:
            raise ValueError(f"mesh {self._describe()} has {known} devices, but there are {num_devices}; "
                             "make one axis -1 to take the rest")
        return tuple(self.axis_sizes)

    def _describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=True))


SERVICE_NAMES = ("inference", "trainer", "env_gateway", "reward", "rollout")
"""arlo's services: each a config section and a `python -m services.<name>` process."""


@_frozen
class LocalConfig:
    """How `arlo up` and `arlo demo` run the services on this host, and the rollout workers `arlo
    train` adds beside them (ignored on Kubernetes, where a pod's resources decide)."""

    cpus: str = "auto"
    """How the host's CPUs are shared among the local services (arlo/app/cpu_layout.py).
    "auto": on a CPU platform with 2+ CPUs, a synchronous run (trainer.max_staleness 0) lets
    inference and the trainer each use every CPU (they take turns), and an asynchronous run gives
    each half (they run at once: shared cores time-slice both and thrash their thread pools).
    "off": the OS schedules everything. Or explicit shares, e.g. "inference=0,trainer=1+2,rollout=0"
    ('+' joins CPUs of one service; a service left out is not pinned)."""
    compute_nice: int = ranged(10, ge=0, le=19)
    """Scheduling niceness (0-19, Linux) of inference and the trainer as `arlo up`/`demo` start
    them. Their XLA thread pools keep every core they may use busy, while rollout, the env gateway
    and reward do little work but sit on every step's critical path: at one priority an env Step
    or a Score waited its turn behind them. 0: every service at the same priority."""

    accelerators: str = "auto"
    """Which GPUs inference and the trainer use when the local services run on GPUs (JAX_PLATFORMS
    cuda; arlo/app/accelerator_layout.py). "auto": with 2+ GPUs visible (CUDA_VISIBLE_DEVICES, else
    nvidia-smi), inference takes the first half (rounded up) and the trainer the rest, so
    generation and training run at once on chips of their own; with one GPU they share it.
    "auto" shares them instead where a service's mesh does not fit its half (a warning says so).
    "shared": both see every GPU. Or explicit, e.g. "inference=0+1,trainer=2" (GPU ids or UUIDs
    as CUDA_VISIBLE_DEVICES takes them, numbered in CUDA_DEVICE_ORDER; '+' joins GPUs of one
    service). Ignored, with a warning, on a platform other than CUDA."""
    accelerator_memory: float = ranged(0.9, gt=0, le=1)
    """Share of each GPU's memory the local services take (XLA_PYTHON_CLIENT_MEM_FRACTION, set per
    process): split evenly between inference and the trainer when they share any GPU, whole for
    each when their GPUs are disjoint. JAX's default lets the first process on a GPU take 75% and the second fail for want
    of memory. Not applied when XLA_PYTHON_CLIENT_MEM_FRACTION, _PREALLOCATE or _ALLOCATOR is set:
    the services then get that. The light services keep JAX on the CPU."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        if self.cpus not in ("auto", "off"):
            _check_shares(f"{path}.cpus", self.cpus, keywords=("auto", "off"), services=SERVICE_NAMES, unit="CPU")
        if self.accelerators not in ("auto", "shared"):
            # The services that run the model (arlo/app/accelerator_layout.py's COMPUTE_SERVICES).
            _check_shares(f"{path}.accelerators", self.accelerators, keywords=("auto", "shared"),
                          services=("inference", "trainer"), unit="GPU")


def _is_id(unit: str, text: str) -> bool:
    """A CPU is a number; a GPU a number or a UUID (GPU-..., MIG-...), as CUDA_VISIBLE_DEVICES takes it."""
    text = text.strip()
    return (text.isascii() and text.isdecimal()) or (unit == "GPU" and text.startswith(("GPU-", "MIG-")))


def _check_shares(path: str, text: str, *, keywords: tuple[str, ...], services: tuple[str, ...], unit: str) -> None:
    """`text` is service=id[+id],... with each service of `services` at most once."""
    named: set[str] = set()
    for item in text.split(","):
        name, sep, ids = item.partition("=")
        name = name.strip()
        _check(path, bool(sep) and name in services,
               f"expected {', '.join(repr(k) for k in keywords)} or service={unit.lower()}[+{unit.lower()}],... "
               f"with services of {services}, got {item!r}")
        _check(path, name not in named, f"{name} is given twice")
        named.add(name)
        _check(path, all(_is_id(unit, c) for c in ids.split("+")),
               f"{unit}s are {'numbers' if unit == 'CPU' else 'numbers or UUIDs'} joined by '+', got {ids!r} for {name}")
