"""Orbax checkpoints of the trainer under `<dir>/<version:08d>`: params, optimizer state and a
JSON record (version, step, params checksum, trajectory ids trained since the previous one).

Saving is asynchronous (orbax's CheckpointManager): `start_save` returns once the arrays
are copied to host memory; the write and its finalize (an atomic rename of the temporary
directory) run in a background thread, and `wait` blocks until the checkpoint is complete.
A crash mid-write leaves only a `*.orbax-checkpoint-tmp` directory, which is never listed
as a step; a listed step that does not restore, or whose params do not match the checksum
recorded with them, is skipped with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from services.trainer.gather import state_bytes

log = logging.getLogger(__name__)

STEP_DIGITS = 8
KEEP = 3
"""Complete checkpoints kept; more than one, so a corrupt newest one still leaves a fallback."""
_TMP_MARK = ".orbax-checkpoint-tmp"


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Restored:
    params: nnx.State
    opt_state: Any
    meta: CheckpointMeta
    uri: str


def params_sha256(params: nnx.State) -> str:
    """With several processes, a collective: every process restoring calls it."""
    return hashlib.sha256(state_bytes(params)).hexdigest()


def _abstract(tree: Any) -> Any:
    # Restoring into shapes, dtypes and shardings of the live tree keeps the jitted step's cache valid.
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """One checkpoint directory. Not thread-safe: the caller runs one save or restore at a time."""

    def __init__(self, directory: str, *, keep: int = KEEP) -> None:
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        for partial in sorted(self.directory.glob(f"*{_TMP_MARK}*")):
            log.warning("checkpoint %s was never completed (a crash mid-write?); skipping and removing it", partial)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, step_format_fixed_length=STEP_DIGITS, enable_async_checkpointing=True,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def uri(self, version: int) -> str:
        return f"file://{self.directory / f'{version:0{STEP_DIGITS}d}'}"

    def newest_version(self) -> int:
        """The newest listed checkpoint, readable or not: new versions must be numbered above it."""
        self._manager.reload()
        return self._manager.latest_step() or 0

    def start_save(self, params: nnx.State, opt_state: Any, meta: CheckpointMeta) -> None:
        """Blocks only while the arrays are copied to host; then the caller may change them.
        With several processes every one calls it (the checksum of an empty params_sha256 is a collective)."""
        if not meta.params_sha256:
            meta = dataclasses.replace(meta, params_sha256=params_sha256(params))
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(dataclasses.asdict(meta)))
        if not self._manager.save(meta.version, args=args):
            raise RuntimeError(f"orbax declined to save checkpoint {meta.version} (not newer than "
                               f"{self._manager.latest_step()})")

    def wait(self) -> None:
        """Blocks until the save in flight is complete; raises if it failed."""
        self._manager.wait_until_finished()

    def restore_newest(self, params_like: nnx.State, opt_state_like: Any) -> Restored | None:
        """The newest complete, intact checkpoint; None when there is none."""
        self._manager.reload()
        for version in sorted(self._manager.all_steps(), reverse=True):
            try:
                return self._restore(version, params_like, opt_state_like)
            except Exception as e:  # orbax raises many types for damaged files; all mean "unusable"
                log.warning("checkpoint %s is corrupt or unreadable (%s: %s); skipping it",
                            self.uri(version), type(e).__name__, e)
        return None

    def close(self) -> None:
        self._manager.close()

    def _restore(self, version: int, params_like: nnx.State, opt_state_like: Any) -> Restored:
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(version, args=args)
        raw = dict(restored.meta)
        meta = CheckpointMeta(version=int(raw["version"]), step=int(raw["step"]),
                              params_sha256=str(raw["params_sha256"]),
                              trajectory_ids=tuple(str(t) for t in raw.get("trajectory_ids", ())))
        if meta.version != version:
            raise ValueError(f"records version {meta.version}")
        # Orbax reads damaged array chunks without complaint; the checksum catches them.
        if params_sha256(restored.params) != meta.params_sha256:
            raise ValueError("params do not match the recorded sha256")
        return Restored(params=restored.params, opt_state=restored.opt_state, meta=meta, uri=self.uri(version))


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
