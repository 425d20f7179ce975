"""Sequence packing (trainer.pack): the packer's layout, the segment mask, and the reference test:
the packed RL step's loss and gradient are the padded step's on the same batch (float32)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from arlo.config import AlgorithmConfig, ConfigError, TrainerConfig
from arlo.model import ModelConfig, create_model
from arlo.model.source import ModelSource
from arlo.model.transformer import segment_mask_bts
from arlo.proto.v1 import common_pb2
from services.trainer.batching import build_batch
from services.trainer.learner import Learner, _rl_step
from services.trainer.packing import first_fit_decreasing, pack_rows, padding_fraction, trained_lengths

TINY = ModelConfig.named("tiny")


def uneven_groups(lengths: list[list[int]], seed: int = 0) -> list[list[common_pb2.Trajectory]]:
    """Groups of trajectories of the given total lengths: a 3-token prompt, then model tokens
    with an observation (mask 0) in the middle of the longer ones, and a trailing observation on
    some (context after the last model token, which packing leaves out)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, sizes in enumerate(lengths):
        members = []
        for k, n in enumerate(sizes):
            mask = [0] * 3 + [1] * (n - 3)
            if n > 12:
                mask[n // 2: n // 2 + 3] = [0, 0, 0]
            if k % 2:
                mask[-1] = 0
            ids = [int(x) for x in rng.integers(0, 256, n)]
            logprobs = [float(x) if m else 0.0 for x, m in zip(rng.normal(-3, 0.3, n), mask, strict=True)]
            members.append(common_pb2.Trajectory(
                id=f"{g}-{k}", group_id=f"g{g}", group_size=len(sizes), token_ids=ids, logprobs=logprobs,
                loss_mask=mask, policy_versions=[-1 if m == 0 else 0 for m in mask], reward=float(rng.integers(0, 2))))
        groups.append(members)
    return groups


LENGTHS = [[60, 9, 14, 7], [33, 5, 20, 11], [8, 40, 6, 17]]  # bucket 64: 12 rows padded, 4 packed


def test_first_fit_decreasing_places_every_length_once_within_its_row() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = [int(x) for x in rng.integers(0, 65, int(rng.integers(1, 30)))]
        placement = first_fit_decreasing(lengths, 64)
        fill = np.zeros((placement.rows, 64), np.int32)
        for (row, offset), n in zip(placement.slots, lengths, strict=True):
            if n:
                fill[row, offset:offset + n] += 1
            else:
                assert row == -1
        assert fill.max(initial=0) <= 1  # no overlap and nothing past the row's end
        assert fill.sum() == sum(lengths)
        assert placement.rows <= -(-sum(lengths) * 11 // (9 * 64)) + 1  # FFD's bound over the optimum
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([65], 64)


def test_pack_rows_keeps_each_episode_whole_contiguous_and_at_its_own_positions() -> None:
    batch = build_batch(uneven_groups(LENGTHS), 256, 256)
    packed = pack_rows(batch.tokens_bt, batch.mask_bt)
    lengths = trained_lengths(batch.mask_bt)
    assert packed.tokens_pl.shape == (4, 64) and batch.tokens_bt.shape == (12, 64)
    seen = 0
    for row in range(packed.tokens_pl.shape[0]):
        segments = packed.segment_ids_pl[row]
        ids = [int(s) for s in segments if s]
        # Contiguous runs numbered 1, 2, ... in order, padding only at the end.
        assert ids == sorted(ids) and set(ids) == set(range(1, max(ids) + 1))
        assert (segments[len(ids):] == 0).all()
        for s in set(ids):
            cols = np.flatnonzero(segments == s)
            assert (np.diff(cols) == 1).all()
            assert (packed.positions_pl[row, cols] == np.arange(len(cols))).all()
            seen += len(cols)
    assert seen == lengths.sum()
    # Every target an episode trains on is read from its own place, with the same token.
    flat_targets = packed.tokens_pl[:, 1:].reshape(-1)
    for e, n in enumerate(lengths):
        np.testing.assert_array_equal(flat_targets[packed.index_bt[e, :n - 1]], batch.tokens_bt[e, 1:n])
    assert packed.count_pl.sum() == batch.mask_bt[:, 1:].sum()
    assert padding_fraction(lengths, 4, 64) < padding_fraction(lengths, 12, 64)


def test_segment_mask_never_crosses_an_episode_and_padding_sees_nothing() -> None:
    segments = jnp.asarray([[1, 1, 2, 2, 2, 0]])
    mask = np.asarray(jnp.tril(jnp.ones((6, 6), bool))[None] & segment_mask_bts(segments))[0]
    expected = np.zeros((6, 6), bool)
    expected[0, 0] = expected[1, :2] = True
    expected[2, 2] = expected[3, 2:4] = expected[4, 2:5] = True
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("cfg", [TINY, dataclasses.replace(
    TINY, sliding_window=4, layer_types=("sliding_attention", "full_attention"), post_norms=True)],
    ids=["tiny", "sliding_window"])
def test_packed_forward_is_each_episode_alone(cfg: ModelConfig) -> None:
    """Two episodes in one row give each the hidden states it has alone: no attention crosses
    (the second's tokens change nothing of the first's, and vice versa), RoPE restarts, and a
    sliding window counts the episode's own positions."""
    model = create_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 7), rng.integers(0, 256, 9)
    row = jnp.asarray(np.concatenate([a, b, [0, 0]])[None], jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 9 + [0, 0]])
    positions = jnp.asarray([list(range(7)) + list(range(9)) + [0, 0]])
    packed = np.asarray(model.hidden(row, segment_ids_bt=segments, positions_bt=positions))[0]
    alone_a = np.asarray(model.hidden(jnp.asarray(a[None], jnp.int32)))[0]
    alone_b = np.asarray(model.hidden(jnp.asarray(b[None], jnp.int32)))[0]
    np.testing.assert_allclose(packed[:7], alone_a, atol=1e-5)
    np.testing.assert_allclose(packed[7:16], alone_b, atol=1e-5)
    # Without the segments the second episode does see the first: the mask is what separates them.
    mixed = np.asarray(model.hidden(row, positions_bt=positions))[0]
    assert np.abs(mixed[7:16] - alone_b).max() > 1e-3


def rl_step(tc: TrainerConfig, groups: list[list[common_pb2.Trajectory]],
            source: ModelSource | None = None) -> tuple[dict, list[np.ndarray]]:
    """One plain-SGD step (lr 1) of the learner's own step function: (its metrics, -gradient).
    Adam would normalise the gradient and hide or magnify float noise."""
    learner = Learner(source or ModelSource.from_config(TINY, seed=0), cfg=tc)
    batch = build_batch(groups, 256, 256)
    tx = optax.sgd(1.0)
    before = jax.tree.leaves(jax.device_get(nnx.to_pure_dict(learner.state)))
    step = jax.jit(functools.partial(_rl_step, learner.graphdef, tx, tc, "float32", learner.sampling),
                   static_argnums=(6,))
    rewards, rows = learner.device_inputs(batch, mini_batches=1)
    if tc.pack:  # the forward really ran on fewer rows than the batch has
        assert rows["packed_tokens_bt"].shape[1] < rows["tokens_bt"].shape[1]
    after, _, metrics = step(learner.state, tx.init(learner.state), learner.ref_state, rows, jnp.asarray(rewards),
                             jax.random.key_data(jax.random.key(0)), 1)
    update = [b - a for a, b in zip(before, jax.tree.leaves(jax.device_get(nnx.to_pure_dict(after))), strict=True)]
    return jax.device_get(metrics), update


@pytest.mark.parametrize("algorithm,trainer", [
    ({"kl_coef": 0.1, "entropy_coef": 0.01}, {}),
    ({"kl_coef": 0.1, "kl_in_reward": True, "aggregation": "seq_mean_token_mean", "ratio_level": "sequence"},
     {"micro_batch_size": 5, "ppo_epochs": 2, "logprob_chunk": 8}),
], ids=["grpo_kl_entropy", "gspo_kl_in_reward_micro_batches"])
def test_packed_step_matches_the_padded_step(algorithm: dict, trainer: dict) -> None:
    tc = TrainerConfig(algorithm=AlgorithmConfig(**algorithm), **trainer)
    padded_metrics = assert_same_step(tc, uneven_groups(LENGTHS))
    if algorithm.get("entropy_coef"):
        assert padded_metrics["entropy"] > 0 and "kl_ref" in padded_metrics


def assert_same_step(tc: TrainerConfig, groups: list[list[common_pb2.Trajectory]],
                     source: ModelSource | None = None) -> dict:
    padded_metrics, padded = rl_step(tc, groups, source)
    packed_metrics, packed = rl_step(dataclasses.replace(tc, pack=True), groups, source)
    assert set(packed_metrics) == set(padded_metrics)
    # 1e-6 absolute, relative past magnitude 1 (a float32 grad norm of 1,000 moves by 1e-4 a ulp).
    for name, value in padded_metrics.items():
        assert abs(float(packed_metrics[name]) - float(value)) <= 1e-6 * max(1.0, abs(float(value))), name
    largest = max(float(np.abs(a).max()) for a in padded)
    assert max(float(np.abs(a - b).max()) for a, b in zip(padded, packed, strict=True)) <= 1e-6 * max(1.0, largest)
    assert largest > 1e-3  # the step did something
    return padded_metrics


def test_packed_step_matches_the_padded_step_with_routed_experts(tmp_path) -> None:
    """Qwen3-MoE with the routers' load-balancing loss: packed, it counts the same tokens."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from arlo.model.source import resolve_model
    from tests.support.hf_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path, "qwen3_moe")
    source = resolve_model(name="tiny", path=str(path), tokenizer="", seed=0, max_seq_len=256)
    metrics = assert_same_step(TrainerConfig(router_aux_loss_coef=1.0), uneven_groups(LENGTHS), source)
    assert metrics["router_aux_loss"] > 1.0


def test_pack_is_refused_with_gae_and_with_mini_batches() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.pack"):
        TrainerConfig(pack=True, algorithm=AlgorithmConfig(advantage="gae")).validate("trainer")
    with pytest.raises(ConfigError, match=r"trainer\.pack"):
        TrainerConfig(pack=True, mini_batches=2).validate("trainer")
    with pytest.raises(ValueError, match=r"trainer\.pack"):
        Learner(ModelSource.from_config(TINY, seed=0), cfg=TrainerConfig(pack=True, mini_batches=2))


def test_learner_step_trains_packed_with_the_padded_loss() -> None:
    """Through Learner.step (the jitted, donated step the trainer runs), AdamW and all."""
    batch = build_batch(uneven_groups(LENGTHS, seed=3), 256, 256)
    results = []
    for pack in (False, True):
        learner = Learner(ModelSource.from_config(TINY, seed=0), cfg=TrainerConfig(pack=pack, micro_batch_size=6))
        results.append([learner.step(batch) for _ in range(2)])
    (padded, padded_next), (packed, packed_next) = results
    assert not packed.skipped and packed.num_tokens == padded.num_tokens
    assert abs(packed.loss - padded.loss) <= 1e-6 and abs(packed.grad_norm - padded.grad_norm) <= 1e-6
    # After an AdamW update (which rounds gradient entries near 0 to +-lr either way) loosely.
    assert not packed_next.skipped and packed_next.loss != packed.loss
    assert abs(packed_next.loss - padded_next.loss) <= 1e-4
