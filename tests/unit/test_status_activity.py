"""`arlo status`'s throughput and error columns from two heartbeat snapshots (a pure function)."""

from __future__ import annotations

from arlo.app.status import service_activity


def beat(service: str, instance: str, ts: float, **counters: float) -> dict[str, str]:
    return {"service": service, "instance": instance, "ts": repr(ts), **{k: str(v) for k, v in counters.items()}}


def test_rates_sum_over_instances_and_errors_are_by_kind() -> None:
    first = [beat("rollout", "a", 100.0, episodes=10, retries=1, failed_groups=0),
             beat("rollout", "b", 100.0, episodes=50, retries=0, failed_groups=2),
             beat("trainer", "t", 100.0, consumed=100, tokens_trained=1000, step=4, dropped_stale=3)]
    second = [beat("rollout", "a", 102.0, episodes=30, retries=2, failed_groups=0),
              beat("rollout", "b", 104.0, episodes=70, retries=0, failed_groups=2),
              beat("trainer", "t", 102.5, consumed=150, tokens_trained=1500, step=5, dropped_stale=3),
              beat("inference", "new", 103.0, generated_tokens=7, aborted=0, compiles=30, late_compiles=1,
                   ahead_compiles=12, kv_pages=100, kv_pages_used=40, prefix_hit_tokens=300,
                   prefix_lookup_tokens=400, preemptions=2),
              beat("inference", "other", 103.0, compiles=20, late_compiles=0, ahead_compiles=5, kv_pages=100,
                   kv_pages_used=10, prefix_hit_tokens=100, prefix_lookup_tokens=400, preemptions=0)]
    activity = service_activity(first, second)
    assert activity["rollout"] == {"instances": 2, "throughput": {"episodes/s": 10.0 + 5.0},
                                   "errors": {"retries": 2, "failed_groups": 2}}
    assert activity["trainer"]["throughput"] == {"trajectories/s": 20.0, "tokens/s": 200.0, "steps/s": 0.4}
    assert activity["trainer"]["errors"] == {"dropped_stale": 3}
    # An instance seen once (just started) counts, but has no rate yet.
    # Compile counters summed over replicas: late ones are stalls, ahead ones were made while idle.
    # The paged KV cache over replicas: pages in use, and the prefix hit rate from the token counters.
    assert activity["inference"] == {"instances": 2, "throughput": {}, "errors": {"aborted": 0},
                                     "compiles": {"compiles": 50, "late_compiles": 1, "ahead_compiles": 17},
                                     "kv": {"kv_pages": 200, "kv_pages_used": 50, "prefix_hit_tokens": 400,
                                            "prefix_lookup_tokens": 800, "preemptions": 2, "prefix_hit_rate": 0.5}}


def test_the_kv_column_shows_pages_hits_and_preemptions() -> None:
    from arlo.app.status_view import kv_text as _kv_text

    kv = {"kv_pages": 200, "kv_pages_used": 50, "prefix_hit_rate": 0.5, "preemptions": 2}
    assert _kv_text(kv) == "50/200 pages, prefix hits 50%, 2 preempted"
    assert _kv_text({"kv_pages": 8, "kv_pages_used": 0}) == "0/8 pages" and _kv_text({}) == "-"
