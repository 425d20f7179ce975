"""A step's tail deferred beside the next step (services/trainer/tail.py) keeps its failure for
the loop to raise; a MustRestart there (a fenced publish or acknowledgement refused: the run was
taken over) is kept too, and first, instead of dying unread in its task while training goes on."""

from __future__ import annotations

import asyncio

from arlo.coord.lease import LeaseLost
from services.trainer.tail import StepTails


async def test_a_tail_that_must_restart_is_kept_for_the_loop_and_wins_over_an_error() -> None:
    tails, ran, spent = StepTails(), [], []

    async def failing() -> None:
        ran.append("error")
        raise RuntimeError("redis blip")

    async def fenced() -> None:
        ran.append("fenced")
        raise LeaseLost("acknowledging 8 entries refused: another trainer holds the run")

    async def after() -> None:
        ran.append("after")

    for tail in (failing(), fenced(), after()):
        tails.defer(tail, on_done=spent.append)
    await tails.settle()
    assert ran == ["error", "fenced", "after"] and len(spent) == 3
    assert isinstance(tails.take_error(), LeaseLost)  # the run's end, not the first error's restart
    assert tails.take_error() is None
    await asyncio.sleep(0)
