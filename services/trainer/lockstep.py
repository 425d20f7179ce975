"""Multi-host training: process 0 does all the I/O, every process runs the same JAX work in lockstep.

With several JAX processes (a JobSet across the hosts of a TPU slice) the parameters are
global arrays: every jitted step, every gather and every Orbax save or restore is a
collective that all processes must enter, in the same order. Only process 0 (the leader)
reads the trajectory stream, acknowledges, serves PullWeights and moves the weight pointer;
before each piece of collective work it announces it on the JAX coordinator's key-value
store, and the other processes (followers, `follow`) replay the announcements in order.

Why the key-value store for the announcements and not a device collective: a follower may
wait minutes for the next batch (the leader waits for trajectories), and a collective left
pending that long trips timeouts; a key-value wait is polled, costs nothing and can stop.
The batch itself is broadcast over the devices (`broadcast_one_to_all`): it can be tens of MB.

On one process `SINGLE` announces nothing and `Replica` calls the learner and checkpointer
directly, so one host runs exactly the code it ran before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import jax
import numpy as np

from arlo.model.weights import NonFiniteWeights, ServingCopy, serving_copy
from services.trainer.batching import Batch
from services.trainer.checkpoint import Checkpointer, CheckpointMeta, Restored, SaveArrays, host_copy
from services.trainer.core.lineage import foreign_checkpoint
from services.trainer.gather import state_bytes
from services.trainer.learner import Learner, StepMetrics
from services.trainer.sft import SFTBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecordedCheckpoint:
    """The run's checkpoint as the weight pointer records it: its version and recorder's token."""

    version: int = 0
    writer: str = ""

    def foreign(self, meta: CheckpointMeta) -> str | None:
        return foreign_checkpoint(version=meta.version, writers=meta.writers, recorded_version=self.version,
                                  recorded_writer=self.writer)


NOTHING_RECORDED = RecordedCheckpoint()


KEY_PREFIX = "arlo/trainer/op/"
POLL_MS = 1000
"""A follower's wait for the next announcement is cut into polls this long, so it can stop."""
KEEP_KEYS = 8
"""Announcements kept on the coordinator; older ones are deleted (see CoordinatorChannel)."""
BATCH_FIELDS = ("tokens_bt", "behaviour_logprobs_bt", "mask_bt", "rewards_gk", "token_rewards_bt")
OPTIONAL_BATCH_FIELDS = ("experts_btlk", "replay_bt", "kept_btk")
"""A Batch's records (routing replay, filter replay): sent when the leader's batch has them, so
every process compiles and runs the same step."""
SFT_BATCH_FIELDS = ("tokens_bt", "mask_bt")
AnyBatch = TypeVar("AnyBatch", Batch, SFTBatch)


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    seq: int
    name: str
    header: dict[str, Any]


class Channel(Protocol):
    """How the leader tells the followers what collective work comes next."""

    @property
    def is_leader(self) -> bool: ...

    def announce(self, name: str, header: dict[str, Any]) -> None: ...

    def receive(self, stop: threading.Event) -> Op | None: ...


class SingleProcess:
    """One process: nobody to tell."""

    is_leader = True

    def announce(self, name: str, header: dict[str, Any]) -> None:
        pass

    def receive(self, stop: threading.Event) -> Op | None:
        raise RuntimeError("a single process has no leader to follow")


SINGLE = SingleProcess()


def _kv_client() -> Any:
    # Not public API, but the one Orbax's multi-host barriers use too: the coordinator's client.
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: call arlo.distributed.initialize_from_env() first")
    return client


class CoordinatorChannel:
    """Announcements as numbered keys on the JAX coordinator's key-value store.

    Key n is deleted when n + KEEP_KEYS is announced. Almost every op is a collective, so when
    the leader has finished it every follower has read its key; a restore that finds no
    checkpoint is not (nothing to read), and the window covers such a follower still behind.
    """

    def __init__(self, client: Any | None = None) -> None:
        self._client = client if client is not None else _kv_client()
        self._seq = 0

    @property
    def is_leader(self) -> bool:
        return jax.process_index() == 0

    def announce(self, name: str, header: dict[str, Any]) -> None:
        assert self.is_leader, "only process 0 announces"
        if self._seq >= KEEP_KEYS:
            self._client.key_value_delete(f"{KEY_PREFIX}{self._seq + 1 - KEEP_KEYS}")
        self._seq += 1
        self._client.key_value_set(f"{KEY_PREFIX}{self._seq}", json.dumps({"name": name, "header": header}))

    def receive(self, stop: threading.Event) -> Op | None:
        """The next announcement, or None once `stop` is set."""
        key = f"{KEY_PREFIX}{self._seq + 1}"
        while not stop.is_set():
            try:
                raw = self._client.blocking_key_value_get(key, POLL_MS)
            except Exception as e:  # jaxlib raises XlaRuntimeError(DEADLINE_EXCEEDED) on a quiet poll
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise
            self._seq += 1
            op = json.loads(raw)
            return Op(seq=self._seq, name=op["name"], header=op["header"])
        return None


def channel_for_this_process() -> Channel:
    return SINGLE if jax.process_count() == 1 else CoordinatorChannel()


class Replica:
    """The JAX work of one trainer process. The leader's calls announce themselves first, so the
    followers (`follow`) make the same calls in the same order; on one process they are plain calls."""

    def __init__(self, learner: Learner, checkpointer: Checkpointer | None, channel: Channel = SINGLE) -> None:
        self.learner = learner
        self.checkpointer = checkpointer
        self.channel = channel

    def step(self, batch: Batch) -> StepMetrics:
        fields = step_fields(batch)
        self.channel.announce("step", _batch_header(batch, fields))
        return self.learner.step(_broadcast_batch(batch, fields))

    def sft_step(self, batch: SFTBatch) -> StepMetrics:
        self.channel.announce("sft_step", _batch_header(batch, SFT_BATCH_FIELDS))
        return self.learner.sft_step(_broadcast_batch(batch, SFT_BATCH_FIELDS))

    def state_bytes(self) -> bytes:
        self.channel.announce("publish", {})
        return state_bytes(self.learner.state, self.learner.param_dtype)

    def serving_copy(self) -> ServingCopy | None:
        """The weights to publish, copied on the device (raises NonFiniteWeights), so the publish
        can serialise them beside the next step. None with several processes: there the gather
        that a publish is must run in step order (`state_bytes`)."""
        if self.channel is not SINGLE:
            return None
        return serving_copy(self.learner.state, self.learner.param_dtype)

    def set_reference(self) -> None:
        self.channel.announce("set_reference", {})
        self.learner.set_reference()

    def start_save(self, meta: CheckpointMeta) -> None:
        self.channel.announce("save", dataclasses.asdict(meta))
        assert self.checkpointer is not None
        save_learner(self.checkpointer, self.learner, meta)

    def save_snapshot(self) -> SaveArrays | None:
        """Host copies of what a checkpoint saves (under the step lock), so the save itself
        (`save_from`) can run beside the next step, which donates the originals. None with
        several processes: there a save is a collective, made in step order (`start_save`)."""
        if self.channel is not SINGLE:
            return None
        return host_copy(learner_arrays(self.learner))

    def save_from(self, arrays: SaveArrays, meta: CheckpointMeta) -> None:
        """Starts a save of a `save_snapshot`; needs no lock (nothing of the learner is read)."""
        assert self.checkpointer is not None
        self.checkpointer.start_save(arrays.params, arrays.opt_state, meta, critic=arrays.critic)

    def restore_newest(self, recorded: RecordedCheckpoint = NOTHING_RECORDED) -> Restored | None:
        """Loads the newest intact checkpoint of the run into the learner; returns it (None: there
        is none). `recorded`: the weight pointer's record, which tells the run's checkpoints from
        another trainer's (core/lineage.py); every process applies the same rule to it."""
        self.channel.announce("restore", dataclasses.asdict(recorded))
        assert self.checkpointer is not None
        return restore_learner(self.checkpointer, self.learner, recorded)

    def stop(self) -> None:
        """Releases the followers (they finish their checkpoint writes and return)."""
        self.channel.announce("stop", {})


def learner_arrays(learner: Learner) -> SaveArrays:
    """Everything the learner trains: policy, optimizer state and critic (if any)."""
    return SaveArrays(params=learner.state, opt_state=learner.opt_state, critic=learner.critic_checkpoint())


def save_learner(checkpointer: Checkpointer, learner: Learner, meta: CheckpointMeta) -> None:
    """Starts a save of everything the learner trains (`learner_arrays`)."""
    arrays = learner_arrays(learner)
    checkpointer.start_save(arrays.params, arrays.opt_state, meta, critic=arrays.critic)


def restore_learner(checkpointer: Checkpointer, learner: Learner,
                    recorded: RecordedCheckpoint = NOTHING_RECORDED) -> Restored | None:
    """Loads the newest intact checkpoint of the run into the learner (critic included); None:
    there is none. Checkpoints above `recorded` that are not the run's are set aside."""
    restored = checkpointer.restore_newest(learner.state, learner.opt_state, learner.critic_checkpoint(),
                                           foreign=recorded.foreign)
    if restored is not None:
        learner.restore(restored.params, restored.opt_state, restored.meta.step, critic=restored.critic)
    return restored


def step_fields(batch: Batch) -> tuple[str, ...]:
    """The arrays of an RL step's batch every process needs: BATCH_FIELDS and the records it has."""
    return BATCH_FIELDS + tuple(k for k in OPTIONAL_BATCH_FIELDS if getattr(batch, k) is not None)


def _batch_header(batch: Batch | SFTBatch, fields: tuple[str, ...]) -> dict[str, Any]:
    return {k: [list(getattr(batch, k).shape), str(getattr(batch, k).dtype)] for k in fields} | {
        "num_tokens": batch.num_tokens}


def _broadcast_batch(batch: AnyBatch, fields: tuple[str, ...]) -> AnyBatch:
    """Process 0's batch, on every process (the others pass a placeholder of the same shapes)."""
    if jax.process_count() == 1:
        return batch
    from jax.experimental import multihost_utils

    arrays = multihost_utils.broadcast_one_to_all({k: getattr(batch, k) for k in fields})
    return dataclasses.replace(batch, **{k: np.asarray(v) for k, v in arrays.items()})


def _placeholder_arrays(header: dict[str, Any], fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {k: np.zeros(tuple(header[k][0]), np.dtype(header[k][1])) for k in fields}


def _placeholder(header: dict[str, Any]) -> Batch:
    fields = BATCH_FIELDS + tuple(k for k in OPTIONAL_BATCH_FIELDS if k in header)
    return Batch(**_placeholder_arrays(header, fields), trajectory_ids=(), num_tokens=int(header["num_tokens"]))


def _sft_placeholder(header: dict[str, Any]) -> SFTBatch:
    return SFTBatch(**_placeholder_arrays(header, SFT_BATCH_FIELDS), num_tokens=int(header["num_tokens"]))


def follow(replica: Replica, stop: threading.Event | None = None) -> int:
    """A follower's whole job: replays the leader's announcements until "stop"; returns the ops done.

    A checkpoint write is waited for in a thread, as the leader does, so steps go on meanwhile.
    """
    stop = stop or threading.Event()
    learner, ckpt = replica.learner, replica.checkpointer
    waiter: threading.Thread | None = None
    done = 0
    while (op := replica.channel.receive(stop)) is not None:
        if op.name in ("save", "restore", "stop") and waiter is not None:
            waiter.join()  # the leader, too, waits for the previous save first
            waiter = None
        if op.name == "step":
            batch = _placeholder(op.header)
            learner.step(_broadcast_batch(batch, step_fields(batch)))
        elif op.name == "sft_step":
            learner.sft_step(_broadcast_batch(_sft_placeholder(op.header), SFT_BATCH_FIELDS))
        elif op.name == "publish":
            try:
                state_bytes(learner.state, learner.param_dtype)
            except NonFiniteWeights:
                pass  # the leader refuses that publish too (same global check) and goes on
        elif op.name == "set_reference":
            learner.set_reference()
        elif op.name == "save":
            assert ckpt is not None, "the leader checkpoints, so every process needs trainer.checkpoint_dir"
            meta = CheckpointMeta(**{**op.header, "trajectory_ids": tuple(op.header["trajectory_ids"]),
                                     "writers": tuple(op.header["writers"])})
            save_learner(ckpt, learner, meta)
            waiter = threading.Thread(target=ckpt.wait, name=f"checkpoint-{meta.version}", daemon=True)
            waiter.start()
        elif op.name == "restore":
            assert ckpt is not None
            restore_learner(ckpt, learner, RecordedCheckpoint(**op.header))
        elif op.name == "stop":
            log.info("leader stopped after %d ops", done)
            return done
        else:
            raise RuntimeError(f"unknown lockstep op {op.name!r} (leader and follower run different code?)")
        done += 1
    if waiter is not None:
        waiter.join()
    return done
