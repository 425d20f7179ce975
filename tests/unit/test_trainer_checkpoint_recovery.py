"""Saves resume after a failed one while a writer of that save still fills its partial directory
(services/trainer/checkpoint.py `_reopen`). Orbax removes partial directories in the background
when a manager starts; with a writer still filling one that removal fails ('Directory not
empty') and the manager raises it from every later save: CI saw six retries over a minute, none
saved, after a full disk."""

from __future__ import annotations

import threading
from pathlib import Path

import jax.numpy as jnp
import pytest

from services.trainer.checkpoint import Checkpointer, CheckpointMeta


def save(checkpointer: Checkpointer, version: int) -> None:
    params = {"w": jnp.arange(4, dtype=jnp.float32) + version}
    checkpointer.start_save(params, {"mu": jnp.zeros(4)}, CheckpointMeta(version=version, step=version,
                                                                          params_sha256="x" * 64))
    checkpointer.wait()


def test_a_partial_directory_still_being_written_does_not_stop_later_saves(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    partial = directory / "00000003.orbax-checkpoint-tmp" / "params"
    partial.mkdir(parents=True)
    stop = threading.Event()

    def failed_saves_writer() -> None:  # files keep appearing while anyone removes the directory
        i = 0
        while not stop.is_set():
            try:
                partial.mkdir(parents=True, exist_ok=True)
                (partial / f"chunk{i}").write_bytes(b"\0" * 64)
            except OSError:  # removed under it: make it again
                pass
            i += 1

    writer = threading.Thread(target=failed_saves_writer, daemon=True)
    writer.start()
    checkpointer = Checkpointer(str(directory))  # orbax's background removal meets the writer
    try:
        outcomes = []
        for version in (4, 5, 6):
            try:
                save(checkpointer, version)
                outcomes.append("saved")
            except OSError as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        # At most the first save may meet orbax's failed removal; the manager is replaced then.
        assert outcomes[1:] == ["saved", "saved"], outcomes
        assert checkpointer.newest_version() == 6
    finally:
        stop.set()
        writer.join(10)
        checkpointer.close()


@pytest.mark.parametrize("uri", ["gs://bucket/run", "s3://bucket/run"])
def test_a_uri_is_refused_not_taken_as_a_local_path(uri: str) -> None:
    with pytest.raises(ValueError, match="is a URI"):
        Checkpointer(uri)
