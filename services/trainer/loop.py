"""The training loop: stream -> whole groups -> jitted step -> publish version v+1 -> ack.

Order matters for durability: a trajectory is marked trained and acknowledged only after
the step that used it has produced a published version, so a crash before that re-delivers
it (XAUTOCLAIM) and de-duplication keeps it from being trained on twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from arlo.coord import TrajectoryStream, WeightPointer
from arlo.model import get_tokenizer
from arlo.model.weights import state_to_bytes
from services.trainer.batching import GroupAssembler, ReadyGroup, build_batch, has_reward_spread
from services.trainer.checkpoint import save_checkpoint
from services.trainer.learner import Learner, StepMetrics
from services.trainer.publish import VersionStore

log = logging.getLogger(__name__)

CLAIM_EVERY_S = 10.0
CLAIM_MIN_IDLE_MS = 30_000


@dataclass(kw_only=True)
class TrainerState:
    """What GetStatus reports; mutated only by the loop."""

    version: int = 0
    paused: bool = False
    checkpoint_version: int = 0
    checkpoint_uri: str = ""
    consumed: int = 0
    zero_variance: int = 0
    last: StepMetrics | None = None


class TrainingLoop:
    def __init__(
        self, *, learner: Learner, stream: TrajectoryStream, pointer: WeightPointer, store: VersionStore,
        source: str, groups_per_step: int, max_staleness: int, read_block_ms: int,
        checkpoint_dir: str = "", checkpoint_every: int = 0, tokenizer: str = "byte",
        filter_zero_variance: bool = False, overlong: tuple[int, int] | None = None,
    ) -> None:
        self.filter_zero_variance = filter_zero_variance
        self.overlong = overlong
        self.learner = learner
        self.stream = stream
        self.pointer = pointer
        self.store = store
        self.source = source
        self.groups_per_step = groups_per_step
        self.read_block_ms = read_block_ms
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.pad_id = get_tokenizer(tokenizer).pad_id
        self.assembler = GroupAssembler(max_staleness=max_staleness)
        self.state = TrainerState()
        self._ready: list[ReadyGroup] = []
        self._jax_lock = asyncio.Lock()
        self._step_lock = asyncio.Lock()  # held from batch to publish and ack: one whole step

    async def start(self) -> None:
        """Numbers versions above the pointer, so a restarted trainer never repeats one."""
        await self.stream.ensure_group()
        current = await self.pointer.get()
        if current is not None and current.version > 0:
            # The fleet may hold another trainer's weights under that version: publish ours above it.
            self.state.version = current.version
            await self._publish()

    async def run(self) -> None:
        last_claim = 0.0
        while True:
            if self.state.paused:
                await asyncio.sleep(0.2)
                continue
            entries = await self.stream.read(count=256, block_ms=self.read_block_ms)
            if time.monotonic() - last_claim > CLAIM_EVERY_S:
                entries += await self.stream.claim_stale(CLAIM_MIN_IDLE_MS)
                last_claim = time.monotonic()
            fresh = await self.stream.filter_unseen(entries)  # acks (and counts) what it drops
            self.assembler.add((e.entry_id, e.trajectory) for e in fresh)
            ready, dropped = self.assembler.take_ready(self.state.version)
            if self.filter_zero_variance:
                flat = [g for g in ready if not has_reward_spread(g)]
                ready = [g for g in ready if has_reward_spread(g)]
                self.state.zero_variance += sum(len(g.entry_ids) for g in flat)
                dropped += [e for g in flat for e in g.entry_ids]
            self._ready.extend(ready)
            if dropped:
                # A dropped group is finished with: acknowledge it now, or it pins the backlog.
                await self.stream.ack(dropped)
            while len(self._ready) >= self.groups_per_step and not self.state.paused:
                await self.train_once()

    async def pause(self) -> None:
        """Returns once no step is in flight, so a status read after it is final."""
        self.state.paused = True
        async with self._step_lock:
            pass

    async def train_once(self) -> StepMetrics:
        async with self._step_lock:
            return await self._train_once()

    async def _train_once(self) -> StepMetrics:
        groups = self._take_batch_groups()
        batch = build_batch([g.trajectories for g in groups], self.learner.model_cfg.max_seq_len, self.pad_id,
                            overlong=self.overlong)
        async with self._jax_lock:
            metrics = await asyncio.to_thread(self.learner.step, batch)
        self.state.version += 1
        await self._publish()
        await self.stream.mark_trained(batch.trajectory_ids)
        await self.stream.ack([e for g in groups for e in g.entry_ids])
        self.state.consumed += len(batch.trajectory_ids)
        self.state.last = metrics
        log.info("step %d -> version %d: loss %.4f reward %.3f tokens %d", self.learner.step_count,
                 self.state.version, metrics.loss, metrics.reward_mean, metrics.num_tokens)
        if self.checkpoint_every and self.state.version % self.checkpoint_every == 0:
            await self.checkpoint()
        return metrics

    def _take_batch_groups(self) -> list[ReadyGroup]:
        # A batch needs one group size; groups of another size wait for their own batch.
        size = len(self._ready[0].trajectories)
        same = [g for g in self._ready if len(g.trajectories) == size][: self.groups_per_step]
        self._ready = [g for g in self._ready if not any(g is s for s in same)]
        return same

    async def _publish(self) -> None:
        async with self._jax_lock:
            data = await asyncio.to_thread(state_to_bytes, self.learner.state)
        published = self.store.put(self.state.version, data)
        await self.pointer.publish(published.version, source=self.source, sha256=published.sha256)

    async def checkpoint(self) -> tuple[int, str]:
        if not self.checkpoint_dir:
            raise ValueError("trainer.checkpoint_dir is not set; checkpoints are disabled")
        version = self.state.version
        async with self._jax_lock:
            uri = await asyncio.to_thread(
                save_checkpoint, self.checkpoint_dir, version, self.learner.state, self.learner.step_count
            )
        await self.pointer.set_checkpoint(version, uri)
        self.state.checkpoint_version, self.state.checkpoint_uri = version, uri
        return version, uri

    def dropped(self) -> dict[str, int]:
        """Trajectories not trained on, by reason."""
        drops = self.assembler.drops
        return {"stale": drops.stale, "failed": drops.failed, "malformed": drops.malformed + self.stream.malformed,
                "duplicate": self.stream.duplicates, "zero_variance": self.state.zero_variance}
