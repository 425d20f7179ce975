"""The paged engine from outside, where the scheduler's tests cannot reach: several LoRA adapter
slots sharing one page pool and one prefix cache, each swapped on its own; and the scheduler
against a model of what the runner writes into each page (a cached page must hold its reader's KV)."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arlo.config import InferenceConfig, RunConfig, TrainerConfig, load_config
from arlo.config.trainer import LoraConfig
from services.inference.engine import Engine, SamplingRequest, TokenDelta
from services.inference.pages import NULL_PAGE, PagePool
from services.inference.programs import MIN_TOKEN_BUCKET, pow2
from services.inference.scheduler import Request, Scheduler

PROMPT = tuple(range(60, 80))


@pytest.fixture(scope="module")
def engine():
    source = RunConfig(trainer=TrainerConfig(lora=LoraConfig(rank=4))).model_source()
    e = Engine(source, config=InferenceConfig(max_n=2, max_tokens=32, max_prompt_tokens=32, max_batch=8,
                                              decode_steps=4, page_size=16),
               adapters=2, recompute_on_swap=True)
    yield e
    e.close()


def greedy(adapter: int, max_tokens: int = 24) -> SamplingRequest:
    return SamplingRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, stop_token_ids=(), ignore_eos=True,
                           adapter=adapter)


def test_a_swap_of_one_adapter_slot_recomputes_only_that_slots_samples(engine: Engine) -> None:
    """Partial rollouts with two runs: run B's publish preempted run A's samples too (preempt_all
    took every running request), recomputing KV its weights still served: wasted prefills, and
    run A's tokens then hung on run B's publishes (a recomputed KV differs from the decoded one
    in the last bits)."""
    swapped = threading.Event()
    version = engine.versions[1] + 1

    def on_tokens(delta: TokenDelta) -> None:
        if not swapped.is_set():
            engine.swap(engine.published_state_of(1), version, adapter=1)
            swapped.set()

    recomputed = engine.stats.recomputed
    a, b = engine.submit_many([greedy(0), greedy(1)], on_tokens=on_tokens)
    (sample_a,), (sample_b,) = a.result(120), b.result(120)
    assert swapped.is_set() and engine.versions[1] == version
    assert set(sample_a.policy_versions) == {engine.versions[0]}
    assert sample_b.policy_versions[-1] == version
    assert engine.stats.recomputed - recomputed == 1  # run B's sample alone


# ----- what each page holds (the scheduler against a model of the runner's writes) -----

PAGE = 4
_ids = itertools.count(1)


class PageContents:
    """The scheduler, and what the runner writes where: each (page, slot) holds the (adapter,
    version, tokens up to that position) its KV was computed from, or None (a bucket's padding, a
    decode chunk's positions past a stopped row's end)."""

    def __init__(self, pages: int) -> None:
        self.s = Scheduler(max_seqs=4, prefill_tokens=24, pool=PagePool(pages, PAGE))
        self.held: dict[tuple[int, int], tuple[int, int, tuple[int, ...]] | None] = {}
        self.versions = [0, 0]

    def _write(self, table: list[int], p: int, value: tuple[int, int, tuple[int, ...]] | None) -> None:
        page = table[p // PAGE] if p // PAGE < len(table) else NULL_PAGE
        if page != NULL_PAGE:
            self.held[page, p % PAGE] = value

    def step(self, steps: int, token: int) -> None:
        s = self.s
        items = s.schedule(tuple(self.versions), steps=steps if token % 2 else 0)
        for item in items:  # every position before the prefill's start is read from the cache
            salt = (item.adapter, self.versions[item.adapter])
            for seq in item.seqs:
                for p in range(item.start):
                    assert self.held.get((seq.pages[p // PAGE], p % PAGE)) == (*salt, item.tokens[: p + 1]), p
        for item in items:  # the prefill writes whole pages from its start, its token bucket's worth
            salt = (item.adapter, self.versions[item.adapter])
            end = item.start + pow2(len(item.tokens) - item.start, MIN_TOKEN_BUCKET)
            for seq in item.seqs:
                for p in range(item.start, end):
                    self._write(seq.pages, p, (*salt, item.tokens[: p + 1]) if p < len(item.tokens) else None)
        s.pool.written()
        for item in items:
            for seq in item.seqs:
                s.append(seq, [token], [0.0], self.versions[item.adapter])
                if len(seq.token_ids) >= seq.request.params.max_tokens:
                    s.finish(seq, "length")
        s.grow(steps)
        for seq in s.decoding():  # a chunk writes `steps` positions from the row's position, stopped or not
            adapter = seq.request.params.adapter
            pos, m = seq.position, min(steps, seq.request.params.max_tokens - len(seq.token_ids))
            s.append(seq, [token + i for i in range(m)], [0.0] * m, self.versions[adapter])
            for i in range(steps):
                self._write(seq.pages, pos + i, (adapter, self.versions[adapter], seq.tokens[: pos + i + 1])
                            if i < m else None)
            if len(seq.token_ids) >= seq.request.params.max_tokens:
                s.finish(seq, "length")


EVENTS = st.lists(st.tuples(st.sampled_from(["add", "turn", "step", "step", "step", "cut", "abort", "swap", "partial"]),
                            st.integers(0, 7), st.integers(1, 3)), max_size=50)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(6, 16), st.integers(1, 3))
def test_every_page_read_from_the_cache_holds_what_its_reader_needs(events: list[tuple[str, int, int]], pages: int,
                                                                    steps: int) -> None:
    """Any mix of two adapters' requests (one prompt a page long exactly, one of a single token,
    same prompts in one step, n = 2, later turns of a sample's tokens), steps, stop-string cuts (tokens dropped after a chunk),
    aborts, swaps, partial-rollout swaps of one slot and preemptions by page pressure: a prefill
    starting past position 0 finds, at every earlier position, the KV of its own tokens under its
    own adapter and version."""
    m = PageContents(pages)
    s, reqs = m.s, []
    prefixes = [tuple(range(8)), tuple(range(9)), (5, 5, 5, 5), (1,)]
    for kind, a, b in events:
        if kind == "add":
            params = SamplingRequest(prompt=(*prefixes[a % 4], *[a] * (b - 1)), n=min(b, 2), max_tokens=3 + 2 * a,
                                     adapter=a % 2)
            reqs.append(Request(id=next(_ids), params=params, seed=0, stop_ids=()))
            s.add(reqs[-1])
        elif kind == "turn":  # the next turn of an episode: a sample's tokens (finished or not), then more
            said = [q for r in reqs for q in r.seqs if q.token_ids]
            if said:
                prompt = (*said[a % len(said)].tokens, *[a] * b)
                reqs.append(Request(id=next(_ids), params=SamplingRequest(prompt=prompt, max_tokens=3,
                                    adapter=said[a % len(said)].request.params.adapter), seed=0, stop_ids=()))
                s.add(reqs[-1])
        elif kind == "step":
            m.step(steps, 10 + a)
        elif kind == "cut":
            live = [q for r in s.running.values() for q in r.seqs if not q.finished and len(q.token_ids) > 1]
            if live:
                seq = live[a % len(live)]
                keep = len(seq.token_ids) - 1 - a % (len(seq.token_ids) - 1)
                del seq.token_ids[keep:], seq.logprobs[keep:], seq.versions[keep:]
                s.finish(seq, "stop")
        elif kind == "abort" and reqs:
            s.abort(reqs[a % len(reqs)].id)
        elif kind in ("swap", "partial"):
            m.versions[a % 2] += 1
            if kind == "partial":
                s.preempt_all(adapters={a % 2})


def test_the_memory_plan_prefills_the_longest_row_a_preempted_sample_resumes_with() -> None:
    """`arlo plan`'s prefill program took the longest prompt; a preempted sample (partial rollouts,
    or a KV budget below every sequence at full length) is resumed by a prefill of its prompt and
    the tokens it has, a longer row: a bigger program than the plan's (an OOM the plan said fits)."""
    from services.inference.memory_plan import engine_plan

    base = {"rollout": {"max_episode_tokens": 128}, "inference": {"max_prompt_tokens": 16, "max_tokens": 100, "max_batch": 4,
                                                       "max_n": 2, "max_seq_len": 128}}
    roomy = engine_plan(load_config(overrides=base))["prefill"]["tokens"]
    partial = engine_plan(load_config(overrides={**base, "rollout": {"max_episode_tokens": 128, "partial": True}}))["prefill"]["tokens"]
    tight = engine_plan(load_config(overrides={**base, "inference": {**base["inference"], "page_size": 16,
                                                                     "kv_cache_mib": 0.2}}))["prefill"]["tokens"]
    assert (roomy, partial, tight) == (16, 128, 128)
