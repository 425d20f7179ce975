"""What every bench shares: a rich table on the terminal and, with --json PATH, the figures as JSON;
the argument checks that refuse a bad flag before a run spends anything (argparse's exit 2).

No heavy imports here (no JAX): service benches should start in well under a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from arlo.report_file import report_path_problem, write_report

if TYPE_CHECKING:
    from arlo.app.local import LocalCluster
    from arlo.config import RunConfig

log = logging.getLogger(__name__)


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
    """The figures (and the machine) to `path`, whole or not at all (arlo/report_file.py)."""
    if path:
        write_report(path, json.dumps({**figures, "machine": machine()}, indent=2) + "\n")


def check_json_arg(parser: argparse.ArgumentParser, args: argparse.Namespace, attr: str = "json",
                   flag: str = "--json") -> None:
    """Refuses (exit 2) a report path the run could not write at its end: a missing folder, a
    folder, a read-only place. Every bench with --json calls this right after parsing."""
    path = getattr(args, attr, None)
    if path is None:
        return
    if not path:
        parser.error(f"{flag} needs a path")
    if problem := report_path_problem(path, flag):
        parser.error(problem)


def check_config(parser: argparse.ArgumentParser, build: Callable[[], object]) -> None:
    """Builds the run config the flags make (`build`) at parse time: a ConfigError is refused as an
    argument error (exit 2), not a traceback once the run has started."""
    from arlo.config import ConfigError

    try:
        build()
    except ConfigError as e:
        parser.error(str(e))


# Argument types: a bad value is refused as `argument --steps: ...` (exit 2), before any run.


def int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An int >= `minimum`; `why` (e.g. "a median needs two") ends the refusal."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{f' ({why})' if why else ''}, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def float_above(minimum: float, *, inclusive: bool = False) -> Callable[[str], float]:
    """A finite float > `minimum` (>= with `inclusive`): nan and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if inclusive else '>'} {minimum:g}, "
                                             f"got {text}")
        return value
    parse.__name__ = "float"
    return parse


def int_list(minimum: int, *, allow_empty: bool = False) -> Callable[[str], list[int]]:
    """Comma-separated whole numbers, each >= `minimum` ('' is the empty list with `allow_empty`)."""
    one = int_at_least(minimum)

    def parse(text: str) -> list[int]:
        items = [s.strip() for s in text.split(",")] if text.strip() else []
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError("expected comma-separated whole numbers, got nothing")
        return [one(s) for s in items]
    parse.__name__ = "list"
    return parse


def float_list(minimum: float) -> Callable[[str], list[float]]:
    """Comma-separated finite numbers, each > `minimum`; at least one."""
    one = float_above(minimum)

    def parse(text: str) -> list[float]:
        items = [s.strip() for s in text.split(",")] if text.strip() else []
        if not items:
            raise argparse.ArgumentTypeError("expected comma-separated numbers, got nothing")
        return [one(s) for s in items]
    parse.__name__ = "list"
    return parse


def name_list(known: Collection[str], *, allow_empty: bool = False) -> Callable[[str], list[str]]:
    """Comma-separated names from `known`, each once."""
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",")] if text.strip() else []
        if not names and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected comma-separated names of {sorted(known)}, got nothing")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; known: {sorted(known)}")
        if len(set(names)) < len(names):
            raise argparse.ArgumentTypeError(f"a name given twice in {text!r}")
        return names
    parse.__name__ = "list"
    return parse


def wipe_namespace(cfg: RunConfig) -> None:
    """Deletes the run's keys from Redis after a bench run (arlo.app.local.wipe_run): a bench leaves
    nothing behind in a shared Redis. A failure (Redis gone) is logged, never raised over the run's result."""
    from arlo.app.local import wipe_run

    try:
        wipe_run(cfg)
    except Exception as e:  # the figures stand; the keys are the next run's fresh_run's to wipe
        log.warning("could not delete run %s's keys from Redis: %s", cfg.run_id, e)


def stop_cluster(cluster: LocalCluster) -> None:
    """Stops a bench's local cluster, then deletes its run's keys from a shared Redis (a Redis the
    cluster started itself stopped with it; its files are under the bench's home)."""
    cluster.stop()
    if cluster.redis is None:
        wipe_namespace(cluster.cfg)


def run_main(main: Callable[[], object]) -> None:
    """A bench's entry point: Ctrl-C ends it with exit 130 and one line, not a traceback (its
    clusters are stopped by their own `finally`s on the way out)."""
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
