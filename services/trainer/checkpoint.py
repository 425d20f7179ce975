"""Orbax checkpoints of the trainer under `<dir>/<version:08d>`: params, optimizer state and a
JSON record (version, step, params checksum, trajectory ids trained since the previous one, the
lease tokens of the trainers whose training it holds),
and with a learned critic (`advantage: gae`) its params and optimizer state as a `critic` item
with its own checksum. A checkpoint without that item restores with `Restored.critic` None
(logged): the learner then starts a fresh critic from the restored policy.

Saving is asynchronous (orbax's CheckpointManager): `start_save` returns once the arrays
are copied to host memory; the write and its finalize (an atomic rename of the temporary
directory) run in a background thread, and `wait` blocks until the checkpoint is complete.
With one process the trainer goes further (`host_copy`): it copies the arrays to host itself,
which is all a step must wait for, and calls `start_save` on the copies beside the next step;
orbax's own start costs 70-110 ms however small the state (a new event loop, a dozen threads,
serialisation dispatch: 596k parameters, 7 MB), against 2 ms for the copy.
A crash mid-write leaves only a `*.orbax-checkpoint-tmp` directory, which is never listed
as a step; a listed step that does not restore, or whose params, optimizer state or record
do not match the checksums recorded with them, or that holds a NaN or inf anywhere (a checksum
proves the bytes are the ones saved, not that they are sound; a record stripped of its checksums
looks like an old one), is skipped (logged as an error, reported in `Restored.skipped`) and an
older complete one is used. A state holding NaN or inf is never saved (`NonFiniteState`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from arlo.config import ConfigError
from arlo.model.weights import nonfinite_leaf
from services.trainer.gather import host_state, state_digest

log = logging.getLogger(__name__)

STEP_DIGITS = 8
KEEP = 3
"""Complete checkpoints kept; more than one, so a corrupt newest one still leaves a fallback."""
_TMP_MARK = ".orbax-checkpoint-tmp"
SET_ASIDE = "set-aside"
"""Where checkpoints the run must not restore go (`Checkpointer.set_aside`): Orbax lists only step names."""
SET_ASIDE_KEEP = 3
"""Set-aside checkpoints kept for an operator (the newest); each is a whole state, and a run taken
over again and again must not fill the disk with them."""
MIN_ROOM_BYTES = 1 << 20
"""Below this much free space (or the newest checkpoint's size, if larger) a save cannot succeed."""


class NonFiniteState(ValueError):
    """The trainer's state holds NaN or inf: it is not saved, and such a checkpoint is not restored."""


def check_finite_state(params: Any, opt_state: Any, critic: Any = None) -> None:
    """Raises NonFiniteState naming the first damaged array (params, optimizer state, critic)."""
    for what, tree in (("params", params), ("optimizer state", opt_state), ("critic", critic)):
        bad = nonfinite_leaf(tree) if tree is not None else None
        if bad is not None:
            raise NonFiniteState(f"{what}: {bad} holds NaN or inf")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointMeta:
    version: int
    step: int
    params_sha256: str
    """sha256 of `state_to_bytes(params)` (the float32 master copy; with param_dtype float32 the
    published version's checksum), checked on restore. Empty: `start_save` computes it."""
    trajectory_ids: tuple[str, ...] = ()
    """Trained since the previous checkpoint; marked trained on resume (a crash may have come
    between this checkpoint completing and their de-duplication markers being written)."""
    opt_state_sha256: str = ""
    """sha256 of the optimizer state's leaves (`tree_sha256`), filled in by `start_save`."""
    critic_sha256: str = ""
    """sha256 (`tree_sha256`) of the critic's {"params", "opt_state"}; empty: no critic saved."""
    writers: tuple[str, ...] = ()
    """Lease tokens of the trainers whose training this holds, oldest first (core/lineage.py);
    empty: written before they were kept, or without a lease."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Restored:
    params: nnx.State
    opt_state: Any
    meta: CheckpointMeta
    uri: str
    critic: Any = None
    """{"params", "opt_state"} of the critic; None when not asked for or not in the checkpoint."""
    skipped: tuple[str, ...] = ()
    """Newer checkpoints passed over as damaged or unreadable ("uri: why"), newest first."""
    set_aside: tuple[str, ...] = ()
    """Newer checkpoints moved to `set-aside/` as not the run's ("uri: why"), newest first."""


@dataclass(frozen=True, slots=True)
class SaveArrays:
    """What a checkpoint saves of a learner: params, optimizer state and the critic's
    {"params", "opt_state"} (None without one)."""

    params: Any
    opt_state: Any
    critic: Any = None


jax.tree_util.register_dataclass(SaveArrays, data_fields=["params", "opt_state", "critic"], meta_fields=[])

def host_copy(arrays: SaveArrays) -> SaveArrays:
    """Every array copied into host memory of its own. One process only (its arrays whole).

    A copy of its own, never the live arrays (the next step donates them while the save reads)
    nor a host view of their buffers (whether one shares memory is up to the platform's runtime)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), arrays)


def params_sha256(params: nnx.State) -> str:
    """sha256 of the params' bytes (`state_to_bytes`); with several processes, a collective:
    every process restoring calls it."""
    return state_digest(params)


def tree_sha256(tree: Any) -> str:
    """sha256 over every leaf's dtype, shape and bytes, in tree order (a collective with several processes)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(host_state(tree)):
        arr = np.ascontiguousarray(leaf)
        digest.update(f"{arr.dtype}{arr.shape}".encode())
        digest.update(arr.reshape(-1).view(np.uint8).data)  # the array's own bytes, no copy
    return digest.hexdigest()


def meta_sha256(record: dict[str, Any]) -> str:
    """The checksum of a meta record, over every field but itself (canonical JSON)."""
    body = {k: v for k, v in record.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _meta_from_record(raw: dict[str, Any]) -> CheckpointMeta:
    return CheckpointMeta(version=int(raw["version"]), step=int(raw["step"]), params_sha256=str(raw["params_sha256"]),
                          trajectory_ids=tuple(str(t) for t in raw.get("trajectory_ids", ())),
                          opt_state_sha256=str(raw.get("opt_state_sha256", "")),
                          critic_sha256=str(raw.get("critic_sha256", "")),
                          writers=tuple(str(w) for w in raw.get("writers", ())))


def _tree_bytes(directory: Path) -> int:
    """Bytes in the files under `directory` (files removed while it walks count as 0)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _abstract(tree: Any) -> Any:
    # Restoring into shapes, dtypes and shardings of the live tree keeps the jitted step's cache valid.
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """One checkpoint directory. Not thread-safe: the caller runs one save or restore at a time."""

    def __init__(self, directory: str, *, keep: int = KEEP) -> None:
        if "://" in directory:  # Path() would make it a relative local path: see TrainerConfig.checkpoint_dir
            raise ValueError(f"checkpoint directory {directory!r} is a URI; give a local or mounted directory")
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        for partial in sorted(self.directory.glob(f"*{_TMP_MARK}*")):
            log.warning("checkpoint %s was never completed (a crash mid-write?); skipping and removing it", partial)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, step_format_fixed_length=STEP_DIGITS, enable_async_checkpointing=True,
            cleanup_tmp_directories=True)
        self._options = options
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def uri(self, version: int) -> str:
        return f"file://{self.directory / f'{version:0{STEP_DIGITS}d}'}"

    def out_of_space(self) -> OSError | None:
        """ENOSPC when the checkpoint disk has less room than the newest complete checkpoint takes
        (at least MIN_ROOM_BYTES), else None. A failed save's own error can be a later symptom of a
        full disk (Orbax failing to clean up its partial directory while a write thread still
        holds it), which would hide the cause from whoever reads the trainer's status."""
        try:
            stat = os.statvfs(self.directory)
            # Root may write into the blocks reserved for it; anyone else gets f_bavail.
            free = (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) * stat.f_frsize
            complete = [p for p in self.directory.iterdir() if p.name.isascii() and p.name.isdigit() and p.is_dir()]
            newest = max(complete, key=lambda p: int(p.name)) if complete else None
            needed = max(MIN_ROOM_BYTES, _tree_bytes(newest) if newest else 0)
        except (OSError, ValueError):  # the disk cannot be read either: nothing to add to the save's own error
            return None
        if free >= needed:
            return None
        return OSError(errno.ENOSPC, f"No space left on device: {free} bytes free under {self.directory}, "
                                     f"a checkpoint takes about {needed}")

    def newest_version(self) -> int:
        """The newest listed checkpoint, readable or not: new versions must be numbered above it."""
        self._manager.reload()
        return self._manager.latest_step() or 0

    def start_save(self, params: nnx.State, opt_state: Any, meta: CheckpointMeta, critic: Any = None) -> None:
        """Blocks only while the arrays are copied to host; then the caller may change them.

        Every piece restored is checksummed: params (the published sha), the optimizer state
        (a flipped byte there restores silently and NaNs the model a step later), the critic
        ({"params", "opt_state"}, when there is one) and the record.
        With several processes every one calls it (the checksum of an empty params_sha256 is a collective).
        A state holding NaN or inf raises NonFiniteState and nothing is written: it would become the
        newest checkpoint and acknowledge the steps it covers."""
        check_finite_state(params, opt_state, critic)
        if not meta.params_sha256:
            meta = dataclasses.replace(meta, params_sha256=params_sha256(params))
        record = dataclasses.asdict(dataclasses.replace(
            meta, opt_state_sha256=tree_sha256(opt_state), critic_sha256=tree_sha256(critic) if critic else ""))
        record["trajectory_ids"] = list(record["trajectory_ids"])
        record["writers"] = list(record["writers"])
        record["meta_sha256"] = meta_sha256(record)
        items = {"params": ocp.args.StandardSave(params), "opt_state": ocp.args.StandardSave(opt_state),
                 "meta": ocp.args.JsonSave(record)}
        if critic:
            items["critic"] = ocp.args.StandardSave(critic)
        args = ocp.args.Composite(**items)
        try:
            saved = self._manager.save(meta.version, args=args)
        except BaseException:
            self._reopen()  # a manager whose save raised keeps raising it: see _reopen
            raise
        if not saved:
            raise RuntimeError(f"orbax declined to save checkpoint {meta.version} (not newer than "
                               f"{self._manager.latest_step()})")

    def set_aside(self, version: int, why: str) -> Path:
        """Moves checkpoint `version` out of the restore's reach, into `set-aside/` (the newest
        SET_ASIDE_KEEP kept for an operator, never listed as a checkpoint); returns where it went."""
        source = self.directory / f"{version:0{STEP_DIGITS}d}"
        target = self.directory / SET_ASIDE / f"{source.name}-{why}-{time.time_ns()}"
        target.parent.mkdir(exist_ok=True)
        source.rename(target)
        self._manager.reload()
        older = sorted(target.parent.iterdir(), key=lambda p: p.name.rsplit("-", 1)[-1], reverse=True)[SET_ASIDE_KEEP:]
        for path in older:
            log.warning("removing set-aside checkpoint %s (the newest %d are kept)", path, SET_ASIDE_KEEP)
            shutil.rmtree(path, ignore_errors=True)
        return target

    def wait(self) -> None:
        """Blocks until the save in flight is complete; raises if it failed."""
        try:
            self._manager.wait_until_finished()
        except BaseException:
            self._reopen()
            raise

    def _reopen(self) -> None:
        """A fresh manager after a failed save: the old one may keep the failure and refuse every
        later save, so saves could not resume once space returns. Orbax's own removal of partial
        directories at start is off here: it runs in the background, a writer of the failed save
        still filling one makes it fail ('Directory not empty'), and the manager then raises
        that from every save it is asked for (CI: six retries over a minute, none saved). The
        partial directories are removed here instead, by the primary process (before it joins
        the next save, so no other process races it), and what cannot be removed yet is left
        (never listed as a checkpoint; the next failure or start removes it)."""
        try:
            self._manager.close()
        except Exception as e:  # the failed save's error again; it was already raised to the caller
            log.debug("closing the checkpoint manager after a failed save: %s", e)
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"*{_TMP_MARK}*"):
                shutil.rmtree(partial, ignore_errors=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=dataclasses.replace(self._options, cleanup_tmp_directories=False))

    def restore_newest(self, params_like: nnx.State, opt_state_like: Any, critic_like: Any = None, *,
                       foreign: Callable[[CheckpointMeta], str | None] | None = None) -> Restored | None:
        """The newest complete, intact checkpoint; None when there is none. `critic_like`: the
        live critic's {"params", "opt_state"}, to restore the critic too (None: not read).
        `foreign`: why a checkpoint (its record, read first) is not the run's, or None; such a
        one is set aside (by the primary process; the others pass it over) and an older one used.
        Raises ConfigError when checkpoints exist but none restores."""
        self._manager.reload()
        skipped: list[str] = []
        set_aside: list[str] = []
        for version in sorted(self._manager.all_steps(), reverse=True):
            why = self._foreign(version, foreign)
            if why:
                log.error("checkpoint %s is not this run's, setting it aside: %s", self.uri(version), why)
                set_aside.append(f"{self.uri(version)}: {why}"[:500])
                if jax.process_index() == 0:
                    self.set_aside(version, "foreign")
                continue
            try:
                restored = self._restore(version, params_like, opt_state_like, critic_like)
                return dataclasses.replace(restored, skipped=tuple(skipped), set_aside=tuple(set_aside))
            except Exception as e:  # orbax raises many types for damaged files; all mean "unusable"
                log.error("checkpoint %s is corrupt or unreadable (%s: %s); falling back to an older one",
                          self.uri(version), type(e).__name__, e)
                skipped.append(f"{self.uri(version)}: {type(e).__name__}: {e}"[:500])
        if skipped:
            # Starting over from the initial weights would publish them as the run's newest version
            # and train the stream's unacknowledged rest onto them, silently: an operator decides.
            raise ConfigError(f"trainer.checkpoint_dir: none of the {len(skipped)} checkpoints under {self.directory} "
                              f"restores ({'; '.join(skipped)[:1500]}); move them aside, or point "
                              "trainer.checkpoint_dir elsewhere, to start this run from the initial weights")
        return None

    def close(self) -> None:
        self._manager.close()

    def _foreign(self, version: int, foreign: Callable[[CheckpointMeta], str | None] | None) -> str | None:
        """`foreign` of checkpoint `version`'s record; None when its record cannot be read (the
        restore then finds it damaged, or it was set aside meanwhile by the primary process)."""
        if foreign is None:
            return None
        try:
            raw = self._manager.restore(version, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            return foreign(_meta_from_record(dict(raw)))
        except Exception as e:  # unreadable: the full restore says why, or it is gone
            log.debug("record of checkpoint %s unreadable: %s", self.uri(version), e)
            return None

    def _restore(self, version: int, params_like: nnx.State, opt_state_like: Any, critic_like: Any = None) -> Restored:
        items = {"params": ocp.args.StandardRestore(_abstract(params_like)),
                 "opt_state": ocp.args.StandardRestore(_abstract(opt_state_like)), "meta": ocp.args.JsonRestore()}
        with_critic = critic_like is not None and (self.directory / f"{version:0{STEP_DIGITS}d}" / "critic").is_dir()
        if critic_like is not None and not with_critic:
            log.warning("checkpoint %s holds no critic (written before advantage: gae?); the critic starts afresh "
                        "from the restored policy", self.uri(version))
        if with_critic:
            items["critic"] = ocp.args.StandardRestore(_abstract(critic_like))
        restored = self._manager.restore(version, args=ocp.args.Composite(**items))
        raw = dict(restored.meta)
        if "meta_sha256" in raw and meta_sha256(raw) != raw["meta_sha256"]:
            raise ValueError("the metadata record does not match its sha256")
        meta = _meta_from_record(raw)
        if meta.version != version:
            raise ValueError(f"records version {meta.version}")
        # Orbax reads damaged array chunks without complaint; the checksums catch them.
        if params_sha256(restored.params) != meta.params_sha256:
            raise ValueError("params do not match the recorded sha256")
        if not meta.opt_state_sha256 or "meta_sha256" not in raw:
            log.warning("checkpoint %s predates optimizer-state and metadata checksums; only params checked",
                        self.uri(version))
        elif tree_sha256(restored.opt_state) != meta.opt_state_sha256:
            raise ValueError("optimizer state does not match the recorded sha256")
        critic = restored.critic if with_critic else None
        if critic is not None and tree_sha256(critic) != meta.critic_sha256:
            raise ValueError("critic does not match the recorded sha256")
        check_finite_state(restored.params, restored.opt_state, critic)
        return Restored(params=restored.params, opt_state=restored.opt_state, meta=meta, uri=self.uri(version),
                        critic=critic)


def load_checkpoint(uri: str, like: nnx.State) -> tuple[nnx.State, dict[str, Any]]:
    """Params only (a cold-starting inference worker); returns (state, {"step", "version"})."""
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with ocp.CheckpointManager(path.parent, options=ocp.CheckpointManagerOptions(
            step_format_fixed_length=len(path.name), read_only=True)) as manager:
        restored = manager.restore(int(path.name), args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()))
    if params_sha256(restored.params) != restored.meta["params_sha256"]:
        raise ValueError(f"checkpoint {uri}: params do not match the recorded sha256")
    return restored.params, {"step": int(restored.meta["step"]), "version": int(restored.meta["version"])}
