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
