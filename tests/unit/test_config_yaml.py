"""The YAML a run config is read from: a key given twice is an error, not a silent last-wins, and a
float setting takes scientific notation as written (`1e-3`, which PyYAML reads as a string)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from arlo.config import ConfigError, from_dict, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message"), [
    ("trainer:\n  learning_rate: 0.1\nrollout:\n  group_size: 2\ntrainer:\n  groups_per_step: 2\n",
     "trainer: duplicate key at line 5 (first at line 1)"),
    ("trainer:\n  learning_rate: 0.1\n  groups_per_step: 2\n  learning_rate: 0.2\n",
     "trainer.learning_rate: duplicate key at line 4 (first at line 2)"),
    ("trainer:\n  algorithm:\n    kl_coef: 0.1\n    kl_coef: 0.2\n",
     "trainer.algorithm.kl_coef: duplicate key at line 4 (first at line 3)"),
    ("env_gateway:\n  remotes:\n    - address: h:1\n      timeout_s: 5\n      timeout_s: 6\n",
     "env_gateway.remotes[0].timeout_s: duplicate key at line 5 (first at line 4)"),
    ("rollout: {group_size: 2, group_size: 4}\n", "rollout.group_size: duplicate key at line 1 (first at line 1)"),
])
def test_a_key_given_twice_is_refused_at_any_depth(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


def test_keys_that_only_look_alike_and_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    # The same key in different mappings, and an explicit key over one a `<<` merge brought in.
    text = ("inference:\n  server: &srv {port: 0, grace_s: 1}\ntrainer:\n  server:\n    <<: *srv\n    grace_s: 2\n"
            "rollout:\n  server: {port: 0}\n")
    cfg = load_config(write(tmp_path, text))
    assert cfg.inference.server.grace_s == 1.0 and cfg.trainer.server.grace_s == 2.0


@pytest.mark.parametrize(("text", "value"), [
    ("1e-3", 1e-3), ("5E-4", 5e-4), ("+2.5e-3", 2.5e-3), ("1.e-2", 1e-2), (".5e-1", 0.05), ("'1e-3'", 1e-3),
])
def test_a_float_setting_takes_scientific_notation(tmp_path: Path, text: str, value: float) -> None:
    cfg = load_config(write(tmp_path, f"trainer:\n  learning_rate: {text}\n"))
    assert cfg.trainer.learning_rate == value and type(cfg.trainer.learning_rate) is float


def test_scientific_notation_with_a_positive_exponent(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "rollout:\n  rpc_timeout_s: 5E+2\n  episode_timeout_s: 1e3\n"))
    assert (cfg.rollout.rpc_timeout_s, cfg.rollout.episode_timeout_s) == (500.0, 1000.0)


@pytest.mark.parametrize(("text", "message"), [
    ("abc", "trainer.learning_rate: expected float, got 'abc'"),
    ("1e-3x", "trainer.learning_rate: expected float, got '1e-3x'"),
    ("'nan'", "trainer.learning_rate: expected float, got 'nan'"),
    ("'inf'", "trainer.learning_rate: expected float, got 'inf'"),
    ("'1_000.0'", "trainer.learning_rate: expected float, got '1_000.0'"),
    (".nan", "trainer.learning_rate: must be a finite number"),
    ("1e999", "trainer.learning_rate: must be a finite number, got '1e999'"),
    ("2e-0", "trainer.learning_rate: must be in (0, 1), got 2.0"),  # read, then range-checked
])
def test_non_numbers_and_non_finite_floats_stay_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write(tmp_path, f"trainer:\n  learning_rate: {text}\n"))


def test_an_int_setting_does_not_take_a_float_literal(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("env_gateway.max_sessions: expected int, got '1e4'")):
        load_config(write(tmp_path, "env_gateway:\n  max_sessions: 1e4\n"))
    assert load_config(write(tmp_path, "run_id: 1e3\n")).run_id == "1e3"  # a string setting keeps the text


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Optional:
    cap: float | None = None


def test_an_optional_float_takes_scientific_notation_too() -> None:
    assert from_dict(_Optional, {"cap": "1e-3"}).cap == 1e-3
    assert from_dict(_Optional, {"cap": None}).cap is None
