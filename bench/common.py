"""What every bench shares: a rich table on the terminal and, with --json PATH, the figures as JSON.

No heavy imports here (no JAX): service benches should start in well under a second.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(f"{v:,.4g}" if isinstance(v, float) else str(v) for v in row))
    # Piped output (CI logs, `| tee`) gets rich's 80 columns by default: too narrow for a bench table.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (0-100, interpolated): what p50/p99 mean in every bench."""
    if len(values) < 2 or q <= 0:
        return min(values)
    if q >= 100:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def machine() -> dict[str, Any]:
    # The load average says how far to trust latencies measured on a shared machine.
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0]}


def write_json(path: str | None, figures: Mapping[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps({**figures, "machine": machine()}, indent=2) + "\n")
