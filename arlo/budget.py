"""Cutting a sequence into runs under a size budget: export shards, GenerateBatch messages."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def runs_under(items: Iterable[T], size_of: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """`items` in order, cut into runs whose sizes add up to at most `budget`; an item larger than
    the budget makes a run of its own. Nothing is dropped or reordered."""
    run: list[T] = []
    size = 0
    for item in items:
        n = size_of(item)
        if run and size + n > budget:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run
