"""Finding or starting a Redis server: `arlo up` and the tests start their own when none answers."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from arlo.app.supervisor import ProcessSpec

INSTALL_HINT = (
    "no redis-server on PATH. Install one (Debian/Ubuntu: `sudo apt-get install redis-server`; "
    "macOS: `brew install redis`) or point redis.url at a running Redis."
)


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis server answers PING at `url`."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server that binds it later: below the kernel's ephemeral range where
    the kernel says what that is. A port the kernel picked (bind to 0) is one it also gives to
    outgoing connections, and one did take it between this call and the server's bind (CI: a
    rollout worker could not listen on 35583 after four services had opened their clients). Never
    the same port twice in one process."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    if ephemeral_low > _LOWEST_PORT + 1000:
        for port in random.sample(range(_LOWEST_PORT, ephemeral_low), 200):
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:  # no known ephemeral range (or nothing free below it): the kernel's pick
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class LocalRedis:
    """A redis-server child process in a temp dir, persisting nothing."""

    url: str
    process: subprocess.Popen[bytes]
    workdir: tempfile.TemporaryDirectory[str]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.workdir.cleanup()


def start_local_redis(port: int | None = None, timeout_s: float = 10.0) -> LocalRedis:
    """Starts redis-server on 127.0.0.1:`port` (a free one when None) and waits for PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(INSTALL_HINT)
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="arlo-redis-")
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", workdir.name, "--logfile", f"{workdir.name}/redis.log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            workdir.cleanup()
            raise RuntimeError(f"redis-server exited with {proc.returncode} on port {port}")
        if redis_answers(url, 0.2):
            return LocalRedis(url=url, process=proc, workdir=workdir)
        time.sleep(0.05)
    LocalRedis(url=url, process=proc, workdir=workdir).stop()
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s}s")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def local_redis_url(url: str, *, free_ports: bool) -> str:
    """Where `arlo up` starts its Redis when none answers at `url`: at `url` itself, so every
    command given the same config finds it (`arlo up -c X`, then `arlo train -c X`). Another
    port only when `free_ports` (the demo) and that one is taken by something that is not Redis."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    if host not in LOOPBACK:
        raise RuntimeError(f"no Redis answers at redis.url {url!r}, and arlo starts one only on a loopback "
                           f"address; start that Redis or set redis.url to redis://127.0.0.1:<port>/0")
    if not port_is_free("127.0.0.1", port):
        if not free_ports:
            raise RuntimeError(f"no Redis answers at redis.url {url!r}, and its port {port} is taken by "
                               f"something else; free it or set redis.url to another port")
        port = free_port()
    auth = f":{parsed.password}@" if parsed.password else ""
    return f"redis://{auth}127.0.0.1:{port}{parsed.path or '/0'}"


def redis_spec(url: str, data_dir: Path, log_dir: Path) -> ProcessSpec:
    """A supervised, persistent redis-server for `url` (a loopback URL from `local_redis_url`).

    Its append-only file lives in `data_dir`: a restart after kill -9 reloads every trajectory,
    pointer and ack. `appendfsync always`: every write is on disk before Redis replies. With
    `everysec` a kill -9 right after a reply lost that write in 2 of 4 tries here (redis 7.0:
    the AOF write can be deferred while a background fsync runs), which the fault test catches.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(INSTALL_HINT)
    parsed = urlparse(url)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    argv = [binary, "--bind", "127.0.0.1", "--port", str(parsed.port), "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(data_dir), "--logfile", ""]
    if parsed.password:
        argv += ["--requirepass", parsed.password]
    return ProcessSpec(name="redis", argv=tuple(argv), address=f"127.0.0.1:{parsed.port}",
                       log_path=log_dir / "redis.log", ready=lambda _addr, t: redis_answers(url, t), stop_last=True)


def host_port(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 6379
