"""Benchmarks print a table and, with --json PATH, write their figures."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.table import Table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    Console().print(table)


def write_json(path: str | None, figures: dict[str, Any]) -> None:
    if not path:
        return
    meta = {"platform": platform.platform(), "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
            "device_count": jax.device_count()}
    Path(path).write_text(json.dumps({**figures, "meta": meta}, indent=2))
