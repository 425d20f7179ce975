"""bench/long_context.py's paged-KV sections (issue 36, items 1-2): capacity, the prefix cache, and
paged against dense on the same requests.

capacity: sequences in flight on the long-tail mix (80% of episodes 1k tokens, 20% 8k) within the
KV budget of 16 dense slots of 8k positions, paged (inference.page_size 64) over dense (page_size
0: every sequence reserves max_seq_len): `kv_capacity_ratio`, bar >= 3. How many sequences fit is
the scheduler's admission and growth (services/inference/scheduler.py over pages.PagePool): at
the bar's scale the section drives that code alone (no model: prefilling 128k tokens is minutes
on 2 CPU cores and decides nothing) over 400 episodes, each a prompt of its length less 32 tokens
and 32 generated in 8-token decode chunks (an agentic turn's KV is mostly context), and takes the
mean of the sequences in flight over the chunks; it also checks that after every chunk no
sequence holds a page it has not written but its last (`overallocated_pages`, bar 0). The same mix scaled down 8x (128- and
1,024-token episodes, budget 16 x 1,024) then runs through a real engine (the `tiny` preset),
paged and dense: `largest_batch` is the most sequences one decode chunk carried.

prefix: a group of 8 samples of a 2,048-token prompt, sent as 8 requests together as a rollout
worker sends a GRPO group (`prefill_tokens_per_group`, bar = the prompt's length); then 64
episodes whose prompts share a 1,024-token system prompt + tool schemas and differ after it,
submitted together, twice, with a weight swap between: the shared prefix is prefilled once per
version (`shared_prefix_hit_rate`: prompt tokens found in the cache over those looked up, bar
>= 0.95). The `tiny` preset at 4,096 positions (the counts do not depend on the model).

paged_vs_dense: the same greedy float32 requests (mixed lengths, a later turn that hits the prefix
cache, and more sequences than the paged budget holds at once, so some are preempted and
recomputed) on the `small` preset (~25M parameters), paged and dense: equal tokens, and the
largest logprob difference (bar: 1e-4, the last bits of a recomputed prefill against the decode
that first wrote it).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np

CAPACITY_BAR = 3.0
HIT_RATE_BAR = 0.95
LOGPROB_BAR = 1e-4
PAGE = 64
STEPS = 8


def long_tail_lengths(episodes: int, short: int, long: int, seed: int = 0) -> list[int]:
    """80% `short`, 20% `long`, shuffled."""
    n_long = round(episodes * 0.2)
    lengths = [short] * (episodes - n_long) + [long] * n_long
    np.random.default_rng(seed).shuffle(lengths)
    return lengths


def _request(prompt: tuple[int, ...], max_tokens: int, i: int) -> Any:
    from services.inference.requests import SamplingRequest
    from services.inference.scheduler import Request

    return Request(id=i, params=SamplingRequest(prompt=prompt, max_tokens=max_tokens), seed=i, stop_ids=())


GENERATED = 32
"""Tokens each episode generates at the end: an agentic turn's KV is mostly its context (earlier
turns, tool output), so a sequence holds nearly all of its pages from admission on."""


def simulate_in_flight(lengths: list[int], *, page_size: int, budget_positions: int, slot_len: int) -> dict[str, Any]:
    """Drives the engine's scheduler (no model) over episodes of `lengths` tokens (a prompt, then
    GENERATED tokens in decode chunks of STEPS) until all are done; returns the most and the mean
    sequences in flight and the pages held past a sequence's written positions."""
    from services.inference.pages import PagePool
    from services.inference.scheduler import Scheduler

    cache_len = slot_len + STEPS
    size = page_size or cache_len
    pages = budget_positions // size
    s = Scheduler(max_seqs=4096, prefill_tokens=1 << 30, pool=PagePool(pages, size))
    for i, n in enumerate(lengths):
        s.add(_request(tuple((i * 7919 + k) % 30000 for k in range(n - GENERATED)), GENERATED, i))
    most, over, chunks, total = 0, 0, 0, 0
    while s.has_work():
        for item in s.schedule((0,)):
            for seq in item.seqs:
                s.append(seq, [1], [0.0], 0)
        s.pool.written()
        s.grow(STEPS)
        running = s.decoding()
        most, total = max(most, len(running)), total + len(running)
        for seq in running:
            # The chunk writes the KV of positions position .. position + STEPS - 1 (past a
            # sequence's end too: the batch is static), so every page up to there is written.
            written = seq.position + STEPS
            over = max(over, len(seq.pages) - s.pool.pages_for(written))
            left = seq.request.params.max_tokens - len(seq.token_ids)
            s.append(seq, [1] * min(STEPS, left), [0.0] * min(STEPS, left), 0)
            if len(seq.token_ids) >= seq.request.params.max_tokens:
                s.finish(seq, "length")
        chunks += 1
    return {"pages": pages, "page_size": size, "sequences_in_flight": most, "mean_in_flight": total / chunks,
            "overallocated_pages": over, "chunks": chunks, "preemptions": s.preemptions}


def _engine(cfg: Any, **config: Any) -> Any:
    from arlo.config import InferenceConfig
    from arlo.model.source import ModelSource
    from services.inference.engine import Engine

    return Engine(ModelSource.from_config(cfg), config=InferenceConfig(**config))


def capacity(args: argparse.Namespace) -> tuple[list[list[Any]], dict[str, Any]]:
    started = time.perf_counter()
    figures: dict[str, Any] = {}
    rows = []
    lengths = long_tail_lengths(400, 1024, 8192)
    for name, page in (("dense", 0), ("paged", PAGE)):
        figures[name] = simulate_in_flight(lengths, page_size=page, budget_positions=16 * (8192 + STEPS),
                                           slot_len=8192)
        f = figures[name]
        rows.append([f"scheduler, 1k/8k mix, 16 x 8k budget: {name}", f["pages"], f["page_size"],
                     f"{f['mean_in_flight']:.1f} (most {f['sequences_in_flight']})", f["overallocated_pages"],
                     f["preemptions"]])
    ratio = figures["paged"]["mean_in_flight"] / figures["dense"]["mean_in_flight"]
    figures.update(kv_capacity_ratio=ratio, bar=CAPACITY_BAR,
                   met=ratio >= CAPACITY_BAR and figures["paged"]["overallocated_pages"] == 0)
    figures["engine"] = engine_capacity(rows)
    figures["seconds"] = time.perf_counter() - started
    rows.append(["kv_capacity_ratio (scheduler, bar scale: mean in flight)", "", "", f"{ratio:.2f}", "", ""])
    rows.append(["kv_capacity_ratio (engine, 1/8 scale: largest batch)", "", "",
                 f"{figures['engine']['kv_capacity_ratio']:.2f}", "", ""])
    return rows, figures


def engine_capacity(rows: list[list[Any]]) -> dict[str, Any]:
    """The mix scaled down 8x through a real engine, paged and dense, on the same budget."""
    from arlo.model import ModelConfig

    cfg = dataclasses.replace(ModelConfig.named("tiny"), max_seq_len=1024)
    lengths = long_tail_lengths(96, 128, 1024)
    out: dict[str, Any] = {}
    budget_mib = 16 * (1024 + STEPS) * _position_bytes(cfg) / 2**20
    for name, page in (("dense", 0), ("paged", PAGE)):
        engine = _engine(cfg, page_size=page, kv_cache_mib=budget_mib, max_batch=96, max_n=1, max_tokens=GENERATED,
                         max_prompt_tokens=1024, decode_steps=STEPS, prefill_tokens=1 << 20, warmup_programs=0)
        try:
            from services.inference.requests import SamplingRequest

            reqs = [SamplingRequest(prompt=tuple(1 + (i + k) % 250 for k in range(n - GENERATED)),
                                    max_tokens=GENERATED, temperature=1.0, seed=i, ignore_eos=True)
                    for i, n in enumerate(lengths)]
            for handle in engine.submit_many(reqs):
                handle.result(600)
            out[name] = {"pages": engine.runner.pages, "largest_batch": engine.stats.largest_batch,
                         "preemptions": engine.scheduler.preemptions,
                         "pages_left_held": engine.scheduler.pool.used_pages}
        finally:
            engine.close()
        rows.append([f"engine (tiny), 128/1k mix, 16 x 1k budget: {name}", out[name]["pages"], page or 1024 + STEPS,
                     out[name]["largest_batch"], "", out[name]["preemptions"]])
    out["kv_capacity_ratio"] = out["paged"]["largest_batch"] / out["dense"]["largest_batch"]
    return out


def _position_bytes(cfg: Any) -> int:
    from arlo.model.kv_budget import position_bytes

    return position_bytes(cfg)


def prefix(args: argparse.Namespace) -> tuple[list[list[Any]], dict[str, Any]]:
    from arlo.model import ModelConfig
    from services.inference.requests import SamplingRequest

    started = time.perf_counter()
    cfg = dataclasses.replace(ModelConfig.named("tiny"), max_seq_len=4096)
    engine = _engine(cfg, page_size=PAGE, max_batch=64, max_n=8, max_tokens=4, max_prompt_tokens=2100,
                     decode_steps=4, prefill_tokens=1 << 20, warmup_programs=0)
    rng = np.random.default_rng(0)
    try:
        prompt = tuple(int(t) for t in rng.integers(1, 250, 2048))
        group = [SamplingRequest(prompt=prompt, max_tokens=4, temperature=1.0, seed=i) for i in range(8)]
        for handle in engine.submit_many(group):
            handle.result(600)
        per_group = engine.runner.prefill_tokens
        system = tuple(int(t) for t in rng.integers(1, 250, 1024))
        stats = engine.scheduler.pool.stats
        hits, looked = stats.hit_tokens, stats.lookup_tokens
        prefilled = engine.runner.prefill_tokens
        for version in (1, 2):
            engine.swap(engine.state, version)
            episodes = [SamplingRequest(prompt=(*system, *(int(t) for t in rng.integers(1, 250, 40))), max_tokens=4,
                                        temperature=1.0, seed=i) for i in range(64)]
            for handle in engine.submit_many(episodes):
                handle.result(600)
        hit_rate = (stats.hit_tokens - hits) / (stats.lookup_tokens - looked)
        episode_prefill = engine.runner.prefill_tokens - prefilled
    finally:
        engine.close()
    figures = {"prompt_tokens": len(prompt), "group": 8, "prefill_tokens_per_group": per_group,
               "shared_prefix_tokens": len(system), "episodes_per_version": 64, "versions": 2,
               "shared_prefix_hit_rate": hit_rate, "episode_prefill_tokens": episode_prefill,
               "bar_hit_rate": HIT_RATE_BAR, "seconds": time.perf_counter() - started}
    figures["met"] = per_group == len(prompt) and hit_rate >= HIT_RATE_BAR
    rows = [["group of 8 x 2,048-token prompt: prefill tokens", per_group, len(prompt)],
            ["64 episodes x 2 versions, 1,024 shared: hit rate", f"{hit_rate:.3f}", f">= {HIT_RATE_BAR}"],
            ["   their prefill tokens (of 2 x 64 x 1,064)", episode_prefill, ""]]
    return rows, figures


def paged_vs_dense(args: argparse.Namespace) -> tuple[list[list[Any]], dict[str, Any]]:
    from arlo.model import ModelConfig
    from services.inference.requests import SamplingRequest

    started = time.perf_counter()
    cfg = dataclasses.replace(ModelConfig.named("small"), max_seq_len=512)
    rng = np.random.default_rng(1)
    prompts = [tuple(int(t) for t in rng.integers(1, 250, n)) for n in (7, 60, 130, 200, 33, 300, 90, 150)]
    reqs = [SamplingRequest(prompt=p, max_tokens=48, temperature=0.0, ignore_eos=True) for p in prompts]
    results: dict[str, list[Any]] = {}
    preempted = 0
    # 70 pages of 16: what max_n = 2 needs at least (2 x 33) and a few more; the requests' ~89 pages
    # do not fit at once, so the newest are preempted and recomputed.
    for name, page, mib in (("dense", 0, 0.0), ("paged", 16, 70 * 16 * _position_bytes(cfg) / 2**20)):
        engine = _engine(cfg, page_size=page, kv_cache_mib=mib, max_batch=8, max_n=2, max_tokens=64,
                         max_prompt_tokens=512, decode_steps=STEPS, warmup_programs=0)
        try:
            results[name] = [h.result(900)[0] for h in engine.submit_many(reqs)]
            turn = (*prompts[3], *results[name][3].token_ids, 5, 6, 7)  # a later turn: cache hit when paged
            results[name].append(engine.generate(SamplingRequest(prompt=turn, max_tokens=16, temperature=0.0,
                                                                 ignore_eos=True), 900)[0])
            if page:
                preempted = engine.scheduler.preemptions
        finally:
            engine.close()
    same = all(a.token_ids == b.token_ids for a, b in zip(results["paged"], results["dense"], strict=True))
    diff = max(float(np.max(np.abs(np.subtract(a.logprobs, b.logprobs))))
               for a, b in zip(results["paged"], results["dense"], strict=True))
    figures = {"requests": len(results["paged"]), "same_tokens": same, "max_logprob_diff": diff,
               "paged_preemptions": preempted, "bar": LOGPROB_BAR, "met": same and diff <= LOGPROB_BAR,
               "seconds": time.perf_counter() - started}
    return [["small preset, greedy f32: same tokens", same, ""],
            ["   max |logprob paged - dense|", f"{diff:.2e}", f"<= {LOGPROB_BAR:g}"],
            ["   paged preemptions (recomputed)", preempted, ""]], figures


CAPACITY_COLUMNS = ["capacity", "pages", "page size", "sequences in flight (mean over chunks)",
                    "overallocated pages", "preemptions"]
PREFIX_COLUMNS = ["prefix cache", "measured", "bar"]
PAGED_COLUMNS = ["paged vs dense", "measured", "bar"]
