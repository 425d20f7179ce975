"""The engine's program set is exactly what its bucketing can produce within the limits (checked
against every (prompt length, reused prefix) pair), and prefill calls never carry more samples
than the one sample count every prefill program has."""

from __future__ import annotations

import pytest

from services.inference.programs import Buckets, pack_calls, program_set


@pytest.mark.parametrize(("cache_len", "max_prompt"), [(132, 16), (132, 112), (36, 20), (68, 60)])
def test_the_prefill_set_is_every_reachable_shape(cache_len: int, max_prompt: int) -> None:
    b = Buckets(num_slots=8, cache_len=cache_len, max_prefill_rows=4, max_n=2)
    keys = program_set(b, max_prompt=max_prompt, max_tokens=4, max_seq_len=cache_len - 4)
    reachable = set()
    for length in range(1, max_prompt + 1):
        for start in range(length):
            s, t = b.prefill_shape(length, start)
            reachable.add((t, b.window(s + t)))
    assert {(k[2], k[3]) for k in keys if k[0] == "prefill"} == reachable
    assert {k[4] for k in keys if k[0] == "prefill"} == {b.samples}


def test_tight_limits_are_a_handful_of_programs() -> None:
    # bench/grpo_tiny's 76k workload: 16-token prompts, 16-token completions, 32 slots.
    b = Buckets(num_slots=32, cache_len=132, max_prefill_rows=16, max_n=4)
    assert len(program_set(b, max_prompt=16, max_tokens=16, max_seq_len=128)) == 4


def test_calls_hold_at_most_the_sample_count() -> None:
    class Req:
        def __init__(self, n: int) -> None:
            self.n = n

    # Prompt rows: one shared by five n=4 requests (20 samples), two of one n=1 request each.
    rows = [[(Req(4), 0) for _ in range(5)], [(Req(1), 0)], [(Req(1), 0)]]
    calls = pack_calls(rows, rows=4, samples=16, size=lambda r: r.n)
    sizes = [sum(r.n for piece in call for r, _ in piece) for call in calls]
    assert all(s <= 16 for s in sizes) and sum(sizes) == 22
    assert all(len(call) <= 4 for call in calls)
    assert sum(len(piece) for call in calls for piece in call) == 7  # every request once
