"""Version numbers and what they mean for staleness: one lineage of weights, numbered so that no
number is ever published twice, and judged by how far behind the trained weights a sample is.

Three rules live here:
- **Numbering above the pointer.** A trainer starting (or meeting a pointer it did not write)
  publishes above every version the fleet may hold, so a replica never serves two weights under
  one number. A restored trainer's weights are its checkpoint's version L, but they are published
  as N > L when the dead trainer had published up to N - 1.
- **Staleness in lineage terms.** Samples the restored weights lack are re-delivered (the stream
  holds them until a checkpoint covers them); they were sampled at versions up to N - 1 of the
  old numbering. A token of version v <= L is `version - v - (N - L)` behind the weights being
  trained, not `version - v`; a token sampled on the dead trainer's versions L+1..N-1 (weights
  this lineage never had) counts as sampled on N. Without this a restart dropped as stale exactly
  the data the restored weights had not learned from (issue 33, item 14).
- **The warm start is a boundary.** Groups sampled before the SFT warm start's version was
  published are never trained after it: they come from the policy before SFT, and their
  importance ratios against the warm-started policy are meaningless (issue 32, item 2).
- **Whose checkpoint is the run's.** Every trainer holding the run's lease has a token; a
  checkpoint names the tokens of the trainers whose training it holds (`writers`), and the weight
  pointer names the token that recorded the run's checkpoint. A checkpoint on disk newer than the
  recorded one is this run's when the recorder is among its writers (a save whose record failed,
  a Redis restored from an older snapshot); otherwise it was written by a trainer that had lost the
  run (its save landed after it was fenced out and killed) and restoring it would make a second
  lineage: it is set aside (issue 33, item 9).
"""

from __future__ import annotations

from dataclasses import dataclass

WRITERS_KEPT = 64
"""Tokens a checkpoint keeps of the trainers before it (the newest); one per restart of the run."""

MAX_VERSION = 2**53 - 2
"""The highest version a pointer may hold: above 2^53 versions lose precision in JSON readers and
in float arithmetic, and near 2^63 they overflow the int64 fields of the contract (issue 33,
item 10). A pointer beyond it is refused, not followed."""


class VersionOutOfRange(ValueError):
    """A version outside [0, MAX_VERSION] (a corrupted or hostile pointer)."""


def check_version(version: int, where: str) -> int:
    if not 0 <= version <= MAX_VERSION:
        raise VersionOutOfRange(f"{where} holds version {version}, outside [0, {MAX_VERSION}]; an operator "
                                "must repair the weight pointer (arlo status shows it)")
    return version


@dataclass(frozen=True, kw_only=True, slots=True)
class Renumbering:
    """Restored weights of lineage version `restored` published as `published` (> restored)."""

    restored: int
    published: int

    def effective(self, version: int) -> int:
        """A sample's version on the restored lineage's numbering."""
        if version < 0 or version >= self.published:
            return version
        if version <= self.restored:
            return version + self.published - self.restored
        return self.published  # sampled on weights this lineage never had: as new as the restore


@dataclass(kw_only=True)
class Lineage:
    """Which samples a step at the current version may train on."""

    max_staleness: int
    renumbering: Renumbering | None = None
    boundary: int = 0
    """Samples of versions below it were drawn before the warm start: never trained."""

    def start(self, *, restored: int, pointer: int, on_disk: int) -> int:
        """The version to publish at start (0: none to publish, nothing was ever published)."""
        base = max(check_version(pointer, "the weight pointer"), restored, on_disk)
        if base == 0:
            return 0
        published = base + 1
        if restored and published > restored + 1:
            self.renumbering = Renumbering(restored=restored, published=published)
        return published

    def effective(self, version: int) -> int:
        return self.renumbering.effective(version) if self.renumbering else version

    def floor(self, trained_from: int) -> int:
        """The oldest effective version a step training from `trained_from` may take."""
        return max(trained_from - self.max_staleness, self.boundary)

    def admissible(self, oldest: int, trained_from: int) -> bool:
        """Whether a group whose oldest model token is of version `oldest` may be trained on."""
        return self.effective(oldest) >= self.floor(trained_from)

    def lag(self, version: int, trained_from: int) -> int:
        """How many versions a token of `version` is behind the weights trained from."""
        return max(trained_from - self.effective(version), 0)

    def warm_started(self, version: int) -> None:
        """The warm start published `version`: nothing sampled before it is trained from now on."""
        self.boundary = max(self.boundary, version)


def writers_after_restore(restored: tuple[str, ...], token: str) -> tuple[str, ...]:
    """The writers of this trainer's checkpoints: those of the checkpoint it restored, then its own
    token (none without a lease: it cannot be told apart from another unleased trainer)."""
    writers = (*restored, token) if token and token not in restored else restored
    return writers[-WRITERS_KEPT:]


def foreign_checkpoint(*, version: int, writers: tuple[str, ...], recorded_version: int,
                       recorded_writer: str) -> str | None:
    """Why checkpoint `version` (written by `writers`) is not the run's, or None when it is or
    cannot be told: at or below the recorded version (records only rise, so those are the run's
    own), no recorder named (a pointer from before writers were recorded, or an unleased trainer),
    no writers (a checkpoint from before they were kept), or a lineage long enough to have lost
    its oldest writers."""
    if version <= recorded_version or not recorded_writer or not writers:
        return None
    if recorded_writer in writers or len(writers) >= WRITERS_KEPT:
        return None
    return (f"checkpoint {version} was written by trainer {writers[-1][:12]}, which had lost the run: the run's "
            f"checkpoint {recorded_version} was recorded by trainer {recorded_writer[:12]}, not among its writers")
