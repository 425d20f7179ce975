"""The paged engine from outside, where the scheduler's tests cannot reach: several LoRA adapter
slots sharing one page pool and one prefix cache, each swapped on its own."""

from __future__ import annotations

import threading

import pytest

from arlo.config import InferenceConfig, RunConfig, TrainerConfig
from arlo.config.trainer import LoraConfig
from services.inference.engine import Engine, SamplingRequest, TokenDelta

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
