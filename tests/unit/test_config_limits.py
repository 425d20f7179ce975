"""The episode budget against the contexts set beside it, at config load (issue 33)."""

from __future__ import annotations

import pytest

from arlo.config import ConfigError, load_config


@pytest.mark.parametrize("section", ["model", "inference"])
def test_a_context_shorter_than_the_episode_budget_is_refused_naming_both(section: str) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.max_seq_len: 300 cannot hold an episode of "
                                          r"rollout\.max_episode_tokens \(600, its prompt included\)"):
        load_config(overrides={section: {"max_seq_len": 300}, "rollout": {"max_episode_tokens": 600}})
    load_config(overrides={section: {"max_seq_len": 600}, "rollout": {"max_episode_tokens": 600}})


@pytest.mark.parametrize(("backlog", "groups", "size", "ok"), [
    (16, 4, 4, False), (16, 1, 4, True), (16, 2, 2, True), (64, 4, 4, True), (64, 8, 4, False), (4096, 8, 8, True)])
def test_a_backlog_that_could_stall_the_run_is_refused_naming_the_fields(backlog: int, groups: int, size: int,
                                                                          ok: bool) -> None:
    """Issue 33, item 8: backlog 64 with 4x4 groups per step stalled for good once held entries
    filled it; the trainer now checkpoints at half the backlog, which needs room for 2 more steps."""
    overrides = {"redis": {"max_backlog": backlog}, "trainer": {"groups_per_step": groups},
                 "rollout": {"group_size": size}}
    if ok:
        load_config(overrides=overrides)
        return
    with pytest.raises(ConfigError, match=r"redis.max_backlog: .*trainer.groups_per_step x rollout.group_size"):
        load_config(overrides=overrides)


def test_a_kv_budget_that_cannot_hold_one_request_is_refused_at_load_naming_the_fields() -> None:
    """Issue 36, item 6: the engine refused such a budget only when it started; the config says so
    when it loads, with the least budget that holds inference.max_n full-length sequences."""
    base = {"inference": {"max_n": 8, "max_seq_len": 4096, "page_size": 64}, "model": {"max_seq_len": 0}}
    with pytest.raises(ConfigError, match=r"inference\.kv_cache_mib: .* cannot hold n = 8 \(inference\.max_n\) "
                                          r"sequences of \d+ positions .*raise it to at least \d+"):
        load_config(overrides={**base, "inference": {**base["inference"], "kv_cache_mib": 0.5}})
    load_config(overrides={**base, "inference": {**base["inference"], "kv_cache_mib": 64}})
