"""When a checkpoint is owed whether or not another step comes (services/trainer/core/holds.py).
The fault tests drive the same rule through a real trainer on a full disk; the cases here are the
orders of events those runs reach only by timing."""

from services.trainer.core.holds import checkpoint_owed


def owed(held: list[int], *, every: int = 1, undurable_through: int = 0, checkpoint_version: int = 0) -> bool:
    return checkpoint_owed(held, every=every, undurable_through=undurable_through,
                           checkpoint_version=checkpoint_version)


def test_a_held_step_whose_version_was_due_is_owed_a_save() -> None:
    # A failed save handed back versions 2-3; or a save of 3 succeeded while 4-5 waited out a backoff.
    assert owed([2, 3], checkpoint_version=1)
    assert owed([4, 5], checkpoint_version=3)
    # Between due versions nothing is owed: the next due step saves them.
    assert not owed([5, 6, 7], every=4, checkpoint_version=4)
    assert owed([5, 6, 7, 8], every=4, checkpoint_version=4)


def test_steps_acknowledged_without_a_checkpoint_are_owed_one_with_nothing_held() -> None:
    # The hold bound acknowledged every step as it published (CI: saves never resumed).
    assert owed([], undurable_through=5, checkpoint_version=1)
    assert not owed([], undurable_through=5, checkpoint_version=5)
    assert not owed([], undurable_through=0, checkpoint_version=0)


def test_without_a_save_interval_nothing_is_due_by_version() -> None:
    # checkpoint_every 0 (checkpoints off, or saved only on request): no version is ever due.
    assert not owed([1, 2, 3], every=0)
    assert owed([1, 2, 3], every=0, undurable_through=3, checkpoint_version=1)
