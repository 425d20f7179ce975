"""Files shipped with arlo, found through package resources (so an installed wheel finds them
as well as a checkout): the demo run config and the built-in SFT demonstrations.

- `demo.yaml`: the run `arlo demo` makes.
- `arith_sft.jsonl`: demonstrations for the arith task (scripts/make_arith_demos.py).
- `arith_tool_sft.jsonl`: the demo's, made by the arith env's own demonstrator (scripts/gen_demos.py).
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path


def resource(name: str) -> Traversable:
    """A file of this package; FileNotFoundError naming it when the install lacks it."""
    found = files(__name__) / name
    if not found.is_file():
        raise FileNotFoundError(f"arlo.data has no {name!r} (is package-data in pyproject.toml shipping it?)")
    return found


def resource_path(name: str) -> Path:
    """`resource` as a filesystem path, for readers that take one (setuptools installs unzipped)."""
    return Path(str(resource(name)))
