"""Rows of a task dataset read from disk: JSON Lines, Parquet (pyarrow) or a Hugging Face
`datasets` directory written by `save_to_disk`. Each is read once per (file, modification time)
and shared by every session; Parquet and `datasets` rows stay in Arrow memory (memory-mapped for
`datasets`) and are turned into Python objects one row at a time.

The split and the epoch order are pure functions of the row ids and recorded seeds, so any
gateway replica, before or after a restart, maps a seed to the same task.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from arlo.config import DATASET_FORMATS
from arlo.jsonfields import loads_bounded
from arlo.regular_files import check_regular, open_regular

FORMATS = DATASET_FORMATS
MAX_JSONL_BYTES = 1 << 30
_CACHED_DATASETS = 8
_CACHED_ORDERS = 64


class Rows(Protocol):
    columns: tuple[str, ...]

    def __len__(self) -> int: ...

    def row(self, i: int) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ListRows:
    columns: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class ArrowRows:
    """A pyarrow Table (Parquet) or a `datasets.Dataset`: rows converted on access."""

    def __init__(self, table: Any, columns: Sequence[str], get_row: Any) -> None:
        self._table, self._get_row = table, get_row
        self.columns = tuple(columns)

    def __len__(self) -> int:
        return len(self._table)

    def row(self, i: int) -> dict[str, Any]:
        return self._get_row(self._table, i)


def detect_format(path: Path) -> str:
    if path.is_dir():
        return "hf"
    if path.suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if path.suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"path {str(path)!r}: cannot tell the format from the name; set format to one of "
                     f"{list(FORMATS[1:])}")


def read_jsonl(path: Path, f: BinaryIO) -> ListRows:
    if os.fstat(f.fileno()).st_size > MAX_JSONL_BYTES:
        raise ValueError(f"{path} is larger than {MAX_JSONL_BYTES} bytes: convert it to Parquet")
    rows: list[dict[str, Any]] = []
    columns: dict[str, None] = {}
    for n, line in enumerate(io.TextIOWrapper(f, encoding="utf-8"), start=1):
        if not line.strip():
            continue
        try:
            item = loads_bounded(line)  # a row nested 50,000 deep is this row's error, not INTERNAL
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON: {e}") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(item).__name__}")
        rows.append(item)
        columns.update(dict.fromkeys(item))
    return ListRows(columns=tuple(columns), rows=tuple(rows))


def read_parquet(f: BinaryIO) -> ArrowRows:
    import pyarrow.parquet as pq  # the `data` extra: only datasets from files need it

    table = pq.read_table(f)  # an open file, never a directory (pyarrow would read all of one)
    return ArrowRows(table, table.column_names, lambda t, i: t.slice(i, 1).to_pylist()[0])


def read_hf(path: Path, hf_split: str) -> ArrowRows:
    import datasets  # the `data` extra

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if not hf_split:
            if len(loaded) != 1:
                raise ValueError(f"{path} holds the splits {sorted(loaded)}: set hf_split to one of them")
            hf_split = next(iter(loaded))
        if hf_split not in loaded:
            raise ValueError(f"hf_split {hf_split!r} is not in {path}; it holds {sorted(loaded)}")
        loaded = loaded[hf_split]
    elif hf_split:
        raise ValueError(f"hf_split {hf_split!r}: {path} holds a single Dataset, not a DatasetDict")
    return ArrowRows(loaded, loaded.column_names, lambda d, i: d[i])


HF_JSON_FILES = ("dataset_dict.json", "state.json", "dataset_info.json")
SPLIT_NAME = re.compile(r"\w+(\.\w+)*")  # datasets' own rule for a split's name


def check_hf_dir(roots: DatasetRoots, path: Path, *, nested: bool = False) -> None:
    """ValueError unless every file `datasets.load_from_disk(path)` may open is under `roots`:
    it joins the names its JSON files give to the directory as they are, so a data file named
    with `..` or an absolute path, a split named `../x`, or a symlinked member would lead out.
    Each JSON file is checked before it is read."""

    def inside(member: Path) -> Path:
        try:
            return roots.resolve(member)
        except ValueError as e:
            raise ValueError(f"save_to_disk directory {str(path)!r} refers to a file outside: {e}") from None

    for name in HF_JSON_FILES:
        if (path / name).exists():
            _regular(inside(path / name))  # datasets opens dataset_info.json itself
    if (path / "state.json").exists():
        entries = _json_list(roots, path / "state.json", "_data_files")
        names = [e.get("filename") if isinstance(e, dict) else None for e in entries]
        for name in names:
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                raise ValueError(f"{path / 'state.json'}: data file {name!r} is not a file name in its directory")
            _regular(inside(path / name))  # datasets memory-maps it: a pipe would hang the load
    if (path / "dataset_dict.json").exists() and not nested:  # a DatasetDict's splits are Datasets
        for split in _json_list(roots, path / "dataset_dict.json", "splits"):
            if not isinstance(split, str) or not SPLIT_NAME.fullmatch(split):
                raise ValueError(f"{path / 'dataset_dict.json'}: {split!r} is not a split name")
            inside(path / split)
            check_hf_dir(roots, path / split, nested=True)


def _regular(path: Path) -> None:
    try:
        check_regular(path)
    except OSError:
        pass  # missing: datasets says so when it loads
    except ValueError as e:
        raise ValueError(f"save_to_disk directory member {e}") from None


def _json_list(roots: DatasetRoots, path: Path, key: str) -> list[Any]:
    with roots.open(path) as f:
        try:
            data = loads_bounded(f.read())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise ValueError(f"{path}: expected a JSON object with a list {key!r}")
    return data[key]


def read_rows(roots: DatasetRoots, path: Path, fmt: str, hf_split: str) -> Rows:
    """`path`, as `roots.resolve` gave it, read as `fmt`; ValueError saying why not."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if path.is_dir() != (fmt == "hf"):
        raise ValueError(f"path {str(path)!r} is a {'directory' if path.is_dir() else 'file'}: format {fmt!r} "
                         f"reads {'a save_to_disk directory' if fmt == 'hf' else 'a file'}")
    try:
        if fmt == "hf":
            check_hf_dir(roots, path)
            return read_hf(path, hf_split)
        with roots.open(path) as f:
            return read_jsonl(path, f) if fmt == "jsonl" else read_parquet(f)
    except ImportError as e:
        raise ValueError(f"format {fmt!r} needs the `data` extra (pip install 'arlo[data]'): {e}") from None
    except (OSError, UnicodeDecodeError) as e:  # pyarrow's ArrowInvalid is an OSError... or a ValueError
        raise ValueError(f"path {str(path)!r}: cannot read it as {fmt}: {e}") from None


def in_eval(task_id: str, fraction: float, split_seed: int) -> bool:
    """A fixed partition by task id: stable when rows are added, reordered or read from another copy."""
    return zlib.crc32(f"{split_seed}:{task_id}".encode()) < fraction * 2**32


def epoch_order(n: int, epoch: int, shuffle_seed: int) -> list[int]:
    """The order of positions 0..n-1 in `epoch`: a permutation seeded by (shuffle_seed, epoch)."""
    order = list(range(n))
    random.Random(f"{shuffle_seed}:{epoch}").shuffle(order)
    return order


ROOTS_SETTING = "env_gateway.dataset_roots"


class DatasetRoots:
    """The directories a gateway reads datasets from. The path comes from a client's config JSON,
    so without this any token holder could have the gateway read any file it can reach; a path
    is checked after symlinks and `..` are resolved (resolving reads the links on the way, but a
    refusal says nothing about whether the file exists; a symlink loop is a ValueError too), and
    so is every file a save_to_disk directory names.
    `private` directories (arlo's state: token, config, logs) are refused even under a root,
    unless a root is at or inside them (listed on purpose)."""

    def __init__(self, roots: Sequence[str | Path], *, private: Sequence[str | Path] = ()) -> None:
        self.roots: tuple[Path, ...] = tuple(Path(r).expanduser().resolve() for r in roots)
        for given, root in zip(roots, self.roots, strict=True):
            if not root.is_dir():
                raise ValueError(f"{ROOTS_SETTING}: {str(given)!r} ({root}) is not a directory")
        self.private: tuple[Path, ...] = tuple(Path(d).expanduser().resolve() for d in private)

    def resolve(self, path: str | Path) -> Path:
        """`path` (relative to the working directory) resolved, or ValueError naming the setting."""
        try:
            p = Path(path).expanduser().resolve()
        except RuntimeError as e:  # a symlink loop: the client's mistake, not the gateway's
            raise ValueError(f"path {str(path)!r} cannot be resolved: {e}") from None
        under = [root for root in self.roots if p.is_relative_to(root)]
        if not under:
            allowed = [str(r) for r in self.roots]
            raise ValueError(f"path {str(path)!r} is outside the directories the gateway reads datasets from "
                             f"({ROOTS_SETTING}: {allowed}); move the dataset under one of them, or add "
                             f"its directory to {ROOTS_SETTING} in the gateway's config")
        if all(self._in_private(p, root) for root in under):
            raise ValueError(f"path {str(path)!r} is in arlo's own state directory ({self._in_private(p, under[0])}, "
                             f"$ARLO_HOME), which the gateway never reads datasets from")
        return p

    def _in_private(self, p: Path, root: Path) -> Path | None:
        return next((d for d in self.private if p.is_relative_to(d) and d != root and d.is_relative_to(root)), None)

    def open(self, path: Path) -> BinaryIO:
        """`path`, as `resolve` gave it, opened for reading, and checked again once open: had a
        directory on the way been swapped for a symlink out of the roots since `resolve`, the
        open file is not the one the path leads to now, and it is refused. Anything but a regular
        file (a named pipe, a device) is refused before it is opened (arlo.regular_files)."""
        f = open_regular(path)
        try:
            opened, now = os.fstat(f.fileno()), self.resolve(path).stat()
            if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino):
                raise ValueError(f"path {str(path)!r} changed while it was opened; try again")
        except BaseException:
            f.close()
            raise
        return f


def _version(p: Path, stat: os.stat_result) -> tuple[Any, ...]:
    """What changes when the dataset at `p` is rewritten: a file's mtime and size; for a directory
    also those of the JSON files in it and in its splits, since save_to_disk over an existing
    directory rewrites its files in place and leaves the directory's own mtime and size alone."""
    out: list[Any] = [stat.st_mtime_ns, stat.st_size]
    if p.is_dir():
        for d in (p, *sorted(c for c in p.iterdir() if c.is_dir())):
            for name in HF_JSON_FILES:
                try:
                    member = (d / name).stat()
                except OSError:
                    continue
                out.append((d.name, name, member.st_mtime_ns, member.st_size))
    return tuple(out)


class DatasetStore:
    """Loaded datasets, their splits and epoch orders, shared by the sessions of a gateway; only
    paths under `roots` are read."""

    def __init__(self, roots: DatasetRoots) -> None:
        self._roots = roots
        self._lock = threading.Lock()
        self._loading: dict[tuple[Any, ...], threading.Lock] = {}
        """One lock per dataset being read: a slow read delays the Resets of that dataset only."""
        self._rows: OrderedDict[tuple[Any, ...], Rows] = OrderedDict()
        self._splits: OrderedDict[tuple[Any, ...], tuple[int, ...]] = OrderedDict()
        self._orders: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()

    def rows(self, path: str, fmt: str, hf_split: str) -> tuple[tuple[Any, ...], Rows]:
        p = self._roots.resolve(path)
        try:
            stat = p.stat()
        except OSError:
            raise ValueError(f"path {path!r} does not exist") from None
        if not p.is_dir():
            check_regular(p, stat)  # a pipe or a device: refused before it is opened
        key = (str(p), *_version(p, stat), fmt, hf_split)
        with self._lock:
            if key in self._rows:
                self._rows.move_to_end(key)
                return key, self._rows[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # one load per file even when many sessions start at once; other files go on
            with self._lock:
                if key in self._rows:
                    return key, self._rows[key]
            try:
                rows = read_rows(self._roots, p, fmt, hf_split)
            except BaseException:
                with self._lock:
                    self._loading.pop(key, None)
                raise
            with self._lock:  # cached before the lock goes, so nobody reads it twice
                self._put(self._rows, key, rows, _CACHED_DATASETS)
                self._loading.pop(key, None)
            return key, rows

    def split(self, key: tuple[Any, ...], rows: Rows, ids: Any, split: str, fraction: float,
              split_seed: int) -> tuple[int, ...]:
        """Row indices of `split` ("all", "train" or "eval"); `ids(i)` is row i's task id."""
        skey = (key, split, fraction, split_seed)
        with self._lock:
            if skey not in self._splits:
                if split == "all":
                    chosen = tuple(range(len(rows)))
                else:
                    want = split == "eval"
                    chosen = tuple(i for i in range(len(rows)) if in_eval(ids(i), fraction, split_seed) == want)
                self._put(self._splits, skey, chosen, _CACHED_ORDERS)
            return self._splits[skey]

    def order(self, skey: tuple[Any, ...], n: int, epoch: int, shuffle_seed: int) -> list[int]:
        okey = (skey, n, epoch, shuffle_seed)
        with self._lock:
            if okey not in self._orders:
                self._put(self._orders, okey, epoch_order(n, epoch, shuffle_seed), _CACHED_ORDERS)
            return self._orders[okey]

    @staticmethod
    def _put(cache: OrderedDict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any, limit: int) -> None:
        cache[key] = value
        while len(cache) > limit:
            cache.popitem(last=False)
