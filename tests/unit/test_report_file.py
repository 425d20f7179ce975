"""`--json PATH` (arlo/report_file.py): checked before a run, written to what the path names, whole."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from arlo.report_file import report_path_problem, write_report


def test_a_regular_file_is_replaced_whole_and_keeps_its_permissions(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old")
    target.chmod(0o640)
    assert report_path_problem(str(target)) is None
    write_report(str(target), '{"new": 1}')
    assert target.read_text() == '{"new": 1}' and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


def test_a_symlink_is_written_through_not_replaced(tmp_path: Path) -> None:
    # The first version renamed over the path: the link became a file and its target kept the old text.
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("ORIG")
    link.symlink_to(target.name)
    assert report_path_problem(str(link)) is None
    write_report(str(link), "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_pipe_is_written_in_place(tmp_path: Path) -> None:
    # A shell's `--json >(cat > f)` and /dev/stdout name a pipe: a rename there failed (or, on a
    # device as root, replaced /dev/null with a regular file).
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert report_path_problem(str(fifo)) is None
    write_report(str(fifo), "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.parametrize("case", ["folder", "trailing slash", "no folder", "name too long", "proc"])
def test_paths_the_report_could_not_be_written_to_are_refused_before_the_run(tmp_path: Path, case: str) -> None:
    path = {"folder": str(tmp_path),
            "trailing slash": str(tmp_path / "r.json") + "/",
            "no folder": str(tmp_path / "missing" / "r.json"),
            # 250 bytes fit a name; the first version's ".<name>.partial" did not, after the run.
            "name too long": str(tmp_path / ("a" * 256 + ".json")),
            "proc": "/proc/arlo-report.json"}[case]
    problem = report_path_problem(path)
    assert problem is not None and path in problem
    assert not os.path.exists(path.rstrip("/")) or os.path.isdir(path)


def test_a_long_name_that_fits_is_accepted_and_written(tmp_path: Path) -> None:
    path = str(tmp_path / ("a" * 250 + ".json"))  # 255 bytes: the longest name ext4 takes
    assert report_path_problem(path) is None and not Path(path).exists()  # the probe leaves nothing
    write_report(path, "x")
    assert Path(path).read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only folders")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        problem = report_path_problem(str(folder / "r.json"))
        assert problem is not None and "r.json" in problem
    finally:
        folder.chmod(0o700)
