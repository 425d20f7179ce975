"""Weighted sums of verifiers, e.g. 0.9 * math_equiv + 0.1 * format_think.

The reward is sum(weight * part reward) (weights are not normalised, so a negative weight is
a penalty). Each part reports its reward as component `<name>` and its own components as
`<name>.<component>`. A part that raises makes the whole item an ERROR: a composite never
turns a broken part into a 0.

Two ways to build one: `WeightedComposite` with parts fixed in code (registered under its
own name), or the `composite` verifier, whose parts come from request metadata:
`{"components": [{"fn": "math_equiv", "weight": 0.9, "metadata": {...}, "name": "math"}, ...]}`.
Every other top-level metadata key is passed to every part, under the part's own `metadata`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.reward.verifiers.base import RewardFn, Verdict

MAX_PARTS = 16
_PART_KEYS = frozenset({"fn", "weight", "metadata", "name"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    name: str
    """Prefix of this part's components."""
    fn: RewardFn
    weight: float
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Overrides the request's metadata for this part."""


def combine(parts: Sequence[Part], response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    reward, components = 0.0, {}
    for part in parts:
        try:
            verdict = part.fn(response, reference, {**metadata, **part.metadata})
        except Exception as e:
            raise RuntimeError(f"part {part.name!r} raised {type(e).__name__}: {e}") from e
        if not isinstance(verdict, Verdict):
            raise TypeError(f"part {part.name!r} returned {type(verdict).__name__}, expected Verdict")
        reward += part.weight * verdict.reward
        components[part.name] = verdict.reward
        components.update({f"{part.name}.{k}": v for k, v in verdict.components.items()})
    return Verdict(reward=reward, components=components)


def _check_parts(parts: Sequence[Part]) -> None:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a composite needs 1 to {MAX_PARTS} parts, got {len(parts)}")
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"composite part names must be distinct (give repeated fns a 'name'): {names}")
    for p in parts:
        if isinstance(p.weight, bool) or not isinstance(p.weight, int | float) or not math.isfinite(p.weight):
            raise ValueError(f"part {p.name!r} weight must be a finite number, got {p.weight!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightedComposite:
    """A composite fixed in code; register it under its own name."""

    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        _check_parts(self.parts)

    def __call__(self, response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        return combine(self.parts, response, reference, metadata)


def _part(i: int, entry: Any, lookup: Callable[[str], RewardFn | None]) -> Part:
    where = f"metadata components[{i}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be an object with 'fn' and 'weight'")
    unknown = set(entry) - _PART_KEYS
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_PART_KEYS)}")
    name, weight, meta = entry.get("fn"), entry.get("weight", 1.0), entry.get("metadata", {})
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.fn must name a registered reward function")
    fn = lookup(name)
    if fn is None:
        raise ValueError(f"{where}.fn: unknown reward function {name!r}")
    if isinstance(fn, MetadataComposite):
        raise ValueError(f"{where}.fn: {name!r} is itself metadata-driven; composites do not nest that way")
    if not isinstance(meta, Mapping):
        raise ValueError(f"{where}.metadata must be an object")
    label = entry.get("name", name)
    if not isinstance(label, str) or not label:
        raise ValueError(f"{where}.name must be a non-empty string")
    return Part(name=label, fn=fn, weight=weight, metadata=meta)


@dataclass(frozen=True, kw_only=True, slots=True)
class MetadataComposite:
    """The `composite` verifier: parts named in each request's metadata, looked up by name."""

    lookup: Callable[[str], RewardFn | None]

    def __call__(self, response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
        entries = metadata.get("components")
        if not isinstance(entries, list) or not entries:
            raise ValueError("metadata components must be a non-empty list of {fn, weight} objects")
        if len(entries) > MAX_PARTS:
            raise ValueError(f"metadata components has {len(entries)} entries; at most {MAX_PARTS}")
        parts = [_part(i, entry, self.lookup) for i, entry in enumerate(entries)]
        _check_parts(parts)
        shared = {k: v for k, v in metadata.items() if k != "components"}
        return combine(parts, response, reference, shared)
