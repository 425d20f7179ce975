"""The trainer's warm-up compiles the RL step for each batch length ahead of time: the first real
step of that shape then compiles nothing, and the weights are those the learner started with."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from arlo.compile_watch import CompileWatch
from arlo.config import SamplingConfig, SFTConfig, TrainerConfig
from arlo.filter_replay import NOT_KEPT, pack_kept
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2
from services.trainer.batching import bucket_length, build_batch, trained_length
from services.trainer.learner import Learner
from services.trainer.sft import Example, batch_lengths
from services.trainer.warmstart import WarmStart
from services.trainer.warmup import length_buckets, warm_up_learner, warm_up_sft


def test_length_buckets_cover_every_episode_length() -> None:
    assert length_buckets(32, 128) == [16, 32]
    assert length_buckets(33, 128) == [16, 32, 48]  # 33 rounded up to a multiple of 16
    assert length_buckets(1000, 100) == [16, 32, 64, 100]  # cut at the model's context, as build_batch does
    assert length_buckets(48, 128) == [16, 32, 48]  # the longest episode is a bucket: nothing pads to 64
    assert length_buckets(100, 1024) == [16, 32, 64, 112]
    # Every length build_batch can give an episode within the budget is among them.
    for budget in (17, 48, 100, 256):
        lengths = set(length_buckets(budget, 128))
        assert {min(bucket_length(n, longest_episode=budget), 128) for n in range(1, budget + 1)} <= lengths


def test_trailing_context_is_not_trained_on_so_it_takes_no_bucket() -> None:
    traj = common_pb2.Trajectory(token_ids=list(range(17)), loss_mask=[0] * 4 + [1] * 12 + [0],
                                 logprobs=[0.0] * 17, policy_versions=[0] * 17)
    assert trained_length(traj) == 16  # the closing end-of-turn (context) falls off
    assert build_batch([[traj]], 128, 0).tokens_bt.shape == (1, 16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("top_k", [0, 5])
def test_a_warmed_length_steps_without_compiling(top_k: int) -> None:
    """top_k 5: every batch carries the sampler's kept sets (filter replay), so the warm-up must too."""
    sampling = SamplingConfig(temperature=1.0, top_k=top_k)
    learner = Learner(preset_source("tiny"), cfg=TrainerConfig(groups_per_step=1), sampling=sampling)
    before = [np.asarray(x) for x in jax.tree.leaves(learner.state)]
    watch = CompileWatch().install()
    try:
        assert warm_up_learner(learner, lengths=[16], groups=1, group_size=2, kept_width=top_k) == 1
        assert all(np.array_equal(a, np.asarray(b))
                   for a, b in zip(before, jax.tree.leaves(learner.state), strict=True))
        watch.mark_warm()
        kept = pack_kept(np.asarray([[t] + [NOT_KEPT] * (top_k - 1) for t in (3, 4, 5)], np.int32)) if top_k else b""
        trajs = [common_pb2.Trajectory(token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 1], reward=r,
                                       logprobs=[0.0, 0.0, -1.0, -1.0, -1.0], policy_versions=[-1, -1, 0, 0, 0],
                                       kept_token_ids=kept)
                 for r in (0.0, 1.0)]
        batch = build_batch([trajs], learner.model_cfg.max_seq_len, 0, kept_width=top_k)
        assert (batch.kept_btk is not None) == bool(top_k)
        metrics = learner.step(batch)
        assert not metrics.skipped and watch.late == 0, list(watch.late_names)
    finally:
        watch.close()


@pytest.mark.timeout(300)
def test_the_sft_warm_start_steps_without_compiling(tmp_path) -> None:
    """The SFT step is warmed for every length the warm start's batches can take (it compiled on
    the first SFT step, logged as late, while the demo's services already served)."""
    rows = [{"messages": [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "a" * n}]}
            for n in (2, 5, 9, 20, 40)]  # lengths over several buckets
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    learner = Learner(preset_source("tiny"), cfg=TrainerConfig(groups_per_step=1))
    warm = WarmStart(SFTConfig(data=str(data), steps=8, batch_size=2), preset_source("tiny").tokenizer(),
                     max_seq_len=learner.model_cfg.max_seq_len)
    assert len(warm.batch_lengths) >= 2, warm.batch_lengths
    watch = CompileWatch().install()
    try:
        assert warm_up_sft(learner, lengths=warm.batch_lengths, rows=warm.batch_size) == len(warm.batch_lengths)
        watch.mark_warm()
        seen = set()
        for _ in range(20):  # every pairing of the shuffled demonstrations comes up
            batch = warm.next_batch()
            seen.add(batch.tokens_bt.shape[1])
            learner.sft_step(batch)
        assert seen <= set(warm.batch_lengths) and len(seen) >= 2, (seen, warm.batch_lengths)
        assert watch.late == 0, list(watch.late_names)
    finally:
        watch.close()


def test_sft_batch_lengths_cover_every_batch() -> None:
    examples = [Example(token_ids=[0] * n, loss_mask=[1] * n) for n in (3, 17, 40, 200)]
    assert batch_lengths(examples, 128) == [16, 32, 64, 128]
    assert batch_lengths(examples[:2], 1024) == [16, 32]
    assert batch_lengths([Example(token_ids=[0] * 5, loss_mask=[1] * 5)], 12) == [12]  # cut at the context
