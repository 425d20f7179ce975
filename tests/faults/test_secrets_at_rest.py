"""Secrets at rest: the token and the resolved config (redis.url may hold a password) are 0600
from the moment they exist, and $ARLO_HOME is 0700. A watcher thread stats every file it can
see while they are written: write-then-chmod showed it a readable token 3 times in 5."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from arlo.app.local import prepare_cluster
from arlo.config import dump_config, load_config
from arlo.private_files import private_dir, write_private


def _watch(directory: Path, stop: threading.Event, seen: list[tuple[str, int]]) -> None:
    while not stop.is_set():
        for entry in os.scandir(directory):
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue  # a temporary renamed away between listing and stat
            if stat.S_ISREG(mode):
                seen.append((entry.name, stat.S_IMODE(mode)))


def test_no_secret_file_is_ever_readable_by_others(tmp_path: Path) -> None:
    home = private_dir(tmp_path / "home")
    cfg = load_config(overrides={"redis": {"url": "redis://:hunter2@127.0.0.1:6379/0"}})
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch, args=(home, stop, seen), daemon=True)
    old = os.umask(0o022)  # the usual umask: plain creation would give 0644
    try:
        watcher.start()
        for i in range(200):
            write_private(home / "token", f"secret-{i}")
            dump_config(cfg, home / "config.yaml")
    finally:
        stop.set()
        watcher.join()
        os.umask(old)
    assert seen, "the watcher saw no file"
    assert {mode for _, mode in seen} == {0o600}, sorted(set(seen))[:5]
    assert sorted(os.listdir(home)) == ["config.yaml", "token"]  # no temporary left behind
    assert (home / "token").read_text() == "secret-199"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_prepare_cluster_makes_home_0700_and_its_secrets_0600(tmp_path: Path, redis_url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARLO_TOKEN", raising=False)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # an existing, world-readable $ARLO_HOME is tightened
    cfg = load_config(overrides={"redis": {"url": redis_url}})
    cluster = prepare_cluster(cfg, home=home, free_ports=False)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for path in (home / "token", cluster.config_path):
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600, path
    assert (home / "token").read_text() == cluster.token


def test_local_runs_checkpoint_by_default_under_arlo_home(tmp_path: Path, redis_url: str) -> None:
    """Without checkpoints a restarted trainer forgets what it learned (issue 16): `arlo up`/`demo`
    set them under $ARLO_HOME unless configured, and a fresh (demo) run drops the old ones."""
    from arlo.app.local import DEFAULT_CHECKPOINT_EVERY

    home = tmp_path / "home"
    cfg = load_config(overrides={"redis": {"url": redis_url}, "run_id": "ckpt-default"})
    stale = home / "checkpoints" / "ckpt-default" / "00000007"
    stale.mkdir(parents=True)
    cluster = prepare_cluster(cfg, home=home, free_ports=False, fresh_run=True)
    assert cluster.cfg.trainer.checkpoint_dir == str(home / "checkpoints" / "ckpt-default")
    assert cluster.cfg.trainer.checkpoint_every == DEFAULT_CHECKPOINT_EVERY and not stale.exists()
    mine = load_config(overrides={"redis": {"url": redis_url}, "run_id": "ckpt-default",
                                  "trainer": {"checkpoint_dir": str(tmp_path / "mine"), "checkpoint_every": 3}})
    kept = prepare_cluster(mine, home=home, free_ports=False).cfg.trainer
    assert (kept.checkpoint_dir, kept.checkpoint_every) == (str(tmp_path / "mine"), 3)
