"""The engine's start-up warm-up compiles exactly the programs its limits allow: afterwards a mix
of requests within those limits (every prompt length, n, completion length, a reused session
prefix, concurrent arrivals) compiles nothing, and uses every program the warm-up made."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from arlo.compile_watch import CompileWatch
from arlo.config import InferenceConfig
from arlo.model.source import preset_source
from services.inference.engine import Engine, SamplingRequest
from services.inference.idle_compile import idle_order

# Tight limits, as a workload would set them: two programs (one prefill, one decode).
CONFIG = InferenceConfig(max_n=4, max_tokens=8, max_prompt_tokens=16, max_batch=16, max_prefill_rows=4,
                         decode_steps=4, max_seq_len=32, page_size=4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("min_rows", [0, 1], ids=["automatic floor (16 here)", "floor 1 (a big model on CPU)"])
def test_after_the_warm_up_a_mix_of_requests_compiles_nothing(min_rows: int) -> None:
    watch = CompileWatch().install()
    engine = Engine(preset_source("tiny"), config=dataclasses.replace(CONFIG, min_rows=min_rows, warmup_programs=64))
    try:
        compiled = engine.warm_up()
        # Floor 1: decode at 1, 2, 4, 8 and 16 rows; prefills sample 4 rows (max_n) instead of 16.
        assert compiled == (2 if min_rows == 0 else 6) and watch.compiles >= 1  # (jit reuses the other's 16-row one)
        watch.mark_warm()
        requests = [SamplingRequest(prompt=tuple(range(1, length + 1)), n=n, max_tokens=tokens, temperature=1.0,
                                    seed=length)
                    for length in (1, 5, 9, 16) for n in (1, 4) for tokens in (1, 8)]
        for handle in engine.submit_many(requests):  # arrive together: shared and split prefills
            handle.result(120)
        first = engine.generate(SamplingRequest(prompt=(9, 2, 3), max_tokens=4), 120)[0]
        turn = (9, 2, 3, *first.token_ids, 7)  # the next turn starts past the first's cached full page
        hits = engine.scheduler.pool.stats.hit_tokens
        engine.generate(SamplingRequest(prompt=turn, max_tokens=8), 120)
        assert engine.scheduler.pool.stats.hit_tokens == hits + 4
        assert (watch.late, engine.runner.late) == (0, [])
        assert engine.runner.shapes <= engine.runner.warm
        if min_rows == 0:  # the set is exact: every program was needed (the mix never runs 2 rows alone)
            assert engine.runner.shapes == engine.runner.warm
    finally:
        engine.close()
        watch.close()


@pytest.mark.timeout(300)
def test_programs_past_the_warm_up_compile_while_the_engine_is_idle() -> None:
    """Limits that allow more programs than `warmup_programs`: none compile at start, the engine
    serves at once (what it needs first compiles on first use), and the rest compile while it is
    idle, on their own thread, so the requests after that compile nothing (the demo's RL steps
    met compiles after its SFT warm start, when inference had been idle for minutes)."""
    watch = CompileWatch().install()
    # decode_steps 2: programs of their own (jit's cache is the process's; the test above filled it).
    engine = Engine(preset_source("tiny"), config=dataclasses.replace(CONFIG, min_rows=1, warmup_programs=1,
                                                                     decode_steps=2))
    programs = len(engine.runner.program_set(max_prompt=16, max_tokens=8))
    try:
        assert engine.warm_up() == 0 and programs >= 5
        watch.mark_warm()
        engine.start()
        engine.generate(SamplingRequest(prompt=(1, 2, 3), max_tokens=8), 120)  # served at once: compiled on use
        used_first = set(engine.runner.shapes)
        assert watch.late >= 1 and set(engine.runner.late) == used_first
        deadline = time.monotonic() + 240
        while engine.metrics()["warm_programs"] + len(used_first) < programs:
            assert time.monotonic() < deadline, engine.metrics()
            time.sleep(0.1)
        late_before, ahead = watch.late, watch.ahead
        assert ahead == engine.metrics()["warm_programs"] == programs - len(used_first)
        requests = [SamplingRequest(prompt=tuple(range(1, length + 1)), n=n, max_tokens=8, temperature=1.0)
                    for length in (1, 9, 16) for n in (1, 4)]
        for handle in engine.submit_many(requests):
            handle.result(120)
        assert (watch.late, watch.ahead) == (late_before, ahead), list(watch.late_names)
        assert engine.runner.shapes <= engine.runner.warm | used_first
    finally:
        engine.close()
        watch.close()


@pytest.mark.timeout(120)
def test_without_compile_when_idle_the_larger_set_waits_for_first_use() -> None:
    engine = Engine(preset_source("tiny"), config=dataclasses.replace(CONFIG, min_rows=1, warmup_programs=1,
                                                                     decode_steps=3, compile_when_idle=False))
    watch = CompileWatch().install()
    try:
        assert engine.warm_up() == 0
        watch.mark_warm()
        engine.start()
        time.sleep(1.5)  # idle for three times IDLE_S: nothing compiles
        assert (watch.compiles, watch.ahead, engine.runner.warm) == (0, 0, None)
    finally:
        engine.close()
        watch.close()


def test_idle_order_takes_small_windows_first_and_decode_before_prefill() -> None:
    keys = [("prefill", 16, 64, 128, 16), ("decode", 64, 128), ("prefill", 1, 16, 64, 16), ("decode", 16, 64),
            ("prefill", 8, 16, 64, 16), ("decode", 64, 64), ("prefill", 2, 32, 64, 16)]
    assert idle_order(keys) == [("decode", 16, 64), ("decode", 64, 64), ("prefill", 1, 16, 64, 16),
                                ("prefill", 8, 16, 64, 16), ("prefill", 2, 32, 64, 16), ("decode", 64, 128),
                                ("prefill", 16, 64, 128, 16)]


CLOSE_DURING_COMPILE = """
import sys, time
from arlo.config import InferenceConfig
from arlo.model.source import preset_source
from services.inference.engine import Engine
engine = Engine(preset_source("tiny"), config=InferenceConfig(max_n=4, max_tokens=64, max_prompt_tokens=128,
                                                              warmup_programs=1))
engine.warm_up()
engine.start()
deadline = time.monotonic() + 120
while engine._idle_compiler.compiling is None:
    assert time.monotonic() < deadline
    time.sleep(0.01)
engine.close()  # a compile is in flight: close waits for it
assert engine._idle_compiler.compiling is None
print("closed", flush=True)
sys.exit(0)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attempt", [0, pytest.param(1, marks=pytest.mark.slow)])  # the repeat: slow tier
def test_closing_while_a_program_compiles_in_the_background_exits_cleanly(attempt: int) -> None:
    """The process exits right after `close`, with an idle-time compile in flight when it was
    called: close waits for it (XLA compiling on a daemon thread while the interpreter exits
    aborted an inference service on SIGTERM in CI: "pure virtual method called", -6)."""
    done = subprocess.run([sys.executable, "-c", CLOSE_DURING_COMPILE], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0 and "closed" in done.stdout, (done.returncode, done.stderr[-3000:])
