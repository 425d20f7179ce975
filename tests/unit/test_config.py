"""Run config: defaults valid, errors name the field, YAML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from arlo.config import ConfigError, RunConfig, dump_config, load_config, replace_config


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
