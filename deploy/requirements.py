"""Prints the pinned runtime dependencies of pyproject.toml, one per line.

The image installs these in a layer of their own (it changes only when pyproject.toml
does), before the arlo sources are copied. `--jax-extra tpu|cuda12|cuda13` asks for JAX's
accelerator plugin at the same pinned JAX version (`jax[tpu]==X`).

    python deploy/requirements.py [--jax-extra EXTRA] [pyproject.toml] > requirements.txt
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

JAX_EXTRAS = ("", "tpu", "cuda12", "cuda13")
_JAX = re.compile(r"^jax\s*(==.*)$")


def requirements(pyproject: Path, jax_extra: str = "") -> list[str]:
    if jax_extra not in JAX_EXTRAS:
        raise ValueError(f"--jax-extra must be one of {', '.join(repr(e) for e in JAX_EXTRAS)}; got {jax_extra!r}")
    deps: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = []
    for dep in deps:
        match = _JAX.match(dep.strip())
        if jax_extra and match:
            dep = f"jax[{jax_extra}]{match.group(1)}"
        out.append(dep)
    if jax_extra and not any(d.startswith("jax[") for d in out):
        raise ValueError("pyproject.toml pins no `jax==...` to add the extra to")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml")
    parser.add_argument("--jax-extra", default="", help="JAX accelerator extra: tpu, cuda12, cuda13 (default: CPU)")
    args = parser.parse_args(argv)
    try:
        print("\n".join(requirements(Path(args.pyproject), args.jax_extra)))
    except (OSError, KeyError, ValueError) as e:
        print(f"requirements.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
