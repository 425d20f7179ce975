"""Whole groups only: incomplete groups wait, failed/stale/malformed groups are dropped as a whole."""

from __future__ import annotations

import numpy as np
import pytest

from arlo.proto.v1 import common_pb2
from services.trainer.batching import bucket_length, build_batch
from services.trainer.core.groups import GroupAssembler, poison_reason, validate_trajectory


def traj(group: str, *, size: int = 2, version: int = 0, reward: float = 1.0, n: int = 5,
         status: int = common_pb2.TRAJECTORY_STATUS_OK, tid: str = "") -> common_pb2.Trajectory:
    mask = [0, 0] + [1] * (n - 2)
    return common_pb2.Trajectory(
        id=tid or f"{group}-{np.random.randint(1 << 30)}", group_id=group, group_size=size,
        token_ids=list(range(n)), logprobs=[-0.5 * m for m in mask], loss_mask=mask,
        policy_versions=[version if m else -1 for m in mask], reward=reward, status=status)


def test_incomplete_group_waits_then_comes_out_whole() -> None:
    a = GroupAssembler(max_staleness=1)
    a.add([("1-0", traj("g"))])
    assert a.take_ready(0) == ([], [])
    a.add([("1-0", traj("g"))])  # re-delivered by XAUTOCLAIM: must not complete the group
    assert a.take_ready(0) == ([], [])
    a.add([("2-0", traj("g"))])
    ready, dropped = a.take_ready(0)
    assert len(ready) == 1 and len(ready[0].trajectories) == 2 and ready[0].entry_ids == ["1-0", "2-0"]
    assert dropped == []


def test_failed_member_masks_the_whole_group() -> None:
    a = GroupAssembler(max_staleness=1)
    a.add([("1-0", traj("g")), ("2-0", traj("g", status=common_pb2.TRAJECTORY_STATUS_ERROR))])
    ready, dropped = a.take_ready(0)
    assert ready == [] and dropped == ["1-0", "2-0"] and a.drops.failed == 2


def test_stale_group_dropped_and_counted() -> None:
    a = GroupAssembler(max_staleness=1)
    a.add([("1-0", traj("old", version=3)), ("2-0", traj("old", version=5)),
           ("3-0", traj("ok", version=4)), ("4-0", traj("ok", version=5))])
    ready, _ = a.take_ready(5)
    assert [g.trajectories[0].group_id for g in ready] == ["ok"] and a.drops.stale == 2


def test_malformed_member_drops_group() -> None:
    bad = traj("g")
    del bad.logprobs[:]
    a = GroupAssembler(max_staleness=0)
    a.add([("1-0", traj("g")), ("2-0", bad)])
    assert a.take_ready(0)[0] == [] and a.drops.malformed == 2


def test_build_batch_pads_right_to_a_bucket() -> None:
    groups = [[traj("a", n=5, reward=1.0), traj("a", n=9, reward=0.0)]]
    b = build_batch(groups, max_seq_len=256, pad_id=256)
    assert b.tokens_bt.shape == (2, 16)
    assert (b.tokens_bt[0, 5:] == 256).all() and b.mask_bt[0, 5:].sum() == 0
    assert b.num_tokens == 3 + 7
    np.testing.assert_array_equal(b.rewards_gk, [[1.0, 0.0]])


def test_bucket_length() -> None:
    assert [bucket_length(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


def test_the_longest_episode_is_a_bucket_so_no_batch_pads_past_it() -> None:
    # 16-token prompts + 32-token completions: 48, never 64 (a third more train-step work).
    assert [bucket_length(n, longest_episode=48) for n in (1, 17, 33, 48)] == [16, 32, 48, 48]
    # Rounded up to a multiple of 16 (TPU-friendly shapes); never above the power of two.
    assert bucket_length(100, longest_episode=100) == bucket_length(97, longest_episode=100) == 112
    assert bucket_length(64, longest_episode=64) == 64 and bucket_length(20, longest_episode=128) == 32
    # A row longer than the rollout's budget (another producer's) takes the power of two, as before.
    assert bucket_length(49, longest_episode=48) == 64
    groups = [[traj("a", n=40, reward=1.0), traj("a", n=45, reward=0.0)]]
    assert build_batch(groups, max_seq_len=256, pad_id=256, longest_episode=48).tokens_bt.shape == (2, 48)
    assert build_batch(groups, max_seq_len=256, pad_id=256).tokens_bt.shape == (2, 64)


def test_overlong_penalty_lowers_long_rewards() -> None:
    groups = [[traj("a", n=6, reward=1.0), traj("a", n=30, reward=1.0)]]  # 4 and 28 generated tokens
    b = build_batch(groups, max_seq_len=256, pad_id=256, overlong=(24, 8))
    np.testing.assert_allclose(b.rewards_gk, [[1.0, 0.0]])


def test_zero_variance_groups_are_recognised() -> None:
    from services.trainer.core.groups import ReadyGroup, has_reward_spread

    flat = ReadyGroup(trajectories=[traj("a", reward=1.0), traj("a", reward=1.0)], entry_ids=["1", "2"])
    spread = ReadyGroup(trajectories=[traj("b", reward=1.0), traj("b", reward=0.0)], entry_ids=["3", "4"])
    assert not has_reward_spread(flat) and has_reward_spread(spread)


def test_malformed_member_drops_its_group_at_once_and_later_members_on_arrival() -> None:
    bad = traj("g", size=3)
    del bad.logprobs[:]
    a = GroupAssembler(max_staleness=0)
    a.add([("1-0", traj("g", size=3)), ("2-0", bad)])
    # The malformed member itself goes to the dead-letter stream, with its reason; its mates are dropped.
    assert a.take_ready(0) == ([], ["1-0"]) and a.pending == {}
    assert [(eid, why) for eid, _, why in a.take_dead()] == [("2-0", validate_trajectory(bad))]
    a.add([("3-0", traj("g", size=3))])
    assert a.take_ready(0) == ([], ["3-0"]) and a.drops.malformed == 3 and a.pending == {}


def test_a_group_that_never_completes_is_dropped_as_failed_after_the_timeout() -> None:
    a = GroupAssembler(max_staleness=0, incomplete_timeout_s=30)
    a.add([("1-0", traj("orphan", size=4)), ("2-0", traj("orphan", size=4))], now=100.0)
    assert a.take_ready(0, now=129.0) == ([], [])
    assert a.take_ready(0, now=131.0) == ([], ["1-0", "2-0"]) and a.drops.failed == 2 and a.pending == {}
    a.add([("3-0", traj("orphan", size=4))], now=132.0)  # a straggler of the dropped group
    assert a.take_ready(0, now=132.0) == ([], ["3-0"]) and a.drops.failed == 3


def test_an_absurd_group_size_is_malformed_and_members_beyond_the_size_are_dropped() -> None:
    a = GroupAssembler(max_staleness=0)
    a.add([("1-0", traj("huge", size=100_000))])
    assert a.take_ready(0) == ([], []) and a.drops.malformed == 1
    assert [eid for eid, _, _ in a.take_dead()] == ["1-0"]
    a.add([("2-0", traj("g")), ("3-0", traj("g"))])
    ready, _ = a.take_ready(0)
    assert len(ready) == 1
    a.add([("4-0", traj("g"))])  # a third member of a group of two
    assert a.take_ready(0) == ([], ["4-0"]) and a.drops.failed == 1


def test_a_masked_group_counts_as_failed_not_malformed() -> None:
    masked = common_pb2.Trajectory(id="m0", group_id="g", group_size=2, status=common_pb2.TRAJECTORY_STATUS_ERROR)
    a = GroupAssembler(max_staleness=0)
    a.add([("1-0", masked), ("2-0", common_pb2.Trajectory(id="m1", group_id="g", group_size=2,
                                                          status=common_pb2.TRAJECTORY_STATUS_ERROR))])
    assert a.take_ready(0) == ([], ["1-0", "2-0"]) and a.drops.failed == 2 and a.drops.malformed == 0


@pytest.mark.parametrize(("change", "needle"), [
    ({"reward": float("nan")}, "reward"), ({"reward": float("-inf")}, "reward"),
    ({"components": float("inf")}, "component"), ({"logprob0": float("nan")}, "NaN logprob"),
    ({"logprob_last": float("-inf")}, "loss-masked"), ({"token0": 264}, "token id"), ({"token0": -1}, "token id"),
])
def test_poisoned_values_are_refused_with_a_reason_and_counted(change: dict, needle: str) -> None:
    import math

    bad = traj("g")
    for name, value in change.items():
        if name == "reward":
            bad.reward = value
        elif name == "components":
            bad.reward_components["x"] = value
        elif name == "logprob0":
            bad.logprobs[0] = value
        elif name == "logprob_last":
            bad.logprobs[-1] = value
        else:
            bad.token_ids[0] = value
    assert needle in (poison_reason(bad, vocab_size=264) or "")
    assert poison_reason(traj("g"), vocab_size=264) is None
    a = GroupAssembler(max_staleness=0, vocab_size=264)
    a.add([("1-0", bad), ("2-0", traj("g"))])
    assert a.take_ready(0) == ([], ["2-0"]) and a.drops.poisoned == 2
    assert [(eid, needle in why) for eid, _, why in a.take_dead()] == [("1-0", True)]
    ok = traj("h")
    ok.logprobs[0] = -math.inf  # -inf on a prompt token (mask 0) carries no weight: allowed
    assert poison_reason(ok, vocab_size=264) is None


def test_turn_rewards_become_a_per_token_array_at_each_turns_last_model_token() -> None:
    a = traj("g", n=8)
    a.turn_rewards.add(token_end=4, reward=0.25)
    a.turn_rewards.add(token_end=8, reward=1.0)
    b = traj("g", n=6)  # no turn rewards: a row of zeros
    batch = build_batch([[a, b]], max_seq_len=64, pad_id=0)
    assert batch.token_rewards_bt.shape == batch.mask_bt.shape and batch.token_rewards_bt.dtype == np.float32
    expected = np.zeros_like(batch.token_rewards_bt)
    expected[0, 3], expected[0, 7] = 0.25, 1.0
    np.testing.assert_array_equal(batch.token_rewards_bt, expected)
    cut = build_batch([[a, b]], max_seq_len=6, pad_id=0)  # the second turn is cut: its reward stays
    assert cut.token_rewards_bt[0, 5] == 1.0 and cut.token_rewards_bt[0].sum() == 1.25


def test_bad_turn_rewards_are_named() -> None:
    a = traj("g", n=5)
    a.turn_rewards.add(token_end=9, reward=0.0)
    assert "turn_rewards token_end" in validate_trajectory(a)
    b = traj("g", n=5)
    b.turn_rewards.add(token_end=3, reward=float("nan"))
    assert validate_trajectory(b) is None and "non-finite turn reward" in poison_reason(b, 0)
