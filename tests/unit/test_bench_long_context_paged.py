"""bench/long_context.py's paged sections at a size a test affords: the capacity simulation (the
engine's own scheduler and page pool) on the issue's mix scaled down, and its page accounting."""

from __future__ import annotations

from bench.long_context_paged import long_tail_lengths, simulate_in_flight


def test_paged_admission_holds_three_times_the_dense_sequences_on_the_long_tail_mix() -> None:
    lengths = long_tail_lengths(400, 128, 1024)
    budget = 16 * (1024 + 8)
    dense = simulate_in_flight(lengths, page_size=0, budget_positions=budget, slot_len=1024)
    paged = simulate_in_flight(lengths, page_size=16, budget_positions=budget, slot_len=1024)
    assert dense["mean_in_flight"] <= 16 and dense["sequences_in_flight"] == 16
    assert paged["mean_in_flight"] >= 3 * dense["mean_in_flight"]
    assert paged["overallocated_pages"] == 0 and dense["overallocated_pages"] == 0
