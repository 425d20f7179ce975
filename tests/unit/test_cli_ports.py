"""A -c config with port 0 (issue 33, item 4): `arlo up -c X` settles each 0 to a free port and
records it under $ARLO_HOME; `arlo train -c X`, `status -c X` and `export -c X` read those ports
back (they health-checked 127.0.0.1:0 and said "not serving"), and say so when no run is recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from arlo.app.local import SERVICE_SECTIONS, attach_cluster, load_cli_config, resolved_config_path
from arlo.app.ports import settled_ports
from arlo.config import ConfigError, dump_config, load_config, replace_config


def user_config(path: Path, run_id: str = "r1") -> Path:
    path.write_text(yaml.safe_dump({"run_id": run_id, **{name: {"server": {"port": 0, "metrics_port": 0}}
                                                           for name in SERVICE_SECTIONS}}))
    return path


def test_ports_0_are_read_back_from_the_run_arlo_up_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("ARLO_HOME", str(home))
    path = user_config(tmp_path / "run.yaml")
    cfg = load_config(path)
    recorded = replace_config(cfg, settled_ports(cfg, SERVICE_SECTIONS))  # what `arlo up -c run.yaml` records
    home.mkdir()
    dump_config(recorded, resolved_config_path(home))
    loaded = load_cli_config(str(path))
    for name in SERVICE_SECTIONS:
        assert getattr(loaded, name).server.port == getattr(recorded, name).server.port > 0
        assert getattr(loaded, name).server.metrics_port == getattr(recorded, name).server.metrics_port > 0
    # The rollout worker `arlo train -c` starts gets those ports too, not run.yaml's 0s.
    cluster = attach_cluster(loaded, None, config_path=str(path))
    assert cluster.config_path != path
    assert load_config(cluster.config_path).inference.server.port == recorded.inference.server.port


def test_ports_0_without_a_recorded_run_name_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("ARLO_HOME", str(home))
    path = user_config(tmp_path / "run.yaml")
    with pytest.raises(ConfigError, match=r"inference\.server\.port, trainer\.server\.port.* 0 .*no run "
                                          r"'r1' is recorded under ARLO_HOME"):
        load_cli_config(str(path))
    home.mkdir()  # another run's record is not this one's
    dump_config(load_config(user_config(tmp_path / "other.yaml", run_id="other")), resolved_config_path(home))
    with pytest.raises(ConfigError, match="no run 'r1' is recorded"):
        load_cli_config(str(path))


def test_set_ports_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARLO_HOME", str(tmp_path / "home"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run_id": "r1", "trainer": {"server": {"port": 45678}}}))
    assert load_cli_config(str(path)).trainer.server.port == 45678  # its metrics_port 0 is no error
    assert attach_cluster(load_cli_config(str(path)), None, config_path=str(path)).config_path == path.resolve()
