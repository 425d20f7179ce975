"""A run config nested 100,000 deep, or a config path that is a named pipe, is a ConfigError
naming the file (issue 33 item 15: it was a RecursionError; a pipe would block the load)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from arlo.config import ConfigError, load_config
from arlo.config.run import read_yaml
from arlo.jsonfields import MAX_DEPTH

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("text", [
    "trainer: " + "[" * 100_000,  # flow style, unclosed
    "trainer: " + "[" * 100_000 + "]" * 100_000,
    "- " * 100_000 + "x",  # block sequences
    "".join("  " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 2)) + "  " * (MAX_DEPTH + 2) + "v",  # block mappings
])
def test_deep_yaml_is_a_config_error_naming_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"deep\.yaml: line \d+: nested deeper than {MAX_DEPTH} levels"):
        load_config(path)


def test_nesting_up_to_the_bound_still_reads() -> None:
    value = read_yaml("a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))["a"]  # the mapping is one level
    for _ in range(MAX_DEPTH - 2):
        value = value[0]
    assert value == []


def test_a_config_path_that_is_a_named_pipe_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    os.mkfifo(path)
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError, match="run.yaml' is a named pipe"):
            load_config(path)
        assert time.monotonic() - started < 2
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
