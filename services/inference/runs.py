"""Several runs on one inference service (`inference.runs`): which adapter slot each run's
requests use, and a view of one slot that a run's WeightSync keeps current.

Slot 0 is the config's own `run_id`; `inference.runs` take slots 1.. in order. Each run has its
own weight pointer, and so its own WeightSync, writing only its own slot: a run's publish never
pauses or changes another's generation (services/inference/policy.py).
"""

from __future__ import annotations

from typing import Any

from arlo.config import RunConfig
from services.inference.engine import Engine


def run_slots(cfg: RunConfig) -> dict[str, int]:
    """run_id -> adapter slot, the config's own run first."""
    return {run: slot for slot, run in enumerate((cfg.run_id, *cfg.inference.runs))}


class EngineSlot:
    """One adapter slot of an engine, as a WeightSync sees what it serves (its `Servable`)."""

    def __init__(self, engine: Engine, slot: int) -> None:
        self.engine, self.slot = engine, slot

    @property
    def version(self) -> int:
        return self.engine.versions[self.slot]

    @property
    def published_state(self) -> Any:
        return self.engine.published_state_of(self.slot)

    @property
    def published_scope(self) -> str:
        return self.engine.published_scope

    def swap(self, state: Any, version: int) -> None:
        self.engine.swap(state, version, adapter=self.slot)
