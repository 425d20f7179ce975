"""`python -m services.rollout [-c CONFIG] [--port P] [--metrics-port M]`.

Serves only health, reflection and metrics on its port (for probes); the work is the loop.
"""

from __future__ import annotations

import dataclasses
import random

import grpc

from arlo.background import TaskGroup
from arlo.config import RunConfig
from arlo.coord import Heartbeat, RolloutStatus, TrajectoryStream, connect
from arlo.coord.evals import EvalQueue
from arlo.coord.heartbeat import instance_id
from arlo.filter_replay import run_kept_width
from arlo.model.tokenizer import get_tokenizer, tokenizer_name
from arlo.rpc import RunningServer, load_token, make_channel, run_until_signal, setup_logging, start_server
from arlo.rpc.metrics import rollout_collector
from arlo.rpc.replicas import ReplicaSet
from arlo.service_args import parse_service_config
from arlo.tracing import Tracing, service_tracing
from services.rollout.admission import AdmissionGate
from services.rollout.blackbox import BlackBoxRunner, load_agent
from services.rollout.clients import InferenceClient, RewardClient
from services.rollout.env_affinity import AffinityEnvironmentClient
from services.rollout.evaluation import Evaluator, serve_evaluations
from services.rollout.mixture import durable_picker
from services.rollout.prefetch import MAX_AGE_S
from services.rollout.recorded import GrpcRecordings
from services.rollout.worker import RolloutWorker


async def start_rollout(cfg: RunConfig, tasks: TaskGroup,
                        tracing: Tracing | None = None) -> tuple[RunningServer, AffinityEnvironmentClient]:
    """`tracing`: each episode is a span, the parent of its RPCs' spans in every service it calls.
    Returns the server and the env client, to close once the tasks are cancelled (it sends the
    session closes their episodes handed it on the way out)."""
    rc = cfg.rollout
    token = load_token(cfg.auth)
    tracer = tracing.tracer("services.rollout") if tracing is not None else None

    def channel(address: str) -> grpc.aio.Channel:
        return make_channel(address, token=token, tls=cfg.auth.tls, tracing=tracing)

    channels = {"reward": channel(cfg.reward.server.address)}
    # One inference replica per episode, so its KV prefix is reused across turns.
    inference = ReplicaSet(cfg.inference.server.address, channel, service="inference")
    # The tokenizer only: resolving the whole model source would import JAX (seconds at start).
    tok = get_tokenizer(tokenizer_name(path=cfg.model.path, tokenizer=cfg.model.tokenizer))
    redis = await connect(cfg.redis)
    stream = TrajectoryStream(redis, cfg.run_id, consumer="rollout", max_backlog=cfg.redis.max_backlog)
    await stream.ensure_group()
    instance = instance_id()
    gen = InferenceClient(inference, rc.sampling, stop_token_ids=tok.stop_token_ids, timeout_s=rc.rpc_timeout_s,
                          batch_window_s=rc.batch_window_s, tracer=tracer, run_id=cfg.run_id,
                          return_routing=cfg.trainer.algorithm.routing_replay, return_kept=run_kept_width(cfg) > 0)
    # Admission counts the version inference serves, so no episode starts on weights older than the rule assumes.
    gate = AdmissionGate(redis, cfg.run_id, instance=instance, max_staleness=cfg.trainer.max_staleness,
                         batch_size=cfg.trainer.groups_per_step * rc.group_size, poll_s=rc.admission_poll_s,
                         served_version=gen.served_version, backlog=stream.backlog)
    # One gateway replica per episode: sessions live in the memory of the replica that made them.
    env = AffinityEnvironmentClient(cfg.env_gateway.server.address, channel, timeout_s=rc.rpc_timeout_s, tracer=tracer)
    worker = RolloutWorker(
        rc, run_id=cfg.run_id, tokenizer=tok, gate=gate,
        filter_zero_variance=cfg.trainer.algorithm.filter_zero_variance, gen=gen, env=env,
        scorer=RewardClient(channels["reward"], timeout_s=rc.rpc_timeout_s, batch_window_s=rc.batch_window_s,
                            tracer=tracer),
        stream=stream,
        tasks=durable_picker(rc, redis, cfg.run_id, random.Random()),
        # A prefetched Reset is redone past half the gateway's session idle timeout (at most 60 s).
        prefetch_max_age_s=min(MAX_AGE_S, cfg.env_gateway.session_idle_timeout_s / 2),
        **({"episode_fn": BlackBoxRunner(agent=load_agent(rc.agent), token=token, timeout_s=rc.episode_timeout_s,
                                         client_timeout_s=rc.rpc_timeout_s,
                                         recordings=GrpcRecordings(inference, timeout_s=rc.rpc_timeout_s,
                                                                   routing=cfg.trainer.algorithm.routing_replay))}
           if rc.agent else {}),
        tracer=tracer, max_prompt_tokens=cfg.inference.max_prompt_tokens,
    )
    greedy = InferenceClient(inference, dataclasses.replace(rc.sampling, temperature=0.0),
                             stop_token_ids=tok.stop_token_ids, timeout_s=rc.rpc_timeout_s,
                             batch_window_s=rc.batch_window_s, tracer=tracer, run_id=cfg.run_id)
    evaluator = Evaluator(rc, run_id=cfg.run_id, greedy=greedy, sampled=worker.gen, run_episode=worker.episode)

    running = await start_server("rollout", rc.server, cfg.auth, [], tracing=tracing)
    running.registry.register(rollout_collector(worker.stats.snapshot))
    heartbeat = Heartbeat(redis, cfg.run_id, service=RolloutStatus.SERVICE, instance=instance)
    tasks.spawn("rollout", worker.run)
    tasks.spawn("evaluations", lambda: serve_evaluations(EvalQueue(redis, cfg.run_id, consumer=instance),
                                                         evaluator, greedy.served_version))
    tasks.spawn("heartbeat", lambda: heartbeat.run(2.0, lambda: RolloutStatus(
        groups=worker.stats.groups, episodes=worker.stats.episodes, retries=worker.stats.retries,
        failed_groups=worker.stats.failed_groups, running=gate.running, admission_waits=gate.waits,
        refused=worker.stats.refused, last_failure=worker.stats.last_failure).fields()))
    return running, env


def main() -> None:
    cfg = parse_service_config("rollout")
    setup_logging("rollout")
    tasks = TaskGroup()
    with service_tracing(cfg.tracing, service="rollout", run_id=cfg.run_id) as tracing:

        envs: list[AffinityEnvironmentClient] = []

        async def start() -> RunningServer:
            running, env = await start_rollout(cfg, tasks, tracing)
            envs.append(env)
            return running

        async def stop() -> None:
            await tasks.cancel_all()  # the episodes end, handing their sessions' closes to the env client
            for env in envs:
                await env.aclose()

        run_until_signal(start, on_stop=stop, grace_s=cfg.rollout.server.grace_s)


if __name__ == "__main__":
    main()
