"""The trainer's start-up warm-up: every RL step program a run can need, compiled before it trains.

An RL batch has a fixed number of rows (groups_per_step x group_size) and a length bucket (a
power of two, or the longest episode itself: services/trainer/batching.py), so the programs are
one per bucket up to the longest episode. Compiling one takes seconds to tens of seconds on a CPU host; compiled at first use it
stalls the step that needed it (the 5-19 s pauses seen mid-run when completions got shorter or
longer). Here each is compiled ahead of time (`jit(...).lower(...).compile()`: nothing runs, the
weights and optimizer state are untouched), with the small eager conversions a step makes on
the way, and the finiteness check and copy a publish runs. One process only: a multi-host trainer
compiles on first use (its programs are collectives all processes must enter together).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from arlo.filter_replay import NOT_KEPT
from arlo.model.weights import nonfinite_param, serving_copy
from arlo.routing_replay import expert_dtype, routing_shape
from services.trainer.batching import Batch, bucket_length
from services.trainer.learner import Learner

log = logging.getLogger(__name__)


def length_buckets(longest: int, max_seq_len: int) -> list[int]:
    """The batch lengths episodes of up to `longest` tokens can take (build_batch's buckets,
    `longest` being the rollout's max_episode_tokens)."""
    top = min(bucket_length(min(longest, max_seq_len), longest_episode=longest), max_seq_len)
    out, length = [], bucket_length(1)
    while length < top:
        out.append(length)
        length *= 2
    return [*out, top]


def warm_up_learner(learner: Learner, *, lengths: Sequence[int], groups: int, group_size: int,
                    kept_width: int = 0) -> int:
    """Compiles the RL step (and the critic's, with GAE) for batches of groups x group_size rows
    at each length; returns the number of lengths compiled (0 with several JAX processes).
    `kept_width`: the K every batch's kept sets have (filter replay; `build_batch`'s), 0: off."""
    if jax.process_count() > 1:
        return 0
    if learner.cfg.pack:  # a packed step's shape depends on how the batch packs: known with the batch only
        log.info("warm-up: trainer.pack is on, the RL step compiles on first use per (length, packed rows)")
        return 0
    started = time.perf_counter()
    rows = groups * group_size
    mini = min(learner.cfg.mini_batches, rows)
    # With routing replay every batch carries the sampler's experts (batching.py `_routing_arrays`):
    # a warm-up without them compiled a program no step uses, and each length compiled mid-run.
    routing = routing_shape(learner.model_cfg) if learner.cfg.algorithm.routing_replay else None
    # So does filter replay's kept sets, whenever it is on (batching.py `_kept_arrays`).
    for length in lengths:
        zeros = np.zeros((rows, length), np.float32)
        experts = (np.zeros((rows, length, routing[0], routing[1]), expert_dtype(routing[2]))
                   if routing is not None else None)
        batch = Batch(tokens_bt=np.zeros((rows, length), np.int32), behaviour_logprobs_bt=zeros, mask_bt=zeros,
                      rewards_gk=np.zeros((groups, group_size), np.float32), token_rewards_bt=zeros,
                      trajectory_ids=(), num_tokens=0, experts_btlk=experts,
                      replay_bt=zeros if routing is not None else None,
                      kept_btk=np.full((rows, length, kept_width), NOT_KEPT, np.int32) if kept_width else None)
        # The same conversions Learner.step makes (each compiles a small program per shape).
        rewards_gk, device_rows = learner.device_inputs(batch, mini_batches=mini)
        key = learner._replicated(jax.random.key_data(jax.random.key(learner.step_count)))
        rewards = learner._replicated(rewards_gk)
        if learner.critic is not None:  # not donating: safe to run on the zeros
            device_rows, _ = learner._prepare_gae(learner.critic, learner.state, learner.ref_state, device_rows)
            learner._critic_step.lower(learner.critic, learner.critic_opt_state, device_rows, rewards, key,
                                       mini).compile()
        learner._rl_step.lower(learner.state, learner.opt_state, learner.ref_state, device_rows, rewards, key,
                               mini, **learner.step_kwargs).compile()
    nonfinite_param(learner.state, learner.param_dtype)  # every inline publish checks the weights it sends
    serving_copy(learner.state, learner.param_dtype)  # an overlapped one copies them (and checks) in one call
    log.info("warm-up: RL step compiled for lengths %s in %.1fs", list(lengths), time.perf_counter() - started,
             extra={"programs": len(lengths)})
    return len(lengths)


def warm_up_sft(learner: Learner, *, lengths: Sequence[int], rows: int) -> int:
    """Compiles the SFT warm start's step for batches of `rows` at each length (the warm start's
    `batch_lengths`); returns the number compiled (0 with several JAX processes). Its optimizer
    state is made here, as the first SFT step would make it."""
    if jax.process_count() > 1:
        return 0
    started = time.perf_counter()
    if learner.sft_opt_state is None:
        learner.sft_opt_state = learner._sft_tx.init(learner.state)
    for length in lengths:
        device_rows = learner._on_device({"tokens_bt": np.zeros((rows, length), np.int32),
                                          "mask_bt": np.zeros((rows, length), np.float32)})
        learner._sft_step.lower(learner.state, learner.sft_opt_state, device_rows, **learner.step_kwargs).compile()
    log.info("warm-up: SFT step compiled for lengths %s in %.1fs", list(lengths), time.perf_counter() - started,
             extra={"programs": len(lengths)})
    return len(lengths)
