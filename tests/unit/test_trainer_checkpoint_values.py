"""A checkpoint is judged by its values, not only its checksums (issue 33, item 13): a checksum
proves the bytes are the ones saved, so an optimizer state saved with NaN (or a record whose
checksum fields were removed, which then looks like an old one) restored cleanly and the first
step after it turned every parameter into NaN. Such a checkpoint is now passed over for an older
good one, and a state holding NaN or inf is never saved."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import services.trainer.checkpoint as checkpoint
from arlo.config import ConfigError
from services.trainer.checkpoint import Checkpointer, CheckpointMeta, NonFiniteState


def state(version: int, *, mu: float = 0.0) -> tuple[dict, dict]:
    return nnx.State({"w": nnx.Param(jnp.arange(4, dtype=jnp.float32) + version)}), {"mu": jnp.full(4, mu), "count": jnp.int32(version)}


def save(ckpt: Checkpointer, version: int, **kw) -> None:
    params, opt = state(version, **kw)
    ckpt.start_save(params, opt, CheckpointMeta(version=version, step=version, params_sha256=""))
    ckpt.wait()


def save_unchecked(ckpt: Checkpointer, version: int, monkeypatch: pytest.MonkeyPatch, **kw) -> None:
    """What an older build (or a hostile writer recomputing the checksums) leaves on disk."""
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "check_finite_state", lambda *a, **k: None)
        save(ckpt, version, **kw)


def restore(ckpt: Checkpointer):
    return ckpt.restore_newest(*state(0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_whose_optimizer_state_is_not_finite_is_passed_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: float) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        save(ckpt, 1)
        save_unchecked(ckpt, 2, monkeypatch, mu=bad)  # its checksum matches its (damaged) values
        restored = restore(ckpt)
        assert restored is not None and restored.meta.version == 1
        assert len(restored.skipped) == 1 and "optimizer state" in restored.skipped[0]
        assert "NaN or inf" in restored.skipped[0]
    finally:
        ckpt.close()


def test_a_checkpoint_stripped_of_its_checksums_is_still_judged_by_its_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        save(ckpt, 1)
        save_unchecked(ckpt, 2, monkeypatch, mu=float("nan"))
        meta = tmp_path / "ckpt" / "00000002" / "meta" / "metadata"
        record = json.loads(meta.read_text())
        for field in ("opt_state_sha256", "meta_sha256"):  # now it looks like a pre-checksum checkpoint
            record.pop(field)
        meta.write_text(json.dumps(record))
        restored = restore(ckpt)
        assert restored is not None and restored.meta.version == 1 and "NaN or inf" in restored.skipped[0]
    finally:
        ckpt.close()


def test_a_state_holding_nan_is_never_saved(tmp_path: Path) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        save(ckpt, 1)
        for arrays in (state(2, mu=float("nan")), (nnx.State({"w": nnx.Param(np.array([1.0, np.inf, 0, 0], np.float32))}), state(2)[1])):
            with pytest.raises(NonFiniteState, match="holds NaN or inf"):
                ckpt.start_save(*arrays, CheckpointMeta(version=2, step=2, params_sha256=""))
        assert ckpt.newest_version() == 1
        assert restore(ckpt).meta.version == 1
    finally:
        ckpt.close()


def test_a_directory_where_no_checkpoint_restores_is_refused_not_started_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkpoint damaged: the trainer used to start from the initial weights and publish them
    as the run's newest version (one error line per checkpoint, nothing counted)."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        for version in (1, 2):
            save_unchecked(ckpt, version, monkeypatch, mu=float("nan"))
        with pytest.raises(ConfigError, match=r"trainer\.checkpoint_dir: none of the 2 checkpoints .* restores"):
            restore(ckpt)
    finally:
        ckpt.close()
    empty = Checkpointer(str(tmp_path / "empty"))
    try:
        assert restore(empty) is None  # nothing saved yet: a fresh start
    finally:
        empty.close()


def test_set_aside_checkpoints_leave_the_restore_and_only_the_newest_few_stay_on_disk(tmp_path: Path) -> None:
    """A run taken over again and again must not fill the disk with set-aside states."""
    ckpt = Checkpointer(str(tmp_path), keep=10)
    try:
        for version in range(1, 7):
            save(ckpt, version)
        for version in range(6, 1, -1):
            ckpt.set_aside(version, "foreign")
        kept = sorted(p.name.split("-")[0] for p in (tmp_path / checkpoint.SET_ASIDE).iterdir())
        assert kept == ["00000002", "00000003", "00000004"]  # the three set aside last
        assert restore(ckpt).meta.version == 1
    finally:
        ckpt.close()
