"""Orbax checkpoints of the policy: written under `<dir>/<version>`, complete only when finalized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from flax import nnx


def save_checkpoint(directory: str, version: int, state: nnx.State, step: int) -> str:
    """Writes params and the step counter; returns the checkpoint URI once it is complete."""
    path = Path(directory).resolve() / f"{version:08d}"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": state.to_pure_dict(), "step": step, "version": version}, force=True)
    checkpointer.wait_until_finished()  # the pointer's checkpoint field may only move after this
    checkpointer.close()
    return f"file://{path}"


def load_checkpoint(uri: str, like: nnx.State) -> tuple[nnx.State, dict[str, Any]]:
    """Restores params into the structure of `like`; returns (state, {"step", "version"})."""
    path = Path(uri.removeprefix("file://"))
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    checkpointer = ocp.StandardCheckpointer()
    restored = checkpointer.restore(path)
    checkpointer.close()
    state = nnx.State(like)
    state.replace_by_pure_dict(restored["params"])
    return state, {"step": int(restored["step"]), "version": int(restored["version"])}
