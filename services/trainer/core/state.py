"""What the trainer reports (GetStatus, heartbeat); written by the core (core/trainer.py) alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the core imports no JAX: the learner's metrics are only carried
    from services.trainer.learner import StepMetrics


@dataclass(kw_only=True)
class TrainerState:
    version: int = 0
    paused: bool = False
    checkpoint_version: int = 0
    checkpoint_uri: str = ""
    consumed: int = 0
    last: StepMetrics | None = None
    until_step: int = 0
    """> 0: pause once the learner's step count reaches it."""
    last_staleness: float = 0.0
    last_staleness_max: int = 0
    """The last RL step's largest token lag: never above trainer.max_staleness (checked at the step)."""
    last_record: dict[str, Any] | None = None
    """The last applied step's diagnostics record."""
    tokens_trained: int = 0
    generated_tokens: int = 0
    """Model-generated (loss-masked) tokens of the trajectories RL steps trained on, cumulative."""
    skipped_steps: int = 0
    """Steps refused for a non-finite loss, gradient norm or parameter (nothing applied or published)."""
    failed_steps: int = 0
    """Steps that raised before their update applied; their groups were put back (core/book.py)."""
    publish_failures: int = 0
    """Publishes that raised (Redis down, ...): retried before the next step; acks wait for one."""
    pointer_conflicts: int = 0
    """Publishes refused because the pointer held a version this trainer did not write."""
    checkpoint_failures: int = 0
    """Checkpoint saves that failed (ENOSPC, EIO, ...); retried with backoff."""
    checkpoint_error: str = ""
    """The last save failure while saves keep failing; "" once one succeeds."""
    checkpoint_fallbacks: int = 0
    """Damaged checkpoints passed over at restore (an older complete one was used)."""
    held_entries: int = 0
    """Entries trained but unacknowledged, waiting for a checkpoint to cover them."""
    acked_undurable: int = 0
    """Trajectories acknowledged with no checkpoint covering them (saves failing past the hold bound)."""
    busy_s: float = 0.0
    """Wall time inside optimizer steps (SFT and RL)."""
    io_s: float = 0.0
    """Wall time in the platform around RL steps: stream reads that returned data, intake
    (decode, de-duplication), acknowledgements and publishing (serialise, store, pointer)."""
    must_restart: str = ""
    """Why the learner's state can no longer be trusted ("" while it can): the driver stops the
    process, and its restart recovers from the newest good checkpoint (core/trainer.py)."""
    refused_in_a_row: int = 0
    """Steps refused one after another since the last applied one."""
    waiting_on: str = ""
    """Why no step is being taken now ("" while steps come): the bound or counter that holds the run."""
