"""Environments by name: how to make one, and what ListEnvironments says about it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.env_gateway.envs import arith
from services.env_gateway.envs.base import Environment


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvSpec:
    name: str
    description: str
    factory: Callable[[], Environment]
    """A fresh instance per session."""
    tools_json: str = "[]"
    max_turns: int = 1
    """Upper bound on turns any config of this environment allows."""


class EnvRegistry:
    def __init__(self, specs: Iterable[EnvSpec] = ()) -> None:
        self._specs: dict[str, EnvSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: EnvSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"environment {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def get(self, name: str) -> EnvSpec | None:
        return self._specs.get(name)

    def specs(self) -> list[EnvSpec]:
        return sorted(self._specs.values(), key=lambda s: s.name)

    def names(self) -> list[str]:
        return sorted(self._specs)


def default_registry() -> EnvRegistry:
    return EnvRegistry([
        EnvSpec(name=arith.NAME, description=arith.DESCRIPTION, factory=arith.ArithEnv, max_turns=arith.MAX_TURNS),
    ])
