"""The continuous-batching scheduler over KV pages, without a model (vLLM's create_scheduler idea):
queueing, fairness, the prefill budget, aborts, the prefix cache, preemption by recompute, and
the page accounting under any sequence of events (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.inference.pages import NULL_PAGE, PagePool
from services.inference.requests import SamplingRequest
from services.inference.scheduler import Request, Scheduler

_ids = itertools.count(1)
PAGE = 4


def request(prompt: tuple[int, ...] = (1, 2, 3), *, n: int = 1, max_tokens: int = 4) -> Request:
    params = SamplingRequest(prompt=prompt, n=n, max_tokens=max_tokens)
    return Request(id=next(_ids), params=params, seed=0, stop_ids=(99,))


def scheduler(pages: int = 64, *, max_seqs: int = 8, prefill_tokens: int = 1000) -> Scheduler:
    return Scheduler(max_seqs=max_seqs, prefill_tokens=prefill_tokens, pool=PagePool(pages, PAGE))


def admit(s: Scheduler, version: int = 0) -> list[Request]:
    """One engine step's admission, the prefill's writes included."""
    items = s.schedule((version,))
    s.pool.written()
    return list(dict.fromkeys(seq.request for item in items for seq in item.seqs))


def run_to_end(s: Scheduler, req: Request, tokens: list[int], version: int = 0) -> None:
    """What the engine does for a request: its tokens, then finish every sample."""
    for seq in req.seqs:
        if not seq.finished:
            s.append(seq, tokens, [0.0] * len(tokens), version)
            s.finish(seq, "length")


def test_requests_wait_for_pages_and_run_as_others_finish() -> None:
    s = scheduler(pages=2)
    a, b, c = request(), request(), request()  # 3 prompt tokens + the first decode position: 1 page each
    for r in (a, b, c):
        s.add(r)
    assert admit(s) == [a, b] and list(s.waiting) == [c]
    assert admit(s) == []  # full: c queues, nothing fails
    run_to_end(s, a, [5])
    assert admit(s) == [c] and a.seqs[0].pages == []


def test_n_samples_are_admitted_together_and_in_order() -> None:
    s = scheduler(max_seqs=4)
    small, big, later = request(), request(n=4), request()
    for r in (small, big, later):
        s.add(r)
    # big needs 4 sequences, 3 are free: it waits, and the request behind it waits too (no starvation).
    assert admit(s) == [small]
    assert admit(s) == []
    run_to_end(s, small, [5])
    assert admit(s) == [big]
    with pytest.raises(ValueError, match="exceeds the engine's 4 sequences"):
        s.add(request(n=5))


def test_prefill_budget_spreads_a_burst_over_steps() -> None:
    s = scheduler(prefill_tokens=10)
    reqs = [request(prompt=tuple(range(k, k + 6))) for k in (0, 10, 20)]
    for r in reqs:
        s.add(r)
    assert admit(s) == reqs[:1]  # 6 + 6 > 10
    assert admit(s) == reqs[1:2]
    huge = request(prompt=tuple(range(50)))
    s.add(huge)
    assert admit(s) == [reqs[2]]
    assert admit(s) == [huge]  # over the budget alone: admitted anyway, never stuck


def test_abort_gives_back_the_pages_of_running_and_drops_waiting() -> None:
    s = scheduler()
    a, b = request(n=2), request()
    s.add(a)
    s.add(b)
    admit(s)
    assert s.pool.used_pages == 3  # a's two samples: a private page each; b: one
    assert s.abort(b.id) is b and not s.waiting
    assert s.abort(a.id) is a and s.pool.used_pages == 0
    assert all(seq.finish_reason == "abort" for seq in a.seqs + b.seqs)
    assert s.abort(a.id) is None and not s.has_work()


def test_samples_share_the_prompts_full_pages_and_own_their_last() -> None:
    s = scheduler()
    a = request(prompt=tuple(range(10)), n=3)  # 2 full pages + 2 tokens
    s.add(a)
    (item,) = s.schedule((0,))
    shared = a.seqs[0].pages[:2]
    assert all(seq.pages[:2] == shared for seq in a.seqs)
    assert len({seq.pages[2] for seq in a.seqs}) == 3  # the partial page: each its own
    assert [s.pool.holders(p) for p in shared] == [3, 3] and item.start == 0


@pytest.mark.parametrize(("prompt", "version", "start"), [
    ((*range(9), 50, 51), 0, 8),  # the first two pages match, the third is partial
    (tuple(range(8)), 0, 4),  # at least the last prompt token is prefilled (its logits are needed)
    ((1, 2, 3, 4, 5, 6, 7, 8, 9), 0, 0),  # differs in the first page: nothing to share
    (tuple(range(12)), 1, 0),  # the weights changed: the old KV is not reused
])
def test_a_later_request_starts_after_the_full_pages_it_shares(prompt: tuple[int, ...], version: int,
                                                                 start: int) -> None:
    s = scheduler()
    first = request(prompt=tuple(range(10)))
    s.add(first)
    admit(s)
    pages = list(first.seqs[0].pages)
    run_to_end(s, first, [10, 11])  # KV of tokens 0..10: two full pages cached
    later = request(prompt=prompt)
    s.add(later)
    (item,) = s.schedule((version,))
    assert item.start == start
    assert later.seqs[0].pages[: start // PAGE] == pages[: start // PAGE]


def test_a_request_that_would_read_pages_written_this_step_waits_one_step_then_shares_them() -> None:
    s = scheduler()
    system = tuple(range(100, 116))  # 4 full pages
    one, two = request(prompt=(*system, 1, 2)), request(prompt=(*system, 3, 4))
    same = request(prompt=(*system, 1, 2))
    for r in (one, same, two):
        s.add(r)
    items = s.schedule((0,))
    assert [seq.request for item in items for seq in item.seqs] == [one, same]  # same prompt: rides along
    assert items[1].start == items[0].start == 0 and same.seqs[0].pages[:4] == one.seqs[0].pages[:4]
    s.pool.written()
    (item,) = s.schedule((0,))
    assert item.seqs[0].request is two and item.start == 16 and two.seqs[0].pages[:4] == one.seqs[0].pages[:4]


def test_an_idle_cached_page_found_by_a_request_is_not_evicted_by_its_own_allocation() -> None:
    """A lookup found idle cached pages and the allocation for the rest of the prompt, short of
    never-used pages, evicted them: the request then listed a page twice (and read a page someone
    else was given)."""
    s = scheduler(pages=5)
    first = request(prompt=tuple(range(9)))
    s.add(first)
    admit(s)
    pages = list(first.seqs[0].pages)
    run_to_end(s, first, [9])  # pages of 0..3 and 4..7 cached and idle, the third freed
    filler = request(prompt=(7, 7, 7))
    s.add(filler)
    admit(s)  # 2 never-used pages left
    later = request(prompt=(*range(8), *range(60, 68)))  # shares 2 pages, needs 3 more
    s.add(later)
    assert admit(s) == [] and s.pool.stats.evictions == 0
    run_to_end(s, filler, [1])
    assert admit(s) == [later]
    assert later.seqs[0].pages[:2] == pages[:2]
    assert len(set(later.seqs[0].pages)) == len(later.seqs[0].pages) == 5


def test_the_prefix_stats_count_a_request_once_however_long_it_waits_and_only_the_pages_it_reads() -> None:
    """A request waiting for pages looks the prefix cache up again every step: each walk was
    counted, so the hit rate weighed a request by the steps it waited. And the pages a lookup
    found but the prefill's bucket gave up (it restarts from 0) were counted as hits."""
    s = scheduler(pages=5)
    first = request(prompt=tuple(range(9)))
    s.add(first)
    admit(s)
    run_to_end(s, first, [9])  # pages of 0..3 and 4..7 cached and idle
    hog = request(prompt=(70, 71, 72))
    s.add(hog)
    admit(s)
    later = request(prompt=(*range(8), *range(60, 68)))  # walks 3 full pages, finds 2, needs 3 pages more
    s.add(later)
    stats = s.pool.stats
    looked, hit = stats.lookup_tokens, stats.hit_tokens
    for _ in range(3):
        assert admit(s) == []
    run_to_end(s, hog, [1])
    assert admit(s) == [later]
    assert (stats.lookup_tokens - looked, stats.hit_tokens - hit) == (3 * PAGE, 2 * PAGE)
    # A bucket that gives the reuse up (prefill_start 0) prefills the found pages again: no hit.
    restart = Scheduler(max_seqs=8, prefill_tokens=1000, pool=PagePool(64, PAGE), prefill_start=lambda n, c: 0)
    turn = request(prompt=tuple(range(9)))
    restart.add(turn)
    admit(restart)
    run_to_end(restart, turn, [9])
    restart.add(request(prompt=tuple(range(9))))
    (item,) = restart.schedule((0,))
    assert item.start == 0 and restart.pool.stats.hit_tokens == 0


def test_growing_past_the_pool_preempts_the_newest_and_resumes_it_with_its_tokens() -> None:
    s = scheduler(pages=4)
    old, new = request(prompt=(1, 2, 3)), request(prompt=(4, 5, 6))
    for r in (old, new):
        s.add(r)
    admit(s)
    for r, tok in ((old, 7), (new, 8)):
        s.append(r.seqs[0], [tok], [0.0], 0)
    s.grow(4)  # each needs positions 3..6: a second page each, 4 in all
    assert s.pool.used_pages == 4 and s.preemptions == 0
    for r in (old, new):
        s.append(r.seqs[0], [1, 1, 1, 1], [0.0] * 4, 0)
    s.grow(4)  # old needs a third page: new, the newest, is preempted
    assert s.preemptions == 1 and list(s.waiting) == [new] and len(old.seqs[0].pages) == 3
    run_to_end(s, old, [])
    (item,) = s.schedule((0,))
    assert item.tokens == (4, 5, 6, 8, 1, 1, 1, 1) and item.count == 5  # sampling goes on at token 5
    assert item.start == 4  # its first page was cached when it was preempted


def test_a_request_is_not_admitted_into_the_pages_the_next_decode_chunk_needs() -> None:
    """Admission ran before grow() and took the pages the running sequences' next chunk needed:
    grow() then preempted the request just admitted (the newest), its prefill thrown away (on the
    tight engine of test_inference_batching, 7 of 17 preemptions). It waits instead, and neither
    its own first chunk nor the running ones' growth preempts anything."""
    s = scheduler(pages=3)
    old = request(prompt=(1, 2, 3))
    s.add(old)
    s.schedule((0,), steps=4)
    s.pool.written()
    s.append(old.seqs[0], [7], [0.0], 0)
    s.grow(4)  # positions 3..6: two pages
    s.append(old.seqs[0], [1, 1, 1, 1], [0.0] * 4, 0)
    new = request(prompt=(4, 5, 6))  # one page now, a second for its first chunk
    s.add(new)
    assert s.schedule((0,), steps=4) == []  # old's next chunk needs the last page
    s.grow(4)
    assert s.preemptions == 0 and list(s.waiting) == [new]
    run_to_end(s, old, [])
    (item,) = s.schedule((0,), steps=4)
    s.pool.written()
    s.append(new.seqs[0], [8], [0.0], 0)
    s.grow(4)
    assert item.seqs[0].request is new and s.preemptions == 0 and len(new.seqs[0].pages) == 2


def test_pages_of_a_sequence_whose_kv_mixes_versions_are_not_cached() -> None:
    s = scheduler()
    a = request(prompt=tuple(range(10)))
    s.add(a)
    admit(s)
    s.append(a.seqs[0], [1, 2], [0.0, 0.0], 0)
    s.append(a.seqs[0], [3, 4], [0.0, 0.0], 1)  # a swap happened mid-turn
    cached = s.pool.cached_pages
    s.finish(a.seqs[0], "length")
    assert s.pool.cached_pages == cached and s.pool.used_pages == 0


EVENTS = st.lists(st.tuples(st.sampled_from(["add", "step", "token", "finish", "abort", "swap"]),
                            st.integers(0, 7), st.integers(1, 3)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(EVENTS)
def test_page_accounting_holds_under_any_sequence_of_events(events: list[tuple[str, int, int]]) -> None:
    """Every page is held exactly as often as page tables list it; nothing is lost (used = the pages
    listed); the null page is never handed out; and no sequence holds more than the pages its
    positions and one decode chunk need."""
    s = scheduler(pages=12, max_seqs=4, prefill_tokens=64)
    version, reqs = 0, []
    prefixes = [tuple(range(6)), tuple(range(9)), (5, 5, 5)]
    for kind, a, b in events:
        live = [r for r in reqs if r.id in s.running]
        if kind == "add":
            r = request(prompt=(*prefixes[a % 3], *range(a)), n=min(b, 2))
            reqs.append(r)
            s.add(r)
        elif kind == "step":
            admit(s, version)
            s.grow(2)
            for r in s.running.values():
                for seq in r.seqs:
                    if not seq.finished:
                        s.append(seq, [a] * (2 if seq.token_ids else 1), [0.0], version)
        elif kind == "finish" and live:
            seq = next((q for q in live[a % len(live)].seqs if not q.finished), None)
            if seq is not None:
                s.finish(seq, "stop")
        elif kind == "abort" and reqs:
            s.abort(reqs[a % len(reqs)].id)
        elif kind == "swap":
            version += 1
        check_pages(s)


def check_pages(s: Scheduler) -> None:
    tables = [seq.pages for r in s.running.values() for seq in r.seqs if not seq.finished]
    listed: dict[int, int] = {}
    for table in tables:
        assert len(set(table)) == len(table) and NULL_PAGE not in table
        for page in table:
            listed[page] = listed.get(page, 0) + 1
    for page in range(1, s.pool.num_pages + 1):
        assert s.pool.holders(page) == listed.get(page, 0), f"page {page}"
    assert s.pool.used_pages == len(listed)
    for r in s.running.values():
        for seq in r.seqs:
            if not seq.finished and seq.token_ids:
                assert len(seq.pages) <= s.pool.pages_for(seq.position + 2)
