"""`python -m services.inference [-c CONFIG] [--port P] [--metrics-port M]`.

Multi-host: `main` joins the JAX processes the environment describes (a JobSet across the
hosts of a TPU slice; `arlo.distributed.initialize_from_env`, a no-op on one host) before
any JAX work, and the engine shards the model and its KV cache over the mesh
`inference.mesh` builds from this process's devices. Each process serves its own replica
on its local devices: an engine's continuous batching is host-local state, and the
rollout workers spread requests over the replicas.
"""

from __future__ import annotations

import asyncio

import jax
from jax.sharding import Mesh

from arlo.background import TaskGroup
from arlo.compile_cache import enable_compile_cache
from arlo.compile_watch import CompileWatch
from arlo.config import MeshConfig, RunConfig
from arlo.coord import Heartbeat, WeightPointer, connect
from arlo.coord.heartbeat import instance_id
from arlo.distributed import initialize_from_env, make_mesh
from arlo.filter_replay import serving_inference
from arlo.model.weights import nonfinite_param
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from arlo.rpc import (
    RunningServer,
    ServiceBinding,
    advertise_host,
    load_token,
    run_until_signal,
    setup_logging,
    start_server,
)
from arlo.rpc.metrics import inference_collector
from arlo.service_args import parse_service_config
from arlo.tracing import Tracing, service_tracing
from services.inference.engine import Engine
from services.inference.episodes import EpisodeRecorder
from services.inference.openai_http import OpenAIEndpoint, bind, serve_openai
from services.inference.runs import EngineSlot, run_slots
from services.inference.server import InferenceServicer
from services.inference.weights import WeightSync


async def start_inference(cfg: RunConfig, tasks: TaskGroup, compiles: CompileWatch | None = None,
                          tracing: Tracing | None = None) -> tuple[RunningServer, Engine]:
    """`compiles`: this process's compile counter (installed before any JAX work); its figures go
    into the heartbeat and /metrics, and every compile after the warm-up is logged."""
    ic = serving_inference(cfg)  # top logprobs wide enough for the run's kept sets (filter replay)
    compiles = compiles or CompileWatch().install()
    source = cfg.model_source()
    slots = run_slots(cfg)
    engine = Engine(source, config=ic, mesh=inference_mesh(ic.mesh), adapters=len(slots) if len(slots) > 1 else 0,
                    recompute_on_swap=cfg.rollout.partial)
    # Every program the limits allow, and the check a pulled version goes through, compile now:
    # a run then compiles nothing (each late compile is logged and counted).
    await asyncio.to_thread(engine.warm_up)
    await asyncio.to_thread(nonfinite_param, engine.state)
    compiles.mark_warm()
    redis = await connect(cfg.redis)
    # One WeightSync per run, each following its run's pointer into its own adapter slot.
    syncs = {run: WeightSync(engine if slot == 0 else EngineSlot(engine, slot), WeightPointer(redis, run),
                             token=load_token(cfg.auth), tls=cfg.auth.tls, poll_s=ic.weight_poll_s,
                             max_message_bytes=ic.server.max_message_bytes) for run, slot in slots.items()}
    sync = syncs[cfg.run_id]
    name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    recorder = EpisodeRecorder(max_episodes=ic.openai_max_episodes, max_calls=ic.openai_max_calls,
                               ttl_s=ic.openai_episode_ttl_s)
    servicer = InferenceServicer(engine, source.tokenizer_name, recorder=recorder, runs=slots)
    running = await start_server("inference", ic.server, cfg.auth, [
        ServiceBinding(name=name, add_to_server=inference_pb2_grpc.add_InferenceServicer_to_server,
                       servicer=servicer)], tracing=tracing)
    running.registry.register(inference_collector(
        lambda: {**engine.metrics(), **compiles.metrics(), "last_swap_seconds": sync.stats.last_swap_s}))
    host = advertise_host(ic.server.host)
    if ic.openai_port >= 0:
        servicer.openai_url = start_openai(cfg, engine, recorder, tasks, host, runs=slots)
    tasks.spawn("engine", lambda: run_engine(engine))
    for run, slot in slots.items():  # every run served here sees this service in its own status
        heartbeat = Heartbeat(redis, run, service="inference", instance=instance_id())
        tasks.spawn(f"weight-sync-{run}" if slot else "weight-sync", syncs[run].run)
        tasks.spawn(f"heartbeat-{run}" if slot else "heartbeat", lambda hb=heartbeat, s=slot: hb.run(2.0, lambda: {
            "address": f"{host}:{running.port}", "openai_url": servicer.openai_url, **engine.metrics(),
            "weight_version": engine.versions[s], **compiles.metrics()}))
    return running, engine


def start_openai(cfg: RunConfig, engine: Engine, recorder: EpisodeRecorder, tasks: TaskGroup, host: str,
                 runs: dict[str, int] | None = None) -> str:
    """Binds the OpenAI-compatible endpoint beside gRPC; returns its base URL."""
    ic, tls = cfg.inference, cfg.auth.tls
    sock = bind(ic.server.host, ic.openai_port)
    endpoint = OpenAIEndpoint(engine, recorder, token=load_token(cfg.auth), tool_format=cfg.model.tool_format,
                              runs=runs, read_timeout_s=ic.openai_read_timeout_s)
    tasks.spawn("openai-http", lambda: serve_openai(endpoint, sock, cert_file=tls.cert_file if tls.enabled else "",
                                                    key_file=tls.key_file if tls.enabled else "",
                                                    grace_s=ic.server.grace_s,
                                                    max_connections=ic.openai_max_connections,
                                                    read_timeout_s=ic.openai_read_timeout_s))
    scheme = "https" if tls.enabled else "http"
    return f"{scheme}://{host}:{sock.getsockname()[1]}/v1"


def inference_mesh(cfg: MeshConfig) -> Mesh | None:
    """The configured mesh over this process's devices; None on one device (no mesh needed)."""
    devices = jax.local_devices()
    return make_mesh(cfg, devices, path="inference.mesh") if len(devices) > 1 else None


async def run_engine(engine: Engine) -> None:
    """Ties the engine's loop thread to the service's lifetime: cancelled on shutdown, it stops."""
    engine.start()
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.to_thread(engine.close)


def main() -> None:
    cfg = parse_service_config("inference")
    setup_logging("inference")
    enable_compile_cache()  # before the first compile: a restart reads the programs back
    compiles = CompileWatch().install()
    initialize_from_env()  # multi-host (JobSet/TPU slice) before any JAX work; a no-op on one host
    tasks = TaskGroup()
    with service_tracing(cfg.tracing, service="inference", run_id=cfg.run_id) as tracing:

        async def start() -> RunningServer:
            running, _ = await start_inference(cfg, tasks, compiles, tracing)
            return running

        run_until_signal(start, on_stop=tasks.cancel_all, grace_s=cfg.inference.server.grace_s, tasks=tasks)


if __name__ == "__main__":
    main()
