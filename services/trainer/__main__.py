"""`python -m services.trainer [-c CONFIG] [--port P] [--metrics-port M]`.

Several JAX processes (a JobSet across the hosts of a slice): process 0 runs the trainer as on
one host; the others only replay its JAX work (services/trainer/lockstep.py) and serve health.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading

import jax

from arlo.background import TaskGroup
from arlo.compile_cache import enable_compile_cache
from arlo.compile_watch import CompileWatch
from arlo.config import RunConfig
from arlo.config.trainer import lora_rate_warning
from arlo.coord import Heartbeat, TrajectoryStream, WeightPointer, connect
from arlo.coord.heartbeat import instance_id
from arlo.coord.lease import LeaseHeld, TrainerLease
from arlo.coord.metrics import MetricsStream
from arlo.distributed import initialize_from_env, make_mesh
from arlo.filter_replay import run_kept_width
from arlo.gc_pauses import freeze_startup
from arlo.proto.v1 import trainer_pb2, trainer_pb2_grpc
from arlo.routing_replay import routing_bytes
from arlo.rpc import (
    RunningServer,
    ServiceBinding,
    advertise_host,
    run_until_signal,
    setup_logging,
    start_server,
)
from arlo.rpc.metrics import TrainerMetrics
from arlo.service_args import parse_service_config
from arlo.tracing import Tracing, service_tracing
from services.trainer.checkpoint import Checkpointer
from services.trainer.core.trainer import CoreConfig
from services.trainer.learner import Learner
from services.trainer.lockstep import Replica, channel_for_this_process, follow
from services.trainer.loop import TrainingLoop
from services.trainer.publish import VersionStore
from services.trainer.server import TrainerServicer
from services.trainer.step_spans import StepSpans
from services.trainer.warmstart import WarmStart
from services.trainer.warmup import length_buckets, warm_up_learner, warm_up_sft

log = logging.getLogger(__name__)


async def start_trainer(cfg: RunConfig, tasks: TaskGroup, compiles: CompileWatch | None = None,
                        tracing: Tracing | None = None) -> tuple[RunningServer, TrainingLoop]:
    """`compiles`: this process's compile counter (installed before any JAX work); its figures go
    into the heartbeat, and every compile after the warm-up is logged."""
    tc = cfg.trainer
    compiles = compiles or CompileWatch().install()
    redis = await connect(cfg.redis)
    instance = instance_id()
    lease = TrainerLease(redis, cfg.run_id, ttl_s=tc.lease_ttl_s)
    await lease.acquire()  # LeaseHeld: another trainer trains this run (before minutes of model loading)
    tasks.spawn("trainer-lease", lease.keep_renewed)
    # A stable consumer name per host lets a restarted trainer pick up its own pending entries.
    stream = TrajectoryStream(redis, cfg.run_id, consumer=f"trainer-{socket.gethostname()}",
                              max_backlog=cfg.redis.max_backlog, fence=lease.fence)
    mesh = make_mesh(tc.mesh, path="trainer.mesh") if jax.device_count() > 1 else None
    source = cfg.model_source()
    learner = Learner(source, cfg=tc, mesh=mesh, sampling=cfg.rollout.sampling)
    if warning := lora_rate_warning(tc):
        log.warning(warning)

    tok = source.tokenizer()
    warm_start = (WarmStart(tc.sft, tok, max_seq_len=learner.model_cfg.max_seq_len,
                            seed=cfg.model.seed) if tc.sft.steps else None)
    core = CoreConfig(groups_per_step=tc.groups_per_step, group_size=cfg.rollout.group_size,
                      max_staleness=tc.max_staleness, vocab_size=learner.model_cfg.vocab_size,
                      filter_zero_variance=tc.algorithm.filter_zero_variance, expiring_wait_s=tc.expiring_wait_s,
                      checkpoint_every=tc.checkpoint_every, max_backlog=cfg.redis.max_backlog,
                      sft_steps=warm_start.steps if warm_start else 0, start_paused=tc.start_paused,
                      routing_bytes=routing_bytes(learner.model_cfg),
                      kept_width=run_kept_width(cfg))
    loop = TrainingLoop(
        learner=learner, stream=stream, pointer=WeightPointer(redis, cfg.run_id, fence=lease.fence),
        store=VersionStore(),
        source="", core=core, read_block_ms=tc.read_block_ms, checkpoint_dir=tc.checkpoint_dir,
        pad_id=tok.pad_id, overlong=((tc.algorithm.overlong_max_tokens, tc.algorithm.overlong_buffer_tokens)
                                     if tc.algorithm.overlong_max_tokens else None),
        channel=channel_for_this_process(), warm_start=warm_start, longest_episode=cfg.rollout.max_episode_tokens,
        weights=tc.weights, lease=lease,
    )
    loop.before_run = functools.partial(warm_up, cfg, loop, compiles)
    name = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
    running = await start_server("trainer", tc.server, cfg.auth, [
        ServiceBinding(name=name, add_to_server=trainer_pb2_grpc.add_TrainerServicer_to_server,
                       servicer=TrainerServicer(loop))], tracing=tracing)
    loop.source = f"grpc://{advertise_host(tc.server.host)}:{running.port}"
    # Every applied step's diagnostics: on the run's metrics stream (for `arlo train`, `arlo status`)
    # and as Prometheus gauges on this server's /metrics.
    prometheus = TrainerMetrics(running.registry, dropped=loop.dropped)

    async def observe(record: dict) -> None:
        prometheus.observe(record)

    loop.on_step += [MetricsStream(redis, cfg.run_id).add, observe]
    if tracing is not None:  # each RL step as a trace of its phases (services/trainer/step_spans.py)
        loop.on_step.append(StepSpans(tracing.tracer("services.trainer")).add)
    try:
        await loop.start()
    except BaseException:  # a restore refused, a fenced publish refused: no server left behind
        await running.stop(0)
        raise
    prometheus.started(version=loop.state.version, step=learner.step_count)
    heartbeat = Heartbeat(redis, cfg.run_id, service="trainer", instance=instance)
    tasks.spawn("training-loop", loop.run)
    address = f"{advertise_host(tc.server.host)}:{running.port}"
    tasks.spawn("heartbeat", lambda: heartbeat.run(2.0, lambda: heartbeat_fields(loop, tasks, compiles, address)))
    return running, loop


def heartbeat_fields(loop: TrainingLoop, tasks: TaskGroup, compiles: CompileWatch, address: str) -> dict:
    """The trainer's heartbeat (`arlo status`): where it serves, how far it is, what it survived."""
    state = loop.state
    return {
        "address": address, "version": state.version, "step": loop.learner.step_count, "consumed": state.consumed,
        "busy_s": round(state.busy_s, 3), "io_s": round(state.io_s, 3), "tokens_trained": state.tokens_trained,
        "staleness": round(state.last_staleness, 3), **loop.fault_counters(),
        "loop_restarts": sum(tasks.restarts.values()), "staleness_max": state.last_staleness_max,
        "generated_tokens": state.generated_tokens, "skipped_steps": state.skipped_steps, **compiles.metrics(),
        **{f"dropped_{reason}": n for reason, n in loop.dropped().items()}}


async def warm_up(cfg: RunConfig, loop: TrainingLoop, compiles: CompileWatch) -> None:
    """The loop's `before_run`: compiles the RL step (and the SFT warm start's, when steps of it
    remain) for every batch length a run can need, each kind when it has at most
    `trainer.warmup_programs` lengths; from then on every compile is logged as late."""
    tc, learner, warm_start = cfg.trainer, loop.learner, loop.warm_start
    rl_lengths = length_buckets(cfg.rollout.max_episode_tokens, learner.model_cfg.max_seq_len)
    sft_lengths = warm_start.batch_lengths if warm_start and learner.step_count < warm_start.steps else []
    for kind, lengths in (("RL", rl_lengths), ("SFT", sft_lengths)):
        if len(lengths) > tc.warmup_programs:
            log.warning("%s warm-up skipped: %d batch lengths %s (trainer.warmup_programs = %d); each compiles "
                        "on first use, mid-run", kind, len(lengths), lengths, tc.warmup_programs)
        elif lengths:
            async with loop.jax_lock:
                if kind == "RL":
                    await asyncio.to_thread(warm_up_learner, learner, lengths=lengths, groups=tc.groups_per_step,
                                            group_size=cfg.rollout.group_size, kept_width=loop.core.cfg.kept_width)
                else:
                    assert warm_start is not None
                    await asyncio.to_thread(warm_up_sft, learner, lengths=lengths, rows=warm_start.batch_size)
    compiles.mark_warm()
    # The warm-up runs after the server started (and froze start-up's objects): what tracing
    # and compiling left is long-lived too (arlo/gc_pauses.py).
    freeze_startup()


async def start_follower(cfg: RunConfig, stop: threading.Event, tasks: list[asyncio.Task[None]]) -> RunningServer:
    """Process k > 0 of a multi-host trainer: no Redis, no Trainer service (process 0 does the I/O);
    it replays process 0's JAX work, serves health for its probes, and ends when process 0 stops."""
    tc = cfg.trainer
    # Built in the same order as start_trainer builds them: their creation is collective work too.
    learner = Learner(cfg.model_source(), cfg=tc, mesh=make_mesh(tc.mesh, path="trainer.mesh"), sampling=cfg.rollout.sampling)
    checkpointer = Checkpointer(tc.checkpoint_dir) if tc.checkpoint_dir else None
    running = await start_server("trainer", tc.server, cfg.auth, [])
    replica = Replica(learner, checkpointer, channel_for_this_process())

    async def replay() -> None:
        try:
            await asyncio.to_thread(follow, replica, stop)
        finally:
            if checkpointer is not None:
                await asyncio.to_thread(checkpointer.close)
            await running.stop(0)  # ends run_until_signal: the pod exits with process 0

    tasks.append(asyncio.create_task(replay(), name="follow"))
    return running


def run_follower(cfg: RunConfig) -> None:
    stop = threading.Event()
    following: list[asyncio.Task[None]] = []

    async def stop_following() -> None:
        stop.set()
        await asyncio.gather(*following, return_exceptions=True)

    run_until_signal(lambda: start_follower(cfg, stop, following), on_stop=stop_following, grace_s=0.0)
    failed = [t for t in following if t.done() and not t.cancelled() and t.exception() is not None]
    if failed:
        # A follower out of step cannot recover alone: fail the pod, so the JobSet restarts the slice.
        raise SystemExit(f"trainer process {jax.process_index()}: {failed[0].exception()!r}")


def main() -> None:
    cfg = parse_service_config("trainer")
    initialize_from_env()  # multi-host (JobSet/TPU slice) before any JAX work; a no-op on one host
    setup_logging("trainer")
    enable_compile_cache()  # before the first compile: a restart reads the programs back
    if jax.process_index() > 0:
        run_follower(cfg)
        return
    compiles = CompileWatch().install()
    tasks = TaskGroup()
    loops: list[TrainingLoop] = []
    with service_tracing(cfg.tracing, service="trainer", run_id=cfg.run_id) as tracing:

        async def start() -> RunningServer:
            running, loop = await start_trainer(cfg, tasks, compiles, tracing)
            loops.append(loop)
            return running

        async def stop() -> None:
            await tasks.cancel_all()
            for loop in loops:
                await loop.close()  # a checkpoint in flight completes rather than being left partial

        try:
            run_until_signal(start, on_stop=stop, grace_s=cfg.trainer.server.grace_s, tasks=tasks)
        except LeaseHeld as e:  # a second trainer of the run: one line, not a traceback
            log.error("not starting: %s", e)
            raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
