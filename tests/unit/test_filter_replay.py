"""Filter replay's pieces (arlo/filter_replay.py): the wire format, which settings record kept
sets, a trajectory's record assembled from its turns, its placement in a batch, and the checks
that refuse a record that would score a token over a set that never sampled it. Through the
services: tests/contract/test_filter_replay_services.py; against the engine: test_trainer_bf16_logprobs.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arlo.filter_replay as fr
import arlo.model.sampling as sampling
from arlo.config import load_config
from arlo.model.logprobs import SampledTargets, chunked_token_logprobs, sampled_token_logprobs_and_outside
from arlo.proto.v1 import common_pb2
from services.rollout.agent import Turn, _Builder
from services.trainer.batching import build_batch
from services.trainer.core.groups import validate_trajectory


def test_the_mirrored_constants_match_the_sampler() -> None:
    assert (fr.GREEDY_BELOW, fr.LOGPROB_FLOOR) == (sampling.GREEDY_BELOW, sampling.LOGPROB_FLOOR)


def test_which_settings_record_kept_sets() -> None:
    assert fr.kept_width(temperature=1.0, top_k=5) == 5
    assert fr.kept_width(temperature=0.0, top_k=5) == 0  # greedy: nothing filtered
    assert fr.kept_width(temperature=1.0, top_k=0) == 0  # top-p alone: unbounded sets
    assert fr.kept_width(temperature=1.0, top_k=fr.MAX_KEPT_WIDTH + 1) == 0
    # The proto carries a float32: the server sees 1e-5 as 9.99999975e-06 and must agree with the rollout.
    assert fr.kept_width(temperature=float(np.float32(1e-5)), top_k=5) == fr.kept_width(temperature=1e-5, top_k=5) == 5
    cfg = load_config(overrides={"rollout": {"sampling": {"top_k": 8}}})
    assert cfg.inference.max_top_logprobs == 0 and fr.serving_inference(cfg).max_top_logprobs == 8
    assert fr.run_kept_width(cfg) == 8
    packed = load_config(overrides={"rollout": {"sampling": {"top_k": 8}}, "trainer": {"pack": True}})
    assert fr.run_kept_width(packed) == 0  # packed rows carry none: nothing asked, nothing compiled
    shared = load_config(overrides={"inference": {"runs": ["other"]}, "trainer": {"lora": {"rank": 4}}})  # unknown samplings
    assert fr.serving_inference(shared).max_top_logprobs == fr.MAX_KEPT_WIDTH


def test_the_wire_format_round_trips_and_refuses_a_wrong_size() -> None:
    ids = np.asarray([[7, 3, fr.NOT_KEPT], [1, 2, 9]], np.int32)
    assert np.array_equal(fr.unpack_kept(fr.pack_kept(ids), tokens=2, width=3), ids)
    with pytest.raises(ValueError, match="2 model tokens x 4 ids"):
        fr.unpack_kept(fr.pack_kept(ids), tokens=2, width=4)
    top_ids = np.asarray([[7, 3, 5]], np.int32)
    top_lps = np.asarray([[-0.1, -2.0, fr.LOGPROB_FLOOR]], np.float32)  # the third was filtered out
    assert fr.kept_ids(top_ids, top_lps, 3).tolist() == [[7, 3, fr.NOT_KEPT]]


def turn(tokens: list[int], kept: bytes) -> Turn:
    return Turn(token_ids=tokens, logprobs=[-1.0] * len(tokens), policy_versions=[0] * len(tokens),
                finished_by_stop=True, kept_token_ids=kept)


def test_a_trajectory_carries_kept_sets_only_when_every_model_turn_has_them() -> None:
    one = fr.pack_kept(np.asarray([[4, 5]], np.int32))
    two = fr.pack_kept(np.asarray([[6, 1], [7, fr.NOT_KEPT]], np.int32))
    b = _Builder()
    b.add_model(turn([4], one))
    b.add_context([100, 101])
    b.add_model(turn([6, 7], two))
    assert b.kept_token_ids() == one + two
    b.add_model(turn([9], b""))  # a generator that recorded none
    assert b.kept_token_ids() == b""
    odd = _Builder()
    odd.add_model(turn([4], one))
    odd.add_model(turn([6, 7], fr.pack_kept(np.asarray([[6], [7]], np.int32))))  # another width
    assert odd.kept_token_ids() == b""


def trajectory(kept: np.ndarray) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        id="t", group_id="g", group_size=1, token_ids=[1, 2, 3, 4, 5], logprobs=[0.0, 0.0, -1.0, 0.0, -1.0],
        loss_mask=[0, 0, 1, 0, 1], policy_versions=[-1, -1, 0, -1, 0], reward=1.0,
        status=common_pb2.TRAJECTORY_STATUS_OK, kept_token_ids=fr.pack_kept(kept))


def test_a_record_that_does_not_hold_its_token_or_has_the_wrong_size_is_malformed() -> None:
    good = np.asarray([[3, 8], [5, fr.NOT_KEPT]], np.int32)
    assert validate_trajectory(trajectory(good), kept_width=2) is None
    missing = np.asarray([[3, 8], [6, 7]], np.int32)  # token 5, at position 4, is in neither
    assert "model token 4 is not in the kept set" in validate_trajectory(trajectory(missing), kept_width=2)
    assert "x 3 ids" in validate_trajectory(trajectory(good), kept_width=3)
    assert validate_trajectory(trajectory(good), kept_width=0) is None  # replay off: the record is ignored
    # An id past the vocabulary would gather NaN and sink the step; a set holding an id twice was never kept.
    past = np.asarray([[3, 300], [5, fr.NOT_KEPT]], np.int32)
    assert "outside [0, 256)" in validate_trajectory(trajectory(past), kept_width=2, vocab_size=256)
    assert "outside" in validate_trajectory(trajectory(np.asarray([[3, -7], [5, 1]], np.int32)), kept_width=2)
    twice = np.asarray([[3, 3], [5, fr.NOT_KEPT]], np.int32)
    assert "twice" in validate_trajectory(trajectory(twice), kept_width=2)


def test_a_batch_places_each_kept_set_at_its_token() -> None:
    kept = np.asarray([[3, 8], [5, fr.NOT_KEPT]], np.int32)
    batch = build_batch([[trajectory(kept)]], max_seq_len=64, pad_id=0, kept_width=2)
    assert batch.kept_btk is not None and batch.kept_btk.shape == (1, 16, 2)
    assert batch.kept_btk[0, 2].tolist() == [3, 8] and batch.kept_btk[0, 4].tolist() == [5, fr.NOT_KEPT]
    assert (batch.kept_btk[0, [0, 1, 3, *range(5, 16)]] == fr.NOT_KEPT).all()
    assert build_batch([[trajectory(kept)]], max_seq_len=64, pad_id=0).kept_btk is None  # replay off
    # Replay on, nothing recorded (a black-box agent's run): still an array, so the step is the warmed one.
    bare = common_pb2.Trajectory()
    bare.CopyFrom(trajectory(kept))
    bare.ClearField("kept_token_ids")
    empty = build_batch([[bare]], max_seq_len=64, pad_id=0, kept_width=2).kept_btk
    assert empty is not None and (empty == fr.NOT_KEPT).all()


def test_a_recorded_set_decides_membership_and_chunking_changes_nothing() -> None:
    """Position 0's recorded set is {2, 3}: the target 2 is scored over exactly those two even though
    the own top-2 filter ({0, 1}) would leave it out; position 1 has no record (own filter)."""
    logits = jnp.asarray([[[4.0, 3.0, 2.9, 2.8, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 0.0, 0.0, 0.5]]])
    ids = jnp.asarray([[2, 4, 4]])
    kept = jnp.asarray([[[2, 3], [fr.NOT_KEPT, fr.NOT_KEPT], [0, 4]]])
    knobs = {"temperature": 1.0, "top_k": 2, "top_p": 1.0, "min_p": 0.0}
    own_lp, own_out = sampled_token_logprobs_and_outside(logits, ids, **knobs)
    lp, out = sampled_token_logprobs_and_outside(logits, SampledTargets(ids, kept), **knobs)
    assert bool(own_out[0, 0]) and not bool(out[0, 0])
    assert float(lp[0, 0]) == pytest.approx(2.9 - float(jnp.logaddexp(2.9, 2.8)), abs=1e-6)
    assert float(lp[0, 1]) == pytest.approx(float(own_lp[0, 1])) and not bool(out[0, 1])

    class Head:  # the hidden state is the logits: chunking must cut the kept sets with the targets
        def logits_from_hidden(self, h):
            return h

    fn = jax.tree_util.Partial(sampled_token_logprobs_and_outside, **knobs)
    for chunk in (1, 2):  # 2: three positions, the last chunk padded
        chunked = chunked_token_logprobs(Head(), logits, SampledTargets(ids, kept), chunk, fn)
        assert np.allclose(chunked[0], lp) and np.array_equal(chunked[1], out)
