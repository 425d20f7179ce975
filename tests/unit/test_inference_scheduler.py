"""The continuous-batching scheduler without a model (vLLM's create_scheduler idea): slots,
queueing, fairness, prefill budget, aborts, and session parking/eviction."""

from __future__ import annotations

import itertools

import pytest

from services.inference.requests import SamplingRequest
from services.inference.scheduler import Request, Scheduler

_ids = itertools.count(1)


def request(prompt: tuple[int, ...] = (1, 2, 3), *, n: int = 1, max_tokens: int = 4, session: str = "") -> Request:
    params = SamplingRequest(prompt=prompt, n=n, max_tokens=max_tokens, session_id=session)
    return Request(id=next(_ids), params=params, seed=0, stop_ids=(99,))


def run_to_end(s: Scheduler, req: Request, tokens: list[int], version: int = 0) -> None:
    """What the engine does for a request: first token(s), then finish every sample."""
    for seq in req.seqs:
        s.append(seq, tokens, [0.0] * len(tokens), version)
        s.finish(seq, "length")


def test_requests_wait_for_slots_and_run_as_others_finish() -> None:
    s = Scheduler(num_slots=2, prefill_tokens=1000)
    a, b, c = request(), request(), request()
    for r in (a, b, c):
        s.add(r)
    assert s.schedule((0,)) == [a, b] and list(s.waiting) == [c]
    assert {seq.slot for seq in a.seqs + b.seqs} == {0, 1}
    assert s.schedule((0,)) == []  # full: c queues, nothing fails
    run_to_end(s, a, [5])
    assert s.schedule((0,)) == [c] and c.seqs[0].slot == 0  # a's slot, freed
    assert a.seqs[0].finished and a.seqs[0].slot == -1


def test_n_samples_are_admitted_together_and_in_order() -> None:
    s = Scheduler(num_slots=4, prefill_tokens=1000)
    small, big, later = request(), request(n=4), request()
    for r in (small, big, later):
        s.add(r)
    # big needs 4 slots, 3 are free: it waits, and the request behind it waits too (no starvation).
    assert s.schedule((0,)) == [small]
    assert s.schedule((0,)) == []
    run_to_end(s, small, [5])
    assert s.schedule((0,)) == [big]
    assert sorted(seq.slot for seq in big.seqs) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="exceeds the engine's 4 slots"):
        s.add(request(n=5))


def test_prefill_budget_spreads_a_burst_over_steps() -> None:
    s = Scheduler(num_slots=8, prefill_tokens=10)
    reqs = [request(prompt=tuple(range(6))) for _ in range(3)]
    for r in reqs:
        s.add(r)
    assert s.schedule((0,)) == reqs[:1]  # 6 + 6 > 10
    assert s.schedule((0,)) == reqs[1:2]
    huge = request(prompt=tuple(range(50)))
    s.add(huge)
    assert s.schedule((0,)) == [reqs[2]]
    assert s.schedule((0,)) == [huge]  # over the budget alone: admitted anyway, never stuck


def test_abort_frees_slots_of_running_and_drops_waiting() -> None:
    s = Scheduler(num_slots=2, prefill_tokens=100)
    a, b = request(n=2), request()
    s.add(a)
    s.add(b)
    s.schedule((0,))
    assert s.free_slots == 0
    assert s.abort(b.id) is b and not s.waiting
    assert s.abort(a.id) is a and s.free_slots == 2
    assert all(seq.finish_reason == "abort" for seq in a.seqs + b.seqs)
    assert s.abort(a.id) is None and not s.has_work()


def test_decoding_lists_prefilled_running_sequences_by_slot() -> None:
    s = Scheduler(num_slots=4, prefill_tokens=100)
    a = request(n=3)
    s.add(a)
    s.schedule((0,))
    assert s.decoding() == []  # not prefilled yet
    for seq in a.seqs:
        s.append(seq, [7], [-1.0], 0)
    s.finish(a.seqs[1], "stop")
    assert [seq.index for seq in s.decoding()] == [0, 2]
    assert a.seqs[0].position == 3  # prompt of 3, one token not yet fed


def test_session_reuses_the_common_prefix_of_the_same_version() -> None:
    s = Scheduler(num_slots=2, prefill_tokens=100)
    turn1 = request(prompt=(1, 2, 3), session="ep")
    s.add(turn1)
    s.schedule((0,))
    slot = turn1.seqs[0].slot
    run_to_end(s, turn1, [4, 5])  # KV holds 1 2 3 4 (5 was sampled, never fed)
    assert len(s.sessions) == 1 and s.free_slots == 1
    turn2 = request(prompt=(1, 2, 3, 4, 5, 6), session="ep")
    s.add(turn2)
    assert s.schedule((0,)) == [turn2]
    assert turn2.reuse == 4 and turn2.seqs[0].slot == slot
    assert s.sessions.stats.hits == 1 and s.sessions.stats.reused_tokens == 4


@pytest.mark.parametrize(("prompt", "version", "reuse"), [
    ((1, 2, 9, 9), 0, 2),  # diverges after two tokens: only those are kept
    ((1, 2, 3), 0, 2),  # at least the last prompt token is prefilled (its logits are needed)
    ((1, 2, 3, 4, 5), 1, 0),  # the weights changed: the old KV is not reused
])
def test_session_reuse_is_exact_or_nothing(prompt: tuple[int, ...], version: int, reuse: int) -> None:
    s = Scheduler(num_slots=1, prefill_tokens=100)
    turn1 = request(prompt=(1, 2, 3), session="ep")
    s.add(turn1)
    s.schedule((0,))
    run_to_end(s, turn1, [4, 5])
    turn2 = request(prompt=prompt, session="ep")
    s.add(turn2)
    s.schedule((version,))
    assert turn2.reuse == reuse


def test_parked_sessions_are_evicted_under_pressure_and_counted() -> None:
    s = Scheduler(num_slots=2, prefill_tokens=100)
    for name in ("a", "b"):
        r = request(session=name)
        s.add(r)
        s.schedule((0,))
        run_to_end(s, r, [4])
    assert s.free_slots == 0 and len(s.sessions) == 2
    fresh = request(n=2)
    s.add(fresh)
    assert s.schedule((0,)) == [fresh]  # parked slots are idle capacity: a new request never waits for them
    assert s.sessions.stats.evictions == 2 and len(s.sessions) == 0
    back = request(prompt=(1, 2, 3, 4, 5), session="a")
    s.add(back)
    run_to_end(s, fresh, [1])
    s.schedule((0,))
    assert back.reuse == 0 and s.sessions.stats.misses == 3


def test_aborted_or_mixed_version_sessions_are_not_parked() -> None:
    s = Scheduler(num_slots=2, prefill_tokens=100)
    a, b = request(session="a"), request(session="b")
    for r in (a, b):
        s.add(r)
    s.schedule((0,))
    s.abort(a.id)
    s.append(b.seqs[0], [4], [0.0], 0)
    s.append(b.seqs[0], [5], [0.0], 1)  # a swap happened mid-turn: its KV mixes two versions
    s.finish(b.seqs[0], "length")
    assert len(s.sessions) == 0 and s.free_slots == 2
