"""The continuous-batching engine on the tiny model: exact against a no-cache reference in
any batch, per-row sampling, one prefill per prompt, KV budget queueing, cancellation,
hot swap between chunks, the prefix cache across turns, preemption and partial rollouts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import InferenceConfig
from arlo.model import ModelConfig, create_model, state_from_bytes, state_to_bytes
from arlo.model.source import preset_source
from services.inference.engine import Engine, SamplingRequest, TokenDelta

CONFIG = InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64, max_batch=8, decode_steps=4)
# Completions run to max_tokens: no stop id at all. (The tiny model has 264 vocabulary rows for the
# tokenizer's 263 ids, so a sampled completion could stop at a "never made" id 263: a CI flake.)
NO_STOP: dict[str, object] = {"stop_token_ids": (), "ignore_eos": True}


def new_engine(**config: object) -> Engine:
    return Engine(preset_source("tiny"), config=dataclasses.replace(CONFIG, **config))


@pytest.fixture(scope="module")
def engine():
    e = new_engine()
    yield e
    e.close()


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(tokens_bt)


def reference_greedy(engine: Engine, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """No cache: the full causal forward over the growing sequence (padded to 64)."""
    seq, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        padded = jnp.zeros((1, 64), jnp.int32).at[0, : len(seq)].set(jnp.array(seq))
        logits_v = _forward(engine.graphdef, engine.state, padded)[0, len(seq) - 1]
        tok = int(jnp.argmax(logits_v))
        tokens.append(tok)
        logprobs.append(float(jax.nn.log_softmax(logits_v)[tok]))
        seq.append(tok)
    return tokens, logprobs


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """XLA backend compiles while the block runs (a jit cache hit compiles nothing)."""
    seen: list[str] = []

    def listen(event: str, duration_s: float, **kw: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(str(kw.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def greedy(prompt: tuple[int, ...], max_tokens: int = 10, **kw: object) -> SamplingRequest:
    return SamplingRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, **NO_STOP, **kw)


PROMPTS = [tuple(range(40, 40 + k)) for k in (3, 5, 8, 13, 6, 9)]


def test_concurrent_requests_share_decode_steps_and_match_the_reference(engine: Engine) -> None:
    chunks_before = engine.stats.decode_chunks
    handles = [engine.submit(greedy(p)) for p in PROMPTS]
    results = [h.result(120)[0] for h in handles]
    for prompt, got in zip(PROMPTS, results, strict=True):
        tokens, logprobs = reference_greedy(engine, list(prompt), 10)
        assert got.token_ids == tokens
        np.testing.assert_allclose(got.logprobs, logprobs, atol=1e-4)
    assert engine.stats.largest_batch > 1
    # Six 10-token completions alone would need 6 x 3 chunks of 4 steps; batched they need far fewer.
    assert engine.stats.decode_chunks - chunks_before < 12


def test_programs_are_a_small_known_set(engine: Engine) -> None:
    engine.generate(SamplingRequest(prompt=tuple(range(1, 40)), n=3, max_tokens=5), 120)
    windows = set(engine.runner.windows)
    for shape in engine.runner.shapes:
        kind, *dims = shape
        if kind == "decode":
            rows, window = dims
            assert rows & (rows - 1) == 0 and window in windows
        else:
            m, t, window, j = dims
            assert all(x & (x - 1) == 0 for x in (m, t, j)) and t >= 16 and window in windows


def test_each_row_samples_with_its_own_parameters(engine: Engine) -> None:
    prompt = PROMPTS[2]
    reqs = [greedy(prompt), SamplingRequest(prompt=prompt, max_tokens=10, temperature=1.0, top_k=1, **NO_STOP),
            SamplingRequest(prompt=prompt, max_tokens=10, temperature=2.0, min_p=1.0, **NO_STOP),
            SamplingRequest(prompt=prompt, max_tokens=10, temperature=1.0, **NO_STOP)]
    out = [h.result(120)[0] for h in [engine.submit(r) for r in reqs]]
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids  # top_k=1 and min_p=1 are greedy
    assert out[1].logprobs == [0.0] * 10  # one token kept: probability 1 under the sampled distribution
    assert out[3].token_ids != out[0].token_ids


def test_samples_of_one_prompt_share_one_prefill_and_have_their_own_streams(engine: Engine) -> None:
    rows = engine.runner.prefill_rows
    req = SamplingRequest(prompt=PROMPTS[1], n=4, max_tokens=8, temperature=1.0, **NO_STOP)
    a = engine.generate(req, 120)
    assert engine.runner.prefill_rows == rows + 1
    assert len({tuple(s.token_ids) for s in a}) > 1
    b = engine.generate(req, 120)
    assert [s.token_ids for s in a] != [s.token_ids for s in b]  # no seed: a fresh stream per request
    seeded = SamplingRequest(prompt=PROMPTS[1], n=2, max_tokens=8, temperature=1.0, seed=7, **NO_STOP)
    first = engine.submit(seeded)
    noise = engine.submit(SamplingRequest(prompt=PROMPTS[3], n=3, max_tokens=8, temperature=1.0))
    again = engine.generate(seeded, 120)  # alone this time, in a different batch
    noise.result(120)
    assert [s.token_ids for s in first.result(120)] == [s.token_ids for s in again]


def test_requests_with_one_prompt_share_one_prefill_row_and_keep_their_streams(engine: Engine) -> None:
    # A GRPO group's episodes each send their first turn as its own n=1 request: arriving
    # together, they are prefilled as one row, and each still samples what it would alone.
    reqs = [SamplingRequest(prompt=PROMPTS[4], max_tokens=6, temperature=1.0, seed=100 + i, session_id=f"g-{i}",
                            **NO_STOP) for i in range(4)]
    rows, shared = engine.runner.prefill_rows, engine.runner.shared_prefills
    together = [h.result(120)[0] for h in engine.submit_many(reqs)]
    assert engine.runner.prefill_rows == rows + 1 and engine.runner.shared_prefills == shared + 3
    alone = [engine.generate(dataclasses.replace(r, session_id=""), 120)[0] for r in reqs]
    assert [s.token_ids for s in together] == [s.token_ids for s in alone]
    np.testing.assert_allclose([s.logprobs for s in together], [s.logprobs for s in alone], atol=1e-5)
    reference, _ = reference_greedy(engine, list(PROMPTS[4]), 6)
    g1, g2 = (h.result(120)[0] for h in engine.submit_many([greedy(PROMPTS[4], 6), greedy(PROMPTS[4], 6)]))
    assert g1.token_ids == g2.token_ids == reference  # the shared row is the exact prefill


def test_a_prompt_split_over_calls_counts_only_the_prefills_it_shared() -> None:
    """Requests of one prompt whose samples exceed a call's (`Buckets.samples`) are split into
    rows, each prefilled once: only the requests riding on another's row are shared (the count
    took the unsplit group, one per request past the first)."""
    engine = new_engine(max_batch=32)  # room to admit 32 samples at once, two calls' worth
    try:
        j = engine.runner.buckets.samples
        reqs = [SamplingRequest(prompt=PROMPTS[5], n=j // 2, max_tokens=4, temperature=1.0, **NO_STOP)
                for _ in range(4)]
        for handle in engine.submit_many(reqs):
            handle.result(120)
        assert (engine.runner.prefill_rows, engine.runner.shared_prefills) == (2, 2)
    finally:
        engine.close()


def test_stop_ids_and_max_tokens_end_a_sample(engine: Engine) -> None:
    (full,) = engine.generate(greedy(PROMPTS[0], 10), 120)
    stop = full.token_ids[4]
    (cut,) = engine.generate(SamplingRequest(prompt=PROMPTS[0], max_tokens=10, temperature=0.0,
                                             stop_token_ids=(stop,)), 120)
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop) + 1] and cut.finish_reason == "stop"
    (one,) = engine.generate(greedy(PROMPTS[0], 1), 120)
    assert one.token_ids == full.token_ids[:1] and one.finish_reason == "length"


def test_cancel_frees_the_slot_at_the_next_chunk(engine: Engine) -> None:
    started, cancelled = threading.Event(), threading.Event()

    def first_tokens(_: TokenDelta) -> None:  # on the engine thread: it holds the loop until the cancel is queued
        started.set()
        cancelled.wait(120)

    long = SamplingRequest(prompt=PROMPTS[0], max_tokens=32, temperature=1.0, **NO_STOP)
    handle = engine.submit(long, on_tokens=first_tokens)
    assert started.wait(120)
    engine.cancel(handle.id)
    cancelled.set()
    (sample,) = handle.result(120)
    assert sample.finish_reason == "abort" and len(sample.token_ids) < 32
    assert engine.generate(greedy(PROMPTS[1], 2), 120)[0].finish_reason == "length"
    assert engine.scheduler.pool.used_pages == 0  # every page back: free, or idle in the prefix cache


def test_a_small_kv_budget_queues_requests_instead_of_failing_them() -> None:
    """Dense pages (one of max_seq_len per sequence): the budget of 2.5 sequences runs two at a time."""
    per_seq = 2 * 2 * 2 * 16 * 4 * (256 + 4)  # layers x (k, v) x kv heads x head dim x f32 x slot length
    with pytest.raises(ValueError, match="cannot hold n = 8"):
        new_engine(page_size=0, kv_cache_mib=2.5 * per_seq / 2**20)
    e = new_engine(page_size=0, max_n=2, kv_cache_mib=2.5 * per_seq / 2**20)
    try:
        assert e.runner.pages == 2
        handles = [e.submit(greedy(p, 6)) for p in PROMPTS]
        assert all(len(h.result(120)[0].token_ids) == 6 for h in handles)
        assert e.stats.largest_batch == 2
    finally:
        e.close()


def test_pages_hold_more_short_sequences_than_dense_slots_and_give_the_same_tokens() -> None:
    """The same 2.5-sequence budget in pages of 16 positions: short requests take a page or two
    each, so all six run together, and each gives what the dense engine gives."""
    per_seq = 2 * 2 * 2 * 16 * 4 * (256 + 4)
    dense = new_engine(page_size=0, max_n=2, kv_cache_mib=2.5 * per_seq / 2**20)
    try:
        want = [dense.generate(greedy(p, 6), 120)[0] for p in PROMPTS]
    finally:
        dense.close()
    e = new_engine(page_size=16, max_n=2, kv_cache_mib=2.5 * per_seq / 2**20)
    try:
        handles = e.submit_many([greedy(p, 6) for p in PROMPTS])
        got = [h.result(120)[0] for h in handles]
        assert e.stats.largest_batch == len(PROMPTS)
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert e.scheduler.pool.used_pages == 0
    finally:
        e.close()


def test_running_out_of_pages_preempts_and_recomputes_without_changing_a_sample() -> None:
    """Six samples that each grow to 3-4 pages share 10 pages (2 x 5-page sequences, the least
    max_n = 2 allows): the engine preempts the newest, recomputes it when pages free up, and
    every completion is what it is with room to spare (greedy: the recomputed KV may differ from
    the decoded one in the last bits, which a sampled token near a tie would show)."""
    per_page = 2 * 2 * 2 * 16 * 4 * 16
    small = {"page_size": 16, "max_n": 2, "max_seq_len": 64, "max_tokens": 40, "max_prompt_tokens": 16}
    tight = new_engine(**small, kv_cache_mib=10 * per_page / 2**20)
    roomy = new_engine(**small)
    reqs = [greedy(p, 40) for p in PROMPTS]
    try:
        got = [h.result(300)[0] for h in tight.submit_many(reqs)]
        want = [h.result(300)[0] for h in roomy.submit_many(reqs)]
        assert tight.scheduler.preemptions > 0 and roomy.scheduler.preemptions == 0
        # The resumed prefills (prompt + generated tokens, longer than any prompt) are in the set
        # warm_up compiles: a preempting engine compiles nothing mid-run (they were late compiles).
        assert tight.preemptible and not roomy.preemptible
        warm = tight.runner.program_set(max_prompt=16, max_tokens=40, recompute=tight.preemptible)
        assert tight.runner.shapes <= warm, tight.runner.shapes - warm
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert tight.scheduler.pool.used_pages == 0
    finally:
        tight.close()
        roomy.close()


def other_weights(engine: Engine, *, seed: int) -> nnx.State:
    """Another init of the tiny model, as WeightSync makes it: bytes from the trainer, restored
    like the served state."""
    return state_from_bytes(state_to_bytes(nnx.split(create_model(ModelConfig.named("tiny"), seed))[1]), engine.state)


def swap_at_first_tokens(engine: Engine, state: nnx.State) -> Callable[[TokenDelta], None]:
    """An on_tokens callback that swaps `state` in as version 1 when the first tokens arrive."""
    swapped = threading.Event()

    def on_tokens(delta: TokenDelta) -> None:
        if not swapped.is_set():
            engine.swap(state, 1)
            swapped.set()

    return on_tokens


def test_swap_takes_effect_between_chunks_without_a_drain_or_a_recompile() -> None:
    e = new_engine()
    try:
        e.generate(greedy(PROMPTS[0], 24), 120)  # compile these shapes first
        other = other_weights(e, seed=123)
        on_tokens = swap_at_first_tokens(e, other)
        with count_compiles() as compiles:
            (sample,) = e.submit(greedy(PROMPTS[0], 24), on_tokens=on_tokens).result(120)
        versions = sample.policy_versions
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert compiles == []
        with pytest.raises(ValueError, match="not newer"):
            e.swap(other, 1)
        bad = jax.tree.map(lambda x: x.astype(jnp.bfloat16), other)
        with pytest.raises(ValueError, match="came as bfloat16"):
            e.swap(bad, 2)
    finally:
        e.close()


def test_a_later_turn_prefills_only_what_the_cache_lacks_and_never_changes_the_result() -> None:
    """The prefix cache across requests: turn 2 finds turn 1's full pages (same version), turn 3
    after a swap finds nothing (the version is in the key), and neither changes a completion."""
    e = new_engine(page_size=16)
    try:
        turn1 = tuple(range(60, 90))
        (a,) = e.generate(greedy(turn1, 6), 120)
        stats = e.scheduler.pool.stats
        before = stats.hit_tokens
        turn2 = (*turn1, *a.token_ids, 33, 34, 35)
        (hit,) = e.generate(greedy(turn2, 6), 120)
        assert stats.hit_tokens - before == 32  # 35 valid positions of turn 1: two full pages
        e.runner.reset_cache()  # the same pool, zeroed: a fresh prefill must not read the cache
        e.scheduler.reset()
        (fresh,) = e.generate(greedy(turn2, 6), 120)
        assert hit.token_ids == fresh.token_ids
        np.testing.assert_allclose(hit.logprobs, fresh.logprobs, atol=1e-5)
        e.swap(e.state, 1)
        before = stats.hit_tokens
        turn3 = (*turn2, *hit.token_ids, 36)
        (after,) = e.generate(greedy(turn3, 6), 120)
        assert stats.hit_tokens == before and after.policy_versions == [1] * 6
    finally:
        e.close()


def test_a_swap_with_recompute_continues_in_flight_samples_on_the_new_weights() -> None:
    """Partial rollouts: a sample in flight at a swap stops at a token boundary and goes on under
    the new weights with its KV recomputed by them: what follows the swap is exactly what the new
    weights give that prefix, and each token keeps the version that sampled it."""
    e = new_engine(page_size=16)
    e.recompute_on_swap = True
    try:
        other = other_weights(e, seed=7)
        on_tokens = swap_at_first_tokens(e, other)
        (sample,) = e.submit(greedy(PROMPTS[3], 24), on_tokens=on_tokens).result(120)
        versions = sample.policy_versions
        cut = versions.index(1)
        assert 0 < cut < 24 and set(versions[cut:]) == {1} and e.stats.recomputed == 1
        # Under version 1 alone, the same prefix continues the same way.
        (tail,) = e.generate(greedy((*PROMPTS[3], *sample.token_ids[:cut]), 24 - cut), 120)
        assert tail.token_ids == sample.token_ids[cut:]
        np.testing.assert_allclose(tail.logprobs, sample.logprobs[cut:], atol=1e-5)
    finally:
        e.close()
