"""The generation engine core: request validation, sampling, and an atomically swappable policy.

No gRPC here. The engine holds (state, version) as one reference so a weight swap is a
single assignment: a generation already running keeps the weights it started with and
records their version; the next one uses the new weights.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from flax import nnx

from arlo.model import ModelConfig, create_model, get_tokenizer
from arlo.model.generate import generate

MAX_STOP_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineLimits:
    max_n: int
    max_tokens: int
    max_prompt_tokens: int


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
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Policy:
    state: nnx.State
    version: int


@dataclass
class EngineStats:
    requests: int = 0
    generated_tokens: int = 0
    swaps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def validate_request(req: SamplingRequest, limits: EngineLimits, *, vocab_size: int, max_seq_len: int) -> None:
    """Raises ValueError, naming the field and its bound, for anything a client got wrong."""
    checks = [
        (len(req.prompt) >= 1, "prompt_token_ids must not be empty"),
        (len(req.prompt) <= limits.max_prompt_tokens,
         f"prompt_token_ids has {len(req.prompt)} tokens; at most {limits.max_prompt_tokens}"),
        (all(0 <= t < vocab_size for t in req.prompt), f"prompt_token_ids must be in [0, {vocab_size})"),
        (1 <= req.n <= limits.max_n, f"n must be in [1, {limits.max_n}], got {req.n}"),
        (1 <= req.max_tokens <= limits.max_tokens,
         f"sampling.max_tokens must be in [1, {limits.max_tokens}], got {req.max_tokens}"),
        (len(req.prompt) + req.max_tokens <= max_seq_len,
         f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) exceeds the context of {max_seq_len}"),
        (0.0 <= req.temperature <= 10.0, f"sampling.temperature must be in [0, 10], got {req.temperature}"),
        (0.0 <= req.top_p <= 1.0, f"sampling.top_p must be in [0, 1], got {req.top_p}"),
        (0 <= req.top_k <= vocab_size, f"sampling.top_k must be in [0, {vocab_size}], got {req.top_k}"),
        (0.0 <= req.min_p <= 1.0, f"sampling.min_p must be in [0, 1], got {req.min_p}"),
        (len(req.stop_token_ids) <= MAX_STOP_IDS, f"at most {MAX_STOP_IDS} stop_token_ids"),
        (all(0 <= t < vocab_size for t in req.stop_token_ids), f"stop_token_ids must be in [0, {vocab_size})"),
        (len(req.stop_strings) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
        (all(0 < len(s.encode()) <= MAX_STOP_STRING_BYTES for s in req.stop_strings),
         f"stop strings must be 1 to {MAX_STOP_STRING_BYTES} bytes"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


class Engine:
    """One model, one policy reference, generation with per-token version records."""

    def __init__(self, model_name: str, *, seed: int, tokenizer: str, limits: EngineLimits,
                 dtype: str = "float32") -> None:
        self.model_name = model_name
        self.model_cfg = dataclasses.replace(ModelConfig.named(model_name), dtype=dtype)
        self.tokenizer = get_tokenizer(tokenizer)
        self.limits = limits
        self.graphdef, state = nnx.split(create_model(self.model_cfg, seed))
        self._policy = _Policy(state=state, version=0)
        self.stats = EngineStats()

    @property
    def version(self) -> int:
        return self._policy.version

    @property
    def state(self) -> nnx.State:
        return self._policy.state

    def swap(self, state: nnx.State, version: int) -> None:
        """Installs new weights; one reference assignment, so readers see old or new, never a mix."""
        if version <= self._policy.version:
            raise ValueError(f"version {version} is not newer than the served {self._policy.version}")
        self._policy = _Policy(state=state, version=version)
        self.stats.swaps += 1

    def generate(self, req: SamplingRequest) -> list[Sample]:
        validate_request(req, self.limits, vocab_size=self.model_cfg.vocab_size, max_seq_len=self.model_cfg.max_seq_len)
        policy = self._policy
        seed = req.seed if req.seed is not None else secrets.randbits(62)  # never a shared stream
        stop_ids = tuple(req.stop_token_ids) or (self.tokenizer.eos_id,)
        result = generate(
            self.graphdef, policy.state, req.prompt, n=req.n, max_tokens=req.max_tokens,
            temperature=req.temperature, top_p=req.top_p or 1.0, top_k=req.top_k, min_p=req.min_p,
            seed=seed, stop_token_ids=stop_ids, max_seq_len=self.model_cfg.max_seq_len,
        )
        samples = []
        for row in range(req.n):
            length = int(result.lengths[row])
            tokens = [int(t) for t in result.tokens[row, :length]]
            logprobs = [float(x) for x in result.logprobs[row, :length]]
            finish = result.finish_reasons[row]
            cut = self._stop_string_cut(tokens, req.stop_strings)
            if cut is not None:
                tokens, logprobs, finish = tokens[:cut], logprobs[:cut], "stop"
            samples.append(Sample(token_ids=tokens, logprobs=logprobs,
                                  policy_versions=[policy.version] * len(tokens), finish_reason=finish))
        with self.stats.lock:
            self.stats.requests += 1
            self.stats.generated_tokens += sum(len(s.token_ids) for s in samples)
        return samples

    def _stop_string_cut(self, tokens: Sequence[int], stops: Sequence[str]) -> int | None:
        """Shortest prefix whose text contains a stop string (the stop string is kept)."""
        if not stops:
            return None
        for k in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:k])
            if any(s in text for s in stops):
                return k
        return None
