"""The engine's program set is exactly what its bucketing can produce within the limits (checked
against every (prompt length, reused prefix) pair), and prefill calls never carry more samples
than the one sample count every prefill program has."""

from __future__ import annotations

import pytest

from services.inference.programs import (
    CPU_COMPUTE_BOUND_PARAMS,
    MIN_ROWS,
    Buckets,
    pack_calls,
    program_set,
    row_floor,
)


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


def test_with_recompute_the_set_holds_every_resumed_samples_prefill() -> None:
    """A preempted sample is resumed by a prefill of its prompt and the tokens it has (up to
    max_tokens - 1 of them), from any cached prefix: rows longer than any prompt."""
    b = Buckets(num_slots=8, cache_len=132, max_prefill_rows=4, max_n=2)
    keys = program_set(b, max_prompt=16, max_tokens=40, max_seq_len=128, recompute=True)
    reachable = {(b.prefill_shape(length, start)[1], b.window(sum(b.prefill_shape(length, start))))
                 for length in range(1, 16 + 40) for start in range(length)}
    assert {(k[2], k[3]) for k in keys if k[0] == "prefill"} == reachable
    assert len(program_set(b, max_prompt=16, max_tokens=40, max_seq_len=128)) < len(keys)


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


def test_the_row_floor_is_one_only_where_a_step_costs_in_proportion_to_its_rows() -> None:
    big, small = CPU_COMPUTE_BOUND_PARAMS, CPU_COMPUTE_BOUND_PARAMS - 1
    assert row_floor(0, platform="cpu", params=big) == 1
    assert row_floor(0, platform="cpu", params=small) == MIN_ROWS
    assert row_floor(0, platform="gpu", params=500_000_000) == MIN_ROWS
    assert row_floor(0, platform="tpu", params=500_000_000) == MIN_ROWS
    assert row_floor(4, platform="gpu", params=big) == 4  # the setting wins everywhere
    assert row_floor(32, platform="cpu", params=big) == 32


def test_a_floor_of_one_decodes_one_sequence_in_one_row() -> None:
    floor1 = Buckets(num_slots=64, cache_len=132, max_prefill_rows=16, max_n=4, min_rows=1)
    floor16 = Buckets(num_slots=64, cache_len=132, max_prefill_rows=16, max_n=4)
    assert [floor1.decode_rows(n) for n in (1, 2, 3, 5, 17)] == [1, 2, 4, 8, 32]
    assert [floor16.decode_rows(n) for n in (1, 2, 3, 5, 17)] == [16, 16, 16, 16, 32]
    # A prefill call samples at least MIN_ROWS rows whatever the decode floor, so it still takes
    # up to max_prefill_rows prompts at once (a floor of 1 had made every prefill one prompt).
    assert (floor1.samples, floor16.samples) == (16, 16)
    assert floor1.prefill_rows_cap() == floor16.prefill_rows_cap() == 16
    assert Buckets(num_slots=64, cache_len=132, max_prefill_rows=64, min_rows=1).prefill_rows_cap() == 16
    # Every decode row count the runner can produce is in the program set, at either floor.
    for b in (floor1, floor16):
        keys = program_set(b, max_prompt=16, max_tokens=16, max_seq_len=128)
        assert {k[1] for k in keys if k[0] == "decode"} == {b.decode_rows(n) for n in range(1, 65)}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_long_prompt_near_the_slot_end_keeps_its_prefix_and_the_set_holds_the_shape(page_size: int) -> None:
    """Issue 36's 16k-token, 8-turn e2e run: at the 8th turn 14,976 of a 17,300-token prompt were
    cached, the rest's bucket (4,096) overran the 18,824-token slot, and the reuse was given up: one
    18,824-token prefill whose attention scores (11 GB a layer) took the engine out of memory. Less
    of the prefix is reused instead, from a page boundary, and the bucket ends within the slot."""
    b = Buckets(num_slots=2, cache_len=18_824, max_prefill_rows=2, max_n=2, page_size=64)
    start, t = b.prefill_shape(17_300, 14_976)
    assert 0 < start <= 14_976 and start % 64 == 0 and start + t <= 18_824 and t == 4096
    assert start + t >= 17_300  # the bucket covers the prompt
    # The program set is still exactly what the bucketing reaches, page-aligned starts included.
    small = Buckets(num_slots=8, cache_len=132, max_prefill_rows=4, max_n=2, page_size=page_size)
    keys = program_set(small, max_prompt=112, max_tokens=4, max_seq_len=128)
    reachable = set()
    for length in range(1, 113):
        for start in range(0, length, page_size):
            s, t = small.prefill_shape(length, start)
            assert s <= start and s + t <= small.cache_len and s + t >= length
            reachable.add((t, small.window(s + t)))
    assert reachable <= {(k[2], k[3]) for k in keys if k[0] == "prefill"}
