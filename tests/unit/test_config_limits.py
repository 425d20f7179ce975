"""The episode budget against the contexts set beside it, at config load (issue 33)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from arlo.config import ConfigError, load_config


@pytest.mark.parametrize("section", ["model", "inference"])
def test_a_context_shorter_than_the_episode_budget_is_refused_naming_both(section: str) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.max_seq_len: 300 cannot hold an episode of "
                                          r"rollout\.max_episode_tokens \(600, its prompt included\)"):
        load_config(overrides={section: {"max_seq_len": 300}, "rollout": {"max_episode_tokens": 600}})
    # The tiny preset's own table holds 256 positions: model.max_seq_len raises it.
    load_config(overrides={"model": {"max_seq_len": 600}, section: {"max_seq_len": 600},
                           "rollout": {"max_episode_tokens": 600}})


def test_a_preset_context_is_raised_by_model_max_seq_len_and_its_own_length_is_checked() -> None:
    """A 16k-token episode on the `small` preset (1,024 positions of its own, RoPE): model.max_seq_len
    raises the context every service builds; left unset, the config refuses the episode naming the
    field, instead of each engine capping the context at 1,024 and refusing turns mid-run."""
    with pytest.raises(ConfigError, match=r"model\.max_seq_len: unset, the preset 'small' holds 1024 "
                                          r"positions.*rollout\.max_episode_tokens \(16384\)"):
        load_config(overrides={"model": {"name": "small"}, "rollout": {"max_episode_tokens": 16384}})
    with pytest.raises(ConfigError, match=r"inference\.max_seq_len: 8192 cannot hold"):
        load_config(overrides={"model": {"name": "small", "max_seq_len": 16384},
                               "inference": {"max_seq_len": 8192}, "rollout": {"max_episode_tokens": 16384}})
    cfg = load_config(overrides={"model": {"name": "small", "max_seq_len": 16384},
                                 "rollout": {"max_episode_tokens": 16384}})
    assert cfg.model_source().cfg.max_seq_len == 16384
    # Lowering works as before.
    assert load_config(overrides={"model": {"name": "small", "max_seq_len": 512}}).model_source().cfg.max_seq_len == 512


def test_a_checkpoint_context_is_capped_never_raised(tmp_path: Path) -> None:
    """A checkpoint's weights were trained up to its max_position_embeddings (512 here): model.max_seq_len
    only caps it, and an episode budget past it is refused naming model.path."""
    pytest.importorskip("transformers")
    from tests.support.hf_checkpoints import write_checkpoint

    model_dir = write_checkpoint(tmp_path / "qwen2", "qwen2")
    cfg = load_config(overrides={"model": {"path": str(model_dir), "max_seq_len": 4096}})
    assert cfg.model_source().cfg.max_seq_len == 512
    capped = load_config(overrides={"model": {"path": str(model_dir), "max_seq_len": 300}})
    assert capped.model_source().cfg.max_seq_len == 300
    with pytest.raises(ConfigError, match=r"model\.path: .*max_position_embeddings \(512\) cannot hold an "
                                          r"episode of rollout\.max_episode_tokens \(1024\)"):
        load_config(overrides={"model": {"path": str(model_dir)}, "rollout": {"max_episode_tokens": 1024}})


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


def test_a_page_longer_than_the_sequence_is_the_dense_layout_not_more_memory() -> None:
    """A 64-position page over 32-position sequences allocated 1.6x the dense memory and shared
    nothing; the page is capped at the sequence's length (slot + one decode chunk)."""
    from arlo.config import InferenceConfig
    from arlo.model.config import ModelConfig
    from arlo.model.kv_budget import kv_layout

    cfg = ModelConfig.named("tiny")
    short = dataclasses.replace(cfg, max_seq_len=32)
    paged = kv_layout(InferenceConfig(page_size=64, max_batch=8, max_n=1, decode_steps=8), short)
    dense = kv_layout(InferenceConfig(page_size=0, max_batch=8, max_n=1, decode_steps=8), short)
    assert (paged.page_size, paged.pages) == (dense.page_size, dense.pages) == (40, 8)
