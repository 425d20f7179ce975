"""Reward functions by name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.reward.verifiers.base import RewardFn
from services.reward.verifiers.exact import exact_match


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardSpec:
    name: str
    fn: RewardFn
    description: str


class RewardRegistry:
    def __init__(self, specs: Iterable[RewardSpec] = ()) -> None:
        self._specs: dict[str, RewardSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: RewardSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"reward function {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def get(self, name: str) -> RewardSpec | None:
        return self._specs.get(name)

    def specs(self) -> list[RewardSpec]:
        return sorted(self._specs.values(), key=lambda s: s.name)

    def names(self) -> list[str]:
        return sorted(self._specs)


def default_registry() -> RewardRegistry:
    return RewardRegistry([
        RewardSpec(name="exact_match", fn=exact_match,
                   description="1.0 when response equals reference after stripping and collapsing whitespace, "
                               "else 0.0; component 'exact_match'."),
    ])
