"""Filter replay: the kept set each sampled token was drawn from, recorded by the sampler and
applied by the trainer, so both score a token over the same set of tokens (issue 32).

With top-k sampling (`rollout.sampling.top_k` K > 0) the sampler's filter keeps at most K tokens
per position (fewer after top-p / min-p). The engine returns the K most likely tokens of the
distribution it drew from (the `top_logprobs` machinery): the kept ones carry a finite logprob,
the filtered-out ones the floor. The rollout asks for them (GenerateRequest.return_kept), the
trajectory carries them (Trajectory.kept_token_ids) and the trainer scores each model token over
exactly that set (arlo.model.logprobs.SampledTargets). A bf16 trainer whose own top-k would rank
a near-tie differently then still scores the token over the sampler's set: the only difference
left between the two sides is numeric.

Wire format: int32 little-endian, [tokens, K] row-major, -1 where fewer than K were kept.
Without top-k (top-p or min-p alone) a kept set can be most of the vocabulary: nothing is
recorded and the trainer applies its own filter (`logprob_outside` counts the near-ties); the same
above MAX_KEPT_WIDTH. The inference service compiles its top logprobs at least K wide for its
run's sampling (`serving_inference`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arlo.config import InferenceConfig, RunConfig

NOT_KEPT = -1
MAX_KEPT_WIDTH = 20
"""The widest top-k recorded (4 bytes per id per model token in the stream); above it the trainer
applies its own filter, as without top-k."""
# Mirrors of arlo.model.sampling's (checked by a test): the rollout imports this without JAX.
GREEDY_BELOW = 1e-5
"""Greedy below this temperature: nothing is filtered."""
LOGPROB_FLOOR = -1e4
"""A filtered-out token's logprob as the engine returns it."""


def kept_width(*, temperature: float, top_k: int) -> int:
    """K ids recorded per sampled token under these settings; 0: nothing to record (greedy, no
    top-k cap, or one wider than MAX_KEPT_WIDTH). The temperature is compared as the engine
    does, in float32 (the proto carries a float32: 1e-5 arrives as 9.99999975e-06)."""
    samples = np.float32(temperature) >= np.float32(GREEDY_BELOW)
    return top_k if 0 < top_k <= MAX_KEPT_WIDTH and samples else 0


def run_kept_width(cfg: RunConfig) -> int:
    """The run's filter replay K (0: off): its sampling's `kept_width`, and off with trainer.pack
    (packed rows carry no kept sets: recording them would cost the stream and the intake for
    nothing). One rule for the rollout that asks, the trainer that reads and the engine that
    compiles."""
    s = cfg.rollout.sampling
    return 0 if cfg.trainer.pack else kept_width(temperature=s.temperature, top_k=s.top_k)


def kept_ids(top_ids: np.ndarray, top_logprobs: np.ndarray, width: int) -> np.ndarray:
    """int32 [tokens, width]: the sampler's top ids (`Sample.top_ids`, at least `width` columns)
    that its filter kept (a finite logprob), NOT_KEPT for the filtered-out ones."""
    ids, lps = top_ids[:, :width], top_logprobs[:, :width]
    return np.where(lps > LOGPROB_FLOOR, ids, NOT_KEPT).astype(np.int32)


def pack_kept(kept: np.ndarray | None) -> bytes:
    """Trajectory.kept_token_ids / Completion.kept_token_ids bytes (empty for None)."""
    return b"" if kept is None else np.ascontiguousarray(kept, dtype="<i4").tobytes()


def unpack_kept(data: bytes, *, tokens: int, width: int) -> np.ndarray:
    """int32 [tokens, width] of a packed record; ValueError when its size is not that."""
    want = tokens * width * 4
    if len(data) != want:
        raise ValueError(f"kept_token_ids has {len(data)} bytes; {tokens} model tokens x {width} ids x 4 bytes "
                         f"is {want}")
    return np.frombuffer(data, dtype="<i4").reshape(tokens, width).astype(np.int32)


def serving_inference(cfg: RunConfig) -> InferenceConfig:
    """The run's inference section as its engine serves it: top logprobs compiled at least as
    wide as the run's kept sets (inference.max_top_logprobs is otherwise the OpenAI door's own),
    so the run's rollouts can record them; MAX_KEPT_WIDTH wide on a service shared by several
    runs (inference.runs), whose samplings it does not know."""
    width = MAX_KEPT_WIDTH if cfg.inference.runs else run_kept_width(cfg)
    return dataclasses.replace(cfg.inference, max_top_logprobs=max(cfg.inference.max_top_logprobs, width))
