"""Weighted composites: the sum, prefixed components, metadata routing, and failing parts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from services.reward.verifiers.base import RewardFn, Verdict
from services.reward.verifiers.composite import MetadataComposite, Part, WeightedComposite
from services.reward.verifiers.exact import exact_match
from services.reward.verifiers.format import format_think
from services.reward.verifiers.math import math_equiv

GOOD = "<think>1/2 of 1</think><answer>\\frac{1}{2}</answer>"


def echo(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    return Verdict(reward=float(metadata.get("value", 0.0)), components={"seen": float(len(metadata))})


def broken(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    raise KeyError("boom")


FNS: dict[str, RewardFn] = {"math_equiv": math_equiv, "format_think": format_think, "exact_match": exact_match,
                            "echo": echo, "broken": broken}
composite = MetadataComposite(lookup=FNS.get)


def test_weighted_composite_fixed_in_code() -> None:
    fn = WeightedComposite(parts=(Part(name="math", fn=math_equiv, weight=0.9),
                                  Part(name="format", fn=format_think, weight=0.1)))
    verdict = fn(GOOD, "0.5", {})
    assert verdict.reward == pytest.approx(1.0)
    assert verdict.components == {"math": 1.0, "math.parsed": 1.0, "math.math_equiv": 1.0,
                                  "format": 1.0, "format.think": 1.0, "format.answer": 1.0}
    wrong = fn("<think>hm</think><answer>3</answer>", "0.5", {})
    assert wrong.reward == pytest.approx(0.1) and wrong.components["math"] == 0.0


def test_metadata_composite() -> None:
    metadata = {"components": [{"fn": "math_equiv", "weight": 0.9}, {"fn": "format_think", "weight": 0.1}]}
    assert composite(GOOD, "1/2", metadata).reward == pytest.approx(1.0)
    no_think = composite("\\boxed{1/2}", "1/2", metadata)
    assert no_think.reward == pytest.approx(0.95)
    assert no_think.components["format_think.think"] == 0.0 and no_think.components["math_equiv"] == 1.0


def test_metadata_is_shared_then_overridden_per_part() -> None:
    metadata = {"value": 0.5, "extra": 1, "components": [
        {"fn": "echo", "weight": 1.0, "name": "a"},
        {"fn": "echo", "weight": -2.0, "name": "b", "metadata": {"value": 0.25}},
    ]}
    verdict = composite("", "", metadata)
    assert verdict.reward == pytest.approx(0.5 - 0.5)  # negative weights are penalties
    assert verdict.components == {"a": 0.5, "a.seen": 2.0, "b": 0.25, "b.seen": 2.0}  # no "components" key


def test_a_failing_part_fails_the_item() -> None:
    with pytest.raises(RuntimeError, match="part 'broken' raised KeyError"):
        composite("", "", {"components": [{"fn": "exact_match"}, {"fn": "broken"}]})
    with pytest.raises(RuntimeError, match="part 'math_equiv' raised ValueError: reference answer"):
        composite("1", "not an answer", {"components": [{"fn": "math_equiv"}]})


@pytest.mark.parametrize(("components", "why"), [
    (None, "non-empty list"), ([], "non-empty list"), ({"fn": "echo"}, "non-empty list"),
    ([{"fn": "echo"}] * 17, "at most 16"), (["echo"], "must be an object"), ([{"weight": 1}], "fn must name"),
    ([{"fn": "nope"}], "unknown reward function 'nope'"), ([{"fn": "echo", "w": 1}], "unknown keys"),
    ([{"fn": "echo", "weight": "1"}], "finite number"), ([{"fn": "echo", "weight": float("nan")}], "finite number"),
    ([{"fn": "echo"}, {"fn": "echo"}], "distinct"), ([{"fn": "echo", "metadata": []}], "metadata must be"),
    ([{"fn": "echo", "name": ""}], "name must be"),
])
def test_bad_component_lists(components: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        composite("", "", {"components": components})


def test_metadata_composites_do_not_nest() -> None:
    fns: dict[str, RewardFn] = {}
    nested = MetadataComposite(lookup=fns.get)
    fns["composite"] = nested
    with pytest.raises(ValueError, match="do not nest"):
        nested("", "", {"components": [{"fn": "composite"}]})


def test_fixed_composites_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="1 to 16"):
        WeightedComposite(parts=())
    with pytest.raises(ValueError, match="distinct"):
        WeightedComposite(parts=(Part(name="a", fn=echo, weight=1), Part(name="a", fn=echo, weight=1)))
