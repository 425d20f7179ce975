"""What a client asks the engine for and what it gets back; bounds checked with messages that name the field.

No JAX and no gRPC here (the bounds are the run's `inference` section): the servicer converts protobuf to these types, the scheduler and
the engine work on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from arlo.config import InferenceConfig

MAX_STOP_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 64
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingRequest:
    prompt: tuple[int, ...]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    """None draws a fresh seed per request: two requests never share a random stream."""
    stop_token_ids: tuple[int, ...] = ()
    """Empty means the tokenizer's end of sequence (unless ignore_eos)."""
    ignore_eos: bool = False
    """No implicit end-of-sequence stop (vLLM's ignore_eos, for benchmarks of fixed length)."""
    stop_strings: tuple[str, ...] = ()
    session_id: str = ""
    """Multi-turn session (n = 1 only): its KV prefix is kept between turns when memory allows."""
    adapter: int = 0
    """The LoRA adapter slot that generates it, on an engine serving several (`Engine(adapters=)`)."""
    return_routing: bool = False
    """Routing replay: return, per generated token, the experts every routed layer chose at the
    position that sampled it (`Sample.routed_experts`); refused for a model without routed experts."""
    top_logprobs: int = 0
    """Per generated token, also return the K most likely tokens of the distribution it was drawn
    from (`Sample.top_ids` / `Sample.top_logprobs`); at most inference.max_top_logprobs. 0: none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str  # one of FINISH_REASONS
    queue_s: float = 0.0
    """Seconds the request waited before its samples were admitted to slots."""
    engine_s: float = 0.0
    """Seconds from admission to the request's completion (prefill and decode)."""
    routed_experts: np.ndarray | None = None
    """With return_routing: int [tokens, routed layers, top_k], token i's record as
    arlo/routing_replay.py describes it; None without."""
    top_ids: np.ndarray | None = None
    """With top_logprobs K > 0: int32 [tokens, K], token i's K most likely tokens, most likely first."""
    top_logprobs: np.ndarray | None = None
    """With top_logprobs K > 0: float32 [tokens, K], their logprobs (token i's own where it is among them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenDelta:
    """Tokens one sample gained in one engine step (what GenerateStream sends)."""

    sample: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    finish_reason: str | None = None
    """Set on the sample's last delta only."""
    routed_experts: np.ndarray | None = None
    """With return_routing: int [len(token_ids), routed layers, top_k] (see Sample)."""
    top_ids: np.ndarray | None = None
    """With top_logprobs K > 0: int32 [len(token_ids), K] (see Sample)."""
    top_logprobs: np.ndarray | None = None
    """With top_logprobs K > 0: float32 [len(token_ids), K] (see Sample)."""


OnTokens = Callable[[TokenDelta], None]
OnDone = Callable[[list[Sample] | BaseException], None]


def validate_request(req: SamplingRequest, limits: InferenceConfig, *, vocab_size: int, max_seq_len: int) -> None:
    """Raises ValueError, naming the field and its bound, for anything a client got wrong."""
    checks = [
        (len(req.prompt) >= 1, "prompt_token_ids must not be empty"),
        (len(req.prompt) <= limits.max_prompt_tokens,
         f"prompt_token_ids has {len(req.prompt)} tokens; at most {limits.max_prompt_tokens}"),
        (all(0 <= t < vocab_size for t in req.prompt), f"prompt_token_ids must be in [0, {vocab_size})"),
        (1 <= req.n <= limits.max_n, f"n must be in [1, {limits.max_n}], got {req.n}"),
        (not req.session_id or req.n == 1, f"session_id needs n = 1 (one conversation), got n = {req.n}"),
        (1 <= req.max_tokens <= limits.max_tokens,
         f"sampling.max_tokens must be in [1, {limits.max_tokens}], got {req.max_tokens}"),
        (len(req.prompt) + req.max_tokens <= max_seq_len,
         f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) exceeds the context of {max_seq_len}"),
        (0.0 <= req.temperature <= 10.0, f"sampling.temperature must be in [0, 10], got {req.temperature}"),
        (0.0 <= req.top_p <= 1.0, f"sampling.top_p must be in [0, 1], got {req.top_p}"),
        (0 <= req.top_k <= vocab_size, f"sampling.top_k must be in [0, {vocab_size}], got {req.top_k}"),
        (0.0 <= req.min_p <= 1.0, f"sampling.min_p must be in [0, 1], got {req.min_p}"),
        (req.seed is None or 0 <= req.seed < 2**64, "sampling.seed must be in [0, 2**64)"),
        (0 <= req.top_logprobs <= limits.max_top_logprobs,
         f"top_logprobs must be in [0, {limits.max_top_logprobs}] (raise inference.max_top_logprobs to return "
         f"more), got {req.top_logprobs}"),
        (len(req.stop_token_ids) <= MAX_STOP_IDS, f"at most {MAX_STOP_IDS} stop_token_ids"),
        (all(0 <= t < vocab_size for t in req.stop_token_ids), f"stop_token_ids must be in [0, {vocab_size})"),
        (len(req.stop_strings) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
        (all(0 < len(s.encode()) <= MAX_STOP_STRING_BYTES for s in req.stop_strings),
         f"stop strings must be 1 to {MAX_STOP_STRING_BYTES} bytes"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def stop_string_cut(decode: Callable[[Sequence[int]], str], tokens: Sequence[int], stops: Sequence[str],
                    *, checked: int) -> int | None:
    """Length of the shortest prefix whose text holds a stop string (the stop string is kept).

    `checked` tokens were already searched on an earlier step, so the cut, if any, lies
    after them: a streamed token is never taken back.
    """
    if not stops or len(tokens) <= checked:
        return None
    if not any(s in decode(tokens) for s in stops):
        return None
    for k in range(max(checked, 0) + 1, len(tokens) + 1):
        text = decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return None
