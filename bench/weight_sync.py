"""How fast a published version's bytes reach an inference replica: the trainer's hashing at
publish, then a PullWeights stream into the replica's checked buffer; with `--replicas N`, how a
version reaches a fleet (bench/weight_fanout.py: deltas, shared storage, 1 replica against N).

    python -m bench.weight_sync [--sizes-mb 2.4,64,256] [--pulls 10] [--json PATH]
    python -m bench.weight_sync --replicas 4 --model qwen2.5-0.5b-shape [--deltas 4] [--lr 1e-6]
        [--topology storage|trainer] [--json PATH]

Fleet figures: Qwen2.5-0.5B shape in bfloat16 (988 MB), lr 1e-6, shared storage, one full version
then 3 deltas per phase, on the 2-core dev machine while ~6 other agents ran (load average
25-31), `--replicas 4 --model qwen2.5-0.5b-shape --deltas 3`:

| | 1 replica | 4 replicas | bar |
| --- | --- | --- | --- |
| publish -> all serving, deltas (median) | 56 s | 122 s | fanout_over_single 2.18 (<= 1.5: not met here) |
| publish -> all serving, the full version | 63 s | 36 s | (0.56; load noise) |
| trainer egress per version | 1.0 copy (full), 0.063 (delta) | the same | trainer_egress_copies 1.00 (<= 1.2) |
| bytes per delta publish / a full copy | 0.063 | 0.063 | delta_bytes_ratio 0.063 (<= 0.2) |
| bfloat16 elements changed per step | 4.23 % | 4.23 % | |

The trainer's egress does not grow with the replicas (it writes each version once), and a delta
is 6.3 % of a copy (4.23 % of elements change when every element moves by exactly lr, Adam's
first step: an upper bound). The fan-out time does: each replica's own work (read and
decompress the delta, apply it, one sha256 pass over 988 MB, the tree's copy) ran on the same two
shared cores, so four replicas took 47-81 s after the pointer moved against 7-14 s for one; the
trainer's publish (step, serialise, hash, diff: 34-75 s here) is common to both. On replicas
with their own cores (pods), the per-replica part runs side by side.

The single-replica pull, below:

The trainer side runs in a subprocess: the real TrainerServicer, served by `start_server` as the
trainer serves it, over a VersionStore. For each version the parent asks it to publish a payload
of the size (random bytes; hashed as `TrainingLoop._stored` hashes a version, timed there), then
pulls it with `services.inference.weights.pull_weights` over one cached channel, as WeightSync
does. Serialisation, the pointer's Redis round trips, the restore and the swap are not in it
(bench/step_anatomy.py has the whole chain); this is the part that grows with the model.

Two ways of hashing a version's chunks, alternating version by version, in one run:
- `at publish`: `hashed_payload`, the chunks' digests beside the payload's, in two threads;
- `on first pull`: the payload's digest alone at publish, each chunk hashed as the first pull
  sends it (what the trainer did before).

Reported per size and way (medians): publish (hashing + store), pull, publish + pull, the pull's
MB/s, and for scale one sha256 pass over the payload in this process. 2.4 MB is the 596k preset's
float32 payload; 256 MB about a 0.13B model in bfloat16.

On the 2-core machine, idle otherwise, `--sizes-mb 2.4,64,256 --pulls 8`, publish + pull in ms
(medians, two runs each):

| trainer hashes chunks | replica checks | 64 MB | 256 MB | 2.4 MB |
| --- | --- | --- | --- | --- |
| on first pull (before) | every chunk, then the payload | 235-261 | 926-1032 | 13-16 |
| at publish | every chunk, then the payload | 217-253 | 852-969 | 12-16 |
| at publish (now) | the payload; the chunks only to name a bad one | 203-205 | 779-797 | 11-15 |

The publish itself stays at ~37 / ~150 ms (the chunks are hashed on the second core beside the
whole); the pull alone went from 703-809 to 628-642 ms at 256 MB (~400 MB/s). A bare gRPC
stream of 1 MiB messages moves 1.2-1.7 GB/s here: what is left is one sha256 pass and the
copies, sharing two cores with the sender. Receiving while checking the previous chunk in two
threads was tried and was slower on two cores (64 MB: 194-217 ms against 180-189).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import select
import statistics
import subprocess
import sys
import time
import types
from typing import Any

from bench.common import check_json_arg, float_list, int_at_least, print_table, run_main, write_json

WAYS = ("at publish", "on first pull")
MODELS = ("qwen2.5-0.5b-shape", "tiny-shape")
START_S = 60.0
"""How long the trainer side may take to import and listen."""


async def serve(size: int) -> None:
    """The trainer side: reads `publish VERSION WAY` lines, answers `published SECONDS`."""
    from arlo.config.base import AuthConfig, ServerConfig
    from arlo.model.weights import sha256_hex
    from arlo.proto.v1 import trainer_pb2_grpc
    from arlo.rpc.server import ServiceBinding, start_server
    from services.trainer.publish import VersionStore, hashed_payload
    from services.trainer.server import TrainerServicer

    data = os.urandom(size)
    store = VersionStore(keep=2)
    loop = types.SimpleNamespace(store=store, source="grpc://bench",
                                 state=types.SimpleNamespace(checkpoint_version=0, checkpoint_uri=""))
    running = await start_server("trainer", ServerConfig(metrics_port=-1), AuthConfig(disabled=True),
                                 [ServiceBinding("arlo.v1.Trainer", trainer_pb2_grpc.add_TrainerServicer_to_server,
                                                 TrainerServicer(loop))])
    print(running.port, flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        version, way = int(line[1]), " ".join(line[2:])
        started = time.perf_counter()
        if way == WAYS[0]:
            digests = await asyncio.to_thread(hashed_payload, data)
            store.put(version, data, sha256=digests.sha256, chunk_digests=digests.chunks)
        else:
            store.put(version, data, sha256=await asyncio.to_thread(sha256_hex, data))
        print(f"published {time.perf_counter() - started}", flush=True)
    await running.stop(None)


async def measure(size: int, pulls: int) -> dict[str, dict[str, float]]:
    from arlo.rpc import make_channel
    from services.inference.weights import pull_weights

    proc = subprocess.Popen([sys.executable, "-m", "bench.weight_sync", "--serve", str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if not select.select([proc.stdout], [], [], START_S)[0]:
            raise TimeoutError(f"the trainer side did not start within {START_S:.0f}s")
        target = f"127.0.0.1:{int(proc.stdout.readline())}"
        channel = make_channel(target, token=None)
        times: dict[str, dict[str, list[float]]] = {way: {"publish": [], "pull": []} for way in WAYS}
        for version in range(1, 2 * (pulls + 1) + 1):  # the first of each way warms the channel up
            way = WAYS[version % 2]
            proc.stdin.write(f"publish {version} {way}\n")
            proc.stdin.flush()
            publish_s = float(proc.stdout.readline().split()[1])
            started = time.perf_counter()
            data, _ = await pull_weights(target, version, token=None, channel=channel)
            pull_s = time.perf_counter() - started
            assert len(data) == size
            if version > 2:
                times[way]["publish"].append(publish_s)
                times[way]["pull"].append(pull_s)
        await channel.close()
    finally:
        with contextlib.suppress(BrokenPipeError):  # it died: what it raised is the story
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = {}
    for way, t in times.items():
        publish, pull = statistics.median(t["publish"]), statistics.median(t["pull"])
        both = statistics.median(a + b for a, b in zip(t["publish"], t["pull"], strict=True))
        out[way] = {"publish_ms": publish * 1e3, "pull_ms": pull * 1e3, "publish_and_pull_ms": both * 1e3,
                    "pull_mb_per_s": size / pull / 1e6}
    return out


def sha256_pass_ms(size: int) -> float:
    data = os.urandom(size)
    started = time.perf_counter()
    for _ in range(3):
        hashlib.sha256(data).digest()
    return (time.perf_counter() - started) / 3 * 1e3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="2.4,64,256", type=float_list(0), help="payload sizes, MB (10^6 bytes)")
    parser.add_argument("--pulls", type=int_at_least(1), default=10, help="timed versions per size and way")
    parser.add_argument("--json", help="write the figures here")
    fleet = parser.add_argument_group("a fleet (bench/weight_fanout.py): publish -> N replicas serving, "
                                      "deltas, the trainer's egress")
    fleet.add_argument("--replicas", type=int_at_least(1), help="measure 1 replica against this many instead")
    fleet.add_argument("--model", default="qwen2.5-0.5b-shape", choices=MODELS,
                       help="the parameter shapes published (random weights)")
    fleet.add_argument("--deltas", type=int_at_least(1), default=4, help="delta versions after the full one")
    fleet.add_argument("--lr", type=float, default=1e-6, help="the +-lr each element moves per step")
    fleet.add_argument("--topology", choices=("storage", "trainer"), default="storage",
                       help="storage: written once to a file:// directory; trainer: every replica pulls over gRPC")
    fleet.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="a Redis to use (else one is started)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the trainer side (a subprocess)
    args = parser.parse_args(argv)
    if args.serve is None:
        check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return
    if args.replicas is not None:
        fanout_main(args)
        return
    figures: dict[str, Any] = {"pulls": args.pulls, "sizes": {}}
    rows = []
    for mb in args.sizes_mb:
        size = int(mb * 1e6)
        per_way = asyncio.run(measure(size, args.pulls))
        sha_ms = sha256_pass_ms(size)
        figures["sizes"][f"{mb:g}"] = {"bytes": size, "sha256_pass_ms": sha_ms, **per_way}
        for way, f in per_way.items():
            rows.append((f"{mb:g} MB", way, f["publish_ms"], f["pull_ms"], f["publish_and_pull_ms"],
                         f["pull_mb_per_s"], sha_ms))
        print(f"{mb:g} MB done", file=sys.stderr, flush=True)
    print_table(f"Weight sync: publish hashing + PullWeights, medians of {args.pulls}",
                ["payload", "chunk digests", "publish ms", "pull ms", "publish + pull ms", "pull MB/s",
                 "one sha256 pass ms"], rows)
    write_json(args.json, figures)


def fanout_main(args: argparse.Namespace) -> None:
    from arlo.app.redis_server import redis_answers, start_local_redis
    from bench.weight_fanout import figures, phase

    server = None if redis_answers(args.redis) else start_local_redis()
    url = server.url if server is not None else args.redis
    model = args.model.removesuffix("-shape")
    # Per process at 0.5B: the trainer side ~5 GB (a float32 master, the version held, a publish's
    # copies), a replica ~2.5 GB (the payload served, a delta's copy of it, the runtime).
    need = {"qwen2.5-0.5b": (5 << 30, 5 << 29), "tiny": (1 << 29, 1 << 28)}[model]
    try:
        single = phase(url, model=model, replicas=1, deltas=args.deltas, lr=args.lr, topology=args.topology,
                       need_bytes=need[0] + need[1])
        fleet = phase(url, model=model, replicas=args.replicas, deltas=args.deltas, lr=args.lr,
                      topology=args.topology, need_bytes=need[0] + args.replicas * need[1])
    finally:
        if server is not None:
            server.stop()
    out = {"replicas": args.replicas, "model": args.model, "lr": args.lr, "topology": args.topology,
           **figures(single, fleet)}
    rows = [(r["replicas"], r["version"], r["kind"], f"{100 * r['changed_fraction']:.2f}",
             f"{r['published_bytes'] / 1e6:.1f}", f"{r['published_bytes'] / r['full_bytes']:.3f}",
             f"{r['egress_copies']:.3f}", f"{r['publish_s']:.2f}", f"{r['all_served_s']:.2f}") for r in out["versions"]]
    print_table(f"Weight sync, {args.model} (bfloat16, {out['full_bytes'] / 1e6:.0f} MB), lr {args.lr:g}, "
                f"{args.topology}: 1 replica, then {args.replicas}",
                ["replicas", "version", "kind", "changed %", "published MB", "of a full copy", "trainer egress copies",
                 "publish s", "publish -> all serving s"], rows)
    print(f"fanout_over_single {out['fanout_over_single']:.2f} (full version: {out['fanout_over_single_full']:.2f}), "
          f"trainer_egress_copies {out['trainer_egress_copies']:.3f}, delta_bytes_ratio "
          f"{out['delta_bytes_ratio'] if out['delta_bytes_ratio'] is None else round(out['delta_bytes_ratio'], 4)}")
    write_json(args.json, out)


if __name__ == "__main__":
    run_main(main)
