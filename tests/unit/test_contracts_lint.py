"""The contracts stay clean: generated code matches the protos, buf lint and ruff pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_generated_code_is_up_to_date() -> None:
    result = run([sys.executable, "scripts/gen_protos.py", "--check"])
    assert result.returncode == 0, result.stderr


def test_buf_lint_passes() -> None:
    buf = shutil.which("buf", path=str(BIN)) or shutil.which("buf")
    if buf is None:
        pytest.fail("buf not found; install the dev extra (buf-bin)")
    result = run([buf, "lint"], cwd=ROOT / "protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff", path=str(BIN)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff not found; install the dev extra")
    result = run([ruff, "check", "."])
    assert result.returncode == 0, result.stdout + result.stderr


def test_configuration_reference_is_up_to_date() -> None:
    result = run([sys.executable, "scripts/gen_config_docs.py", "--check"])
    assert result.returncode == 0, result.stderr
