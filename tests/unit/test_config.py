"""Run config: defaults valid, errors name the field, YAML round trip."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest

from arlo.config import (
    Advantage,
    ConfigError,
    RunConfig,
    check_run_id,
    dump_config,
    from_dict,
    load_config,
    replace_config,
)
from arlo.coord.keys import Keys

ROOT = Path(__file__).resolve().parents[2]


def test_builtin_config_is_valid() -> None:
    cfg = load_config()
    assert cfg == RunConfig() and cfg.trainer.server.port == 50052


@pytest.mark.parametrize(("overrides", "message"), [
    ({"trainer": {"learning_rate": "abc"}}, "trainer.learning_rate: expected float"),
    ({"trainer": {"lr": 1}}, "trainer: unknown field(s) ['lr']"),
    ({"rollout": {"group_size": 0}}, "rollout.group_size: must be in"),
    ({"run_id": "a b"}, "run_id: must be non-empty"),
    ({"inference": {"server": {"port": 70000}}}, "inference.server.port"),
    ({"env_gateway": {"remotes": [{"address": ""}]}}, "env_gateway.remotes[0].address"),
    ({"reward": {"plugins": [{"name": "x", "target": "nocolon"}]}}, "reward.plugins[0].target"),
    ({"env_gateway": {"sandbox": {"isolation": "docker"}}}, "env_gateway.sandbox.isolation"),
    ({"reward": {"timeout_s": 5.0}}, "reward.timeout_s: must exceed sandbox.wall_timeout_s"),
    ({"trainer": {"groups_per_step": True}}, "expected int"),
    ({"trainer": {"algorithm": {"advantage": "ppo"}}},
     "trainer.algorithm.advantage: must be one of grpo, dr_grpo, rloo, reinforce_pp, gae, got 'ppo'"),
    ({"trainer": {"remat": True}}, "trainer.remat: must be one of none, full, dots"),
    ({"model": {"dtype": "float16"}}, "model.dtype: must be one of float32, bfloat16"),
    ({"trainer": {"algorithm": {"kl_kind": "k4"}}}, "trainer.algorithm.kl_kind: must be one of k1, k2, k3"),
    ({"trainer": {"learning_rate": None}}, "trainer.learning_rate: expected float, got None"),
    ({"trainer": {"checkpoint_dir": "gs://bucket/run"}}, "trainer.checkpoint_dir: must be a directory"),
])
def test_errors_name_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = replace_config(RunConfig(), {"run_id": "r1", "env_gateway": {"remotes": [{"address": "h:1", "env_names": ["x"]}]},
                                       "reward": {"plugins": [{"name": "p", "target": "m:f"}]}})
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Typed:
    level: Literal[1, 2] = 1
    cap: float | None = None
    name: str | int = "a"


def test_loader_checks_literal_and_optional_types_itself() -> None:
    assert from_dict(_Typed, {"level": 2, "cap": None, "name": 3}) == _Typed(level=2, cap=None, name=3)
    assert from_dict(_Typed, {"cap": 1}).cap == 1.0
    for data, message in [({"level": True}, "level: must be one of 1, 2, got True"),
                          ({"level": 3}, "level: must be one of 1, 2"),
                          ({"cap": "x"}, "cap: expected float, got 'x'"),
                          ({"name": 1.5}, "name: expected str or int, got 1.5")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            from_dict(_Typed, data)


def test_each_choice_list_is_declared_once() -> None:
    from arlo.model.config import _DTYPES
    from arlo.sandbox.isolation import KINDS

    assert get_args(Advantage) == ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
    assert KINDS == ("bwrap", "unshare", "none") and _DTYPES == ("float32", "bfloat16")


def test_one_run_id_rule_for_config_and_redis_keys() -> None:
    for bad in ("", "a b", "a*", "é"):
        with pytest.raises(ConfigError, match="run_id"):
            check_run_id(bad)
        with pytest.raises(ValueError, match="run_id"):
            Keys(bad)
    check_run_id("run-1_a.b")
    assert Keys("run-1_a.b").prefix == "arlo:run-1_a.b:"


def test_every_config_field_is_documented() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_docs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert gen_config_docs.undocumented() == []
    assert len(gen_config_docs.config_classes()) >= 19


def test_the_docs_generator_refuses_an_undocumented_field(tmp_path: Path) -> None:
    """Run against a copy of the tree whose config has one field without a docstring."""
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    (copy / "docs").mkdir()
    (copy / "scripts" / "gen_config_docs.py").write_text((ROOT / "scripts" / "gen_config_docs.py").read_text())
    doc = '    """Gradients are clipped to this global norm."""\n'
    pkg = copy / "arlo"
    shutil.copytree(ROOT / "arlo" / "config", pkg / "config", ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "__init__.py").write_text("")
    for name in ("jsonfields.py", "choices.py", "private_files.py"):
        (pkg / name).write_text((ROOT / "arlo" / name).read_text())
    trainer = pkg / "config" / "trainer.py"
    assert doc in trainer.read_text()
    trainer.write_text(trainer.read_text().replace(doc, ""))
    result = subprocess.run([sys.executable, str(copy / "scripts" / "gen_config_docs.py")], capture_output=True,
                            text=True, timeout=60, cwd=copy)
    assert result.returncode == 1 and "TrainerConfig.max_grad_norm" in result.stderr, result.stderr


def _float_fields(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every float setting under `cls` (nested sections included)."""
    out = []
    for name, tp in get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out += _float_fields(tp, (*prefix, name))
        elif tp is float or (get_origin(tp) in (Union, UnionType) and float in get_args(tp)):
            out.append((*prefix, name))
    return out


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_no_float_setting_takes_nan_or_infinity(value: float) -> None:
    """Every float setting, not the ones a range check happened to cover: NaN fails comparisons
    and so slipped past checks like `x > 0` as a value of no setting; an infinite
    `rollout.admission_poll_s` passed `> 0` and the gate's re-check never came."""
    paths = _float_fields(RunConfig)
    assert len(paths) > 30 and ("rollout", "admission_poll_s") in paths
    for path in paths:
        overrides: dict = {}
        node = overrides
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        with pytest.raises(ConfigError, match=rf"{re.escape('.'.join(path))}: must be a finite number"):
            load_config(overrides=overrides)


@pytest.mark.parametrize("path", ["rollout.admission_poll_s", "inference.weight_poll_s"])
def test_poll_intervals_are_bounded(path: str) -> None:
    """A fallback re-check rarer than 300 s never recovers a lost event; one more often than
    every 10 ms (1e-300: accepted before) is a busy loop on Redis."""
    section, name = path.split(".")
    for bad in (1e300, 300.0001, 1e-300, 0.0099, 0):
        with pytest.raises(ConfigError, match=rf"{path}: must be in \[0.01, 300\]"):
            load_config(overrides={section: {name: bad}})
    for good in (300, 0.01):
        assert getattr(getattr(load_config(overrides={section: {name: good}}), section), name) == float(good)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"trainer": {"learning_rate": 10**400}}, "trainer.learning_rate: must be a finite number"),
    ({"rollout": {"sampling": {"top_p": -(10**400)}}}, "rollout.sampling.top_p: must be a finite number"),
    ({"inference": {"max_batch": 10**400}}, "inference.max_batch: must be within"),
    ({"trainer": {"groups_per_step": 2**63}}, "trainer.groups_per_step: must be within"),
])
def test_integers_past_int64_are_refused_not_a_crash(overrides: dict, message: str) -> None:
    """A 400-digit integer for a float setting crashed the loader (OverflowError, a traceback);
    for an int setting it was accepted."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)
