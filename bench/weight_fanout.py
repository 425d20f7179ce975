"""Weight sync to a fleet: the time from a publish to every replica serving it, one replica against
N, the trainer's egress per version, and the bytes a delta publish costs (`bench/weight_sync.py
--replicas N` runs this).

The trainer side is bench/weight_trainer.py (a float32 master moved by +-lr per element, Adam's
first step, published in bfloat16 through the real VersionEncoder, store, pointer and
TrainerServicer); each replica is bench/weight_replica.py (the real WeightSync into a bare
parameter tree, no engine, so that several fit on a small machine). All are local processes on
loopback over one Redis. Each phase (1 replica, then N) starts fresh: a full version, then
`--deltas` delta versions (the steady state); the bars read the steady state.

    fanout_over_single     median(publish -> all N serving) / median(publish -> the 1 serving)
    trainer_egress_copies  the most the trainer sent for one version (written to storage plus
                           PullWeights), in full copies, with N replicas
    delta_bytes_ratio      median bytes of a delta publish / a full bfloat16 copy
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

START_S = 600.0
TUNABLES = "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=16777216"
"""Buffers of 16 MB and more (payloads, arrays) mapped on their own and handed back when freed:
five processes each holding ~1 GB payloads share one small machine (the services keep their
peak instead, arlo/hostmem.py)."""
"""How long a process may take to import JAX and build its model (0.5B on a loaded 2-core machine)."""


class Proc:
    """A bench process speaking JSON lines on stdout, read on a thread into a queue."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": TUNABLES})
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name} said nothing for {timeout_s:.0f}s") from None
        if line is None:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()})")
        return line

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """kill -9, as a node loses a process."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """The trainer side ends at the end of its input; a replica (which reads none) on SIGTERM."""
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.kill()


class Fleet:
    """One trainer side and its replicas over one Redis run."""

    def __init__(self, *, redis_url: str, model: str, storage: str, full_every: int, lr: float,
                 check: bool = False, run: str = "") -> None:
        self.redis_url, self.model, self.storage = redis_url, model, storage
        self.full_every, self.lr, self.check = full_every, lr, check
        self.run = run or f"wsync-{uuid.uuid4().hex[:10]}"
        self.trainer: Proc | None = None
        self.replicas: list[Proc] = []

    def start_trainer(self) -> Proc:
        argv = ["bench.weight_trainer", "--redis", self.redis_url, "--run", self.run, "--model", self.model,
                "--full-every", str(self.full_every), "--lr", repr(self.lr)]
        self.trainer = Proc(argv + (["--storage", self.storage] if self.storage else []), "the trainer side")
        self.trainer.next(START_S)  # {"ready": port}
        return self.trainer

    def start_replica(self) -> Proc:
        argv = ["bench.weight_replica", "--redis", self.redis_url, "--run", self.run]
        replica = Proc(argv + (["--check"] if self.check else []), f"replica {len(self.replicas)}")
        replica.next(START_S)  # {"ready": true}
        self.replicas.append(replica)
        return replica

    def publish(self, mode: str = "") -> dict[str, Any]:
        assert self.trainer is not None
        self.trainer.send(f"publish {mode}".strip())
        return self.trainer.next(START_S)

    def served(self, version: int, replicas: list[Proc] | None = None, timeout_s: float = START_S
               ) -> list[dict[str, Any]]:
        """Each replica's line for `version` (reading past the older versions it installed on the way)."""
        out = []
        for replica in replicas if replicas is not None else self.replicas:
            deadline = time.monotonic() + timeout_s
            while True:
                line = replica.next(max(0.1, deadline - time.monotonic()))
                if line.get("version", 0) >= version:
                    out.append(line)
                    break
        return out

    def close(self) -> None:
        for p in [*self.replicas, *([self.trainer] if self.trainer else [])]:
            p.stop()
        self.replicas = []
        self.trainer = None


def wait_for_memory(need_bytes: int, timeout_s: float = 900.0) -> None:
    """Waits until the machine has `need_bytes` available (MemAvailable): a shared dev machine's
    other work comes and goes, and a fleet started short of memory gets someone OOM-killed."""
    deadline = time.monotonic() + timeout_s
    while (available := _available_bytes()) < need_bytes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{need_bytes / 2**30:.1f} GiB never became available "
                               f"({available / 2**30:.1f} GiB after {timeout_s:.0f}s)")
        print(f"waiting for {need_bytes / 2**30:.1f} GiB of memory ({available / 2**30:.1f} available)",
              file=sys.stderr, flush=True)
        time.sleep(15)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def phase(redis_url: str, *, model: str, replicas: int, deltas: int, lr: float, topology: str,
          need_bytes: int = 0) -> list[dict[str, Any]]:
    """One fresh fleet of `replicas`: a full version, then `deltas` deltas; a row per version.
    `need_bytes`: the memory to wait for before starting it."""
    wait_for_memory(need_bytes)
    with tempfile.TemporaryDirectory(prefix="arlo-weights-") as tmp:
        storage = f"file://{tmp}" if topology == "storage" else ""
        fleet = Fleet(redis_url=redis_url, model=model, storage=storage, full_every=deltas + 1000, lr=lr)
        rows = []
        try:
            fleet.start_trainer()
            for _ in range(replicas):
                fleet.start_replica()
            sent_before = 0
            for _ in range(deltas + 1):
                published = fleet.publish()
                lines = fleet.served(published["version"])
                egress = published["sent_bytes"] - sent_before + (published["published_bytes"] if storage else 0)
                sent_before = published["sent_bytes"]
                rows.append({**published, "replicas": replicas,
                             "all_served_s": max(x["served_at"] for x in lines) - published["started_at"],
                             "publish_s": published["pointer_at"] - published["started_at"],
                             "egress_copies": egress / published["full_bytes"]})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "sha256"}), file=sys.stderr, flush=True)
        finally:
            fleet.close()
        return rows


def figures(single: list[dict[str, Any]], fleet: list[dict[str, Any]]) -> dict[str, Any]:
    def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r["kind"] == "delta"] or rows[1:] or rows

    single_s = statistics.median(r["all_served_s"] for r in steady(single))
    fleet_s = statistics.median(r["all_served_s"] for r in steady(fleet))
    deltas = [r for r in single + fleet if r["kind"] == "delta"]
    return {
        "fanout_over_single": fleet_s / single_s,
        "fanout_over_single_full": fleet[0]["all_served_s"] / single[0]["all_served_s"],
        "single_served_s": single_s, "fleet_served_s": fleet_s,
        "trainer_egress_copies": max(r["egress_copies"] for r in fleet),
        "delta_bytes_ratio": statistics.median(r["published_bytes"] / r["full_bytes"] for r in deltas) if deltas
        else None,
        "changed_fraction_per_step": [r["changed_fraction"] for r in deltas],
        "full_bytes": fleet[0]["full_bytes"],
        "versions": single + fleet,
    }
