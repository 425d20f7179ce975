"""Which task a group runs: an environment of `rollout.envs` drawn by weight, and a seed for it,
from the durable task cursor (datasets: every task once per epoch, across restarts) or drawn at
random (generated environments, whose seeds are all distinct tasks anyway)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from arlo.config import RolloutConfig, RolloutEnvConfig
from arlo.coord.tasks import TaskCursor

DATASET_ENV = "dataset"


def uses_cursor(entry: RolloutEnvConfig) -> bool:
    return entry.seeds == "cursor" or (entry.seeds == "auto" and entry.name == DATASET_ENV)


@dataclass(frozen=True, slots=True)
class Pick:
    env: RolloutEnvConfig
    seed: int
    cursor: TaskCursor | None = None


class TaskPicker:
    def __init__(self, envs: Sequence[RolloutEnvConfig], rng: random.Random,
                 cursors: dict[str, TaskCursor] | None = None) -> None:
        if not envs:
            raise ValueError("a task mixture needs at least one environment")
        self.envs = tuple(envs)
        self._weights = [e.weight for e in self.envs]
        self._rng = rng
        self._cursors = cursors or {}

    def draw_env(self) -> RolloutEnvConfig:
        """An entry of the mixture, by weight (`next(env)` then draws its seed)."""
        return self._rng.choices(self.envs, self._weights)[0] if len(self.envs) > 1 else self.envs[0]

    def leases_seeds(self, env: RolloutEnvConfig) -> bool:
        """`env`'s seeds come from the durable cursor, on a lease (`task_lease_s`) that runs from `next`."""
        return env.key in self._cursors

    async def next(self, env: RolloutEnvConfig | None = None) -> Pick:
        env = env if env is not None else self.draw_env()
        cursor = self._cursors.get(env.key)
        seed = await cursor.next() if cursor is not None else self._rng.randrange(2**31)
        return Pick(env=env, seed=seed, cursor=cursor)

    async def done(self, pick: Pick) -> None:
        """The group of `pick` is written: its seed is not handed out again."""
        if pick.cursor is not None:
            await pick.cursor.done(pick.seed)


def durable_picker(cfg: RolloutConfig, redis: Redis, run_id: str, rng: random.Random) -> TaskPicker:
    """The run's mixture, with a Redis cursor for each entry that draws seeds from one."""
    cursors = {e.key: TaskCursor(redis, run_id, e.key, lease_s=cfg.task_lease_s)
               for e in cfg.mixture if uses_cursor(e)}
    return TaskPicker(cfg.mixture, rng, cursors)
