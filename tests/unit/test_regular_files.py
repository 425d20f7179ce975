"""Only regular files are read from paths users name (arlo.regular_files; issue 33 item 12): a
named pipe or a device is refused before it is opened, wherever a dataset, a retrieval docs dir
or a save_to_disk member names one; and a dataset that is slow to read holds up only its own
Resets, not those of other files."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from arlo.regular_files import check_regular, open_regular, read_regular_text
from services.env_gateway.envs.dataset import DatasetEnv
from services.env_gateway.envs.dataset_source import DatasetRoots, DatasetStore
from services.env_gateway.envs.retrieval import load_corpus

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "pipe.jsonl"
    os.mkfifo(path)
    yield path
    with contextlib.suppress(OSError):  # lets go of a reader left blocked by a regression
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_pipes_devices_and_directories_are_refused_saying_what_they_are(fifo: Path, tmp_path: Path) -> None:
    for path, what in ((fifo, "a named pipe"), (Path("/dev/zero"), "a character device"), (tmp_path, "a directory")):
        with pytest.raises(ValueError, match=f"is {what}.*not a regular file"):
            open_regular(path)
    (tmp_path / "ok.txt").write_text("héllo")
    assert read_regular_text(tmp_path / "ok.txt") == "héllo"
    with open_regular(tmp_path / "ok.txt") as f:
        assert os.get_blocking(f.fileno()) and f.read() == "héllo".encode()  # blocking again once checked
    with pytest.raises(ValueError, match="larger than 2 bytes"):
        read_regular_text(tmp_path / "ok.txt", max_bytes=2)
    with pytest.raises(FileNotFoundError):
        check_regular(tmp_path / "missing")


def test_a_dataset_that_is_a_pipe_is_refused_at_once(fifo: Path, tmp_path: Path) -> None:
    env = DatasetEnv(DatasetStore(DatasetRoots([tmp_path])))
    started = time.monotonic()
    with pytest.raises(ValueError, match="pipe.jsonl' is a named pipe"):
        env.reset(0, {"path": str(fifo)})
    assert time.monotonic() - started < 2


def test_a_save_to_disk_member_that_is_a_pipe_is_refused(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    os.mkfifo(ds / "data-00000.arrow")
    with pytest.raises(ValueError, match="data-00000.arrow' is a named pipe"):
        DatasetEnv(DatasetStore(DatasetRoots([tmp_path]))).reset(0, {"path": str(ds), "format": "hf"})
    (ds / "data-00000.arrow").unlink()
    (ds / "data-00000.arrow").write_bytes(b"")
    (ds / "dataset_info.json").unlink()
    os.mkfifo(ds / "dataset_info.json")  # read by datasets itself, not by the checks before it
    with pytest.raises(ValueError, match="dataset_info.json' is a named pipe"):
        DatasetEnv(DatasetStore(DatasetRoots([tmp_path]))).reset(0, {"path": str(ds), "format": "hf"})


def test_a_retrieval_docs_dir_with_a_pipe_for_questions_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("A\ntext")
    os.mkfifo(tmp_path / "questions.jsonl")
    with pytest.raises(ValueError, match="questions.jsonl' is a named pipe"):
        load_corpus(str(tmp_path))


class SlowRoots(DatasetRoots):
    """Opening `slow` waits for `release`: a dataset on a hung network disk."""

    def __init__(self, root: Path, slow: Path) -> None:
        super().__init__([root])
        self.slow, self.release, self.entered = slow, threading.Event(), threading.Event()

    def open(self, path: Path) -> BinaryIO:
        if path == self.slow:
            self.entered.set()
            self.release.wait(20)
        return super().open(path)


def test_a_slow_dataset_holds_up_only_its_own_resets(tmp_path: Path) -> None:
    for name in ("slow.jsonl", "fast.jsonl"):
        (tmp_path / name).write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    roots = SlowRoots(tmp_path, (tmp_path / "slow.jsonl").resolve())
    store = DatasetStore(roots)
    slow = threading.Thread(target=lambda: DatasetEnv(store).reset(0, {"path": str(tmp_path / "slow.jsonl")}))
    slow.start()
    try:
        assert roots.entered.wait(5)
        started = time.monotonic()
        assert DatasetEnv(store).reset(0, {"path": str(tmp_path / "fast.jsonl")}).task_id == "dataset-0"
        assert time.monotonic() - started < 2  # before: the store's one lock was held by the slow read
    finally:
        roots.release.set()
        slow.join(10)
