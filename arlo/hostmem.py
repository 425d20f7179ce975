"""glibc malloc settings for the processes that run XLA programs on the host.

XLA:CPU allocates a program's temporaries afresh on every call. A decode chunk's attention
window is one of them: about 180 MB for the `small` model at batch 64. glibc serves a large
request from a thread's arena and, past the arena's 64 MB heap, falls back to mmap; the
memory is unmapped again when the call ends. So every call page-faults its temporaries back in.

Measured with `bench/decode.py` (small model, batch 64, 2-core dev machine): 514K minor page
faults in 8 decode chunks, against 23K with the settings below. Over five alternated A/B
pairs the decode step went from 38-44 ms to 35-41 ms (roofline_fraction_b64 0.38-0.44 ->
0.42-0.46); a train step (`bench/train_step.py`) from 6.4-6.8 s to 4.9-5.2 s.

The settings:
- `arena_max=1` and `mmap_threshold` 256 MiB: every allocation below 256 MiB comes from one
  heap grown with sbrk, so a freed temporary is reused by the next call;
- `trim_threshold` 64 GiB: that heap is not handed back to the kernel between calls. The cost
  is that resident memory stays at its peak, which suits a long-running service;
- allocations of 256 MiB and more are mapped on their own and unmapped when freed. With every
  allocation on the heap (`mmap_max=0`, the earlier setting), a 0.5B trainer never gave back its
  step's 6.9 GB of temporaries nor a publish's copies, and the fragmented heap grew by about
  0.9 GB per step (rss 16.7, 17.7, 18.6 GB after steps 1-3; the services' 0.5B GRPO step was
  OOM-killed on a 23 GB machine). With the threshold it settles at 10.9 GB between steps, for
  the same step time (in-process RL steps of the Qwen2.5-0.5B shape, 8x4 rows of 160 tokens,
  micro-batch 8, remat full: 114/122/110 s before, 120/110/104 s after; a fault per 2 MB huge
  page of such a buffer is noise beside the programs that allocate it);
- `hugetlb=1`: the heap is backed by transparent huge pages. First touch faults 512 times
  less often, and TLB misses drop while attention streams the KV cache.

glibc reads `GLIBC_TUNABLES` once, at process start, so the variable must be in the
environment a process is started with:
- `arlo`'s local cluster puts it there for every service;
- the container image sets it (deploy/Dockerfile);
- the in-process benches re-exec themselves with it (`reexec_with_tunables`).

Other C libraries ignore the variable. A user's own `glibc.malloc.*` settings always win.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

GLIBC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=268435456:"
                  "glibc.malloc.trim_threshold=68719476736")
"""Kept equal to the ENV line in deploy/Dockerfile (a test checks)."""


def merged_tunables(existing: str | None) -> str:
    """`existing` with each of our settings added unless it already names that tunable."""
    items = [item for item in (existing or "").split(":") if item]
    named = {item.split("=", 1)[0] for item in items}
    items += [item for item in GLIBC_TUNABLES.split(":") if item.split("=", 1)[0] not in named]
    return ":".join(items)


def with_tunables(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` whose GLIBC_TUNABLES includes the settings above."""
    return {**env, "GLIBC_TUNABLES": merged_tunables(env.get("GLIBC_TUNABLES"))}


def reexec_with_tunables() -> None:
    """Restarts this process (same pid, same command line) with the settings applied, unless
    they already are, the platform is not glibc Linux, or ARLO_DEFAULT_MALLOC=1 opts out.
    Call it first thing in main(), before any JAX work."""
    if os.environ.get("ARLO_DEFAULT_MALLOC") == "1" or platform.libc_ver()[0] != "glibc":
        return
    current = os.environ.get("GLIBC_TUNABLES")
    if merged_tunables(current) == (current or ""):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), with_tunables(os.environ))
