"""`inference`: the inference service's request limits, batching and KV cache."""

from __future__ import annotations

from dataclasses import field

from arlo.choices import AttentionKernel
from arlo.config.base import (
    MAX_POLL_S,
    MAX_WAIT_S,
    MIN_POLL_S,
    MeshConfig,
    ServerConfig,
    _check,
    _frozen,
    check_ranges,
    check_run_id,
    ranged,
)

MIN_KERNEL_PAGE = 16
"""Smallest page the paged-attention kernels take (inference.attention_kernel: pallas)."""


@_frozen
class InferenceConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50051, metrics_port=9101))
    """Where the inference service listens."""
    max_n: int = ranged(64, ge=1, le=1024)
    """Most samples one request may ask for (its `n`)."""
    max_tokens: int = ranged(256, ge=1, le=65536)
    """Most new tokens one request may ask for."""
    max_prompt_tokens: int = ranged(512, ge=1, le=1 << 20)
    """Longest prompt a request may send, in tokens."""
    weight_poll_s: float = ranged(2.0, ge=MIN_POLL_S, le=MAX_POLL_S)
    """Poll the weight pointer this often in case a pub/sub event was missed."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh axes (data/fsdp/tensor; -1 = the rest); see arlo.distributed."""
    max_batch: int = ranged(64, ge=1)
    """Sequences in flight (decoded together) at most; at least max_n. The KV pages free bound them too."""
    kv_cache_mib: float = ranged(0.0, ge=0)
    """KV cache budget, in pages of `page_size` positions; requests queue while the pages are taken.
    0 = as many pages as max_batch sequences of max_seq_len need."""
    page_size: int = ranged(64, ge=4, special={0: "dense"})
    """Positions per KV page (a power of two): a sequence takes pages as it grows and gives them back
    when it ends, so short and long sequences share the budget by what they use, and full pages of a
    common prefix (a group's prompt, a shared system prompt, an episode's earlier turns) are shared
    across requests of the same weight version. 0: one page of max_seq_len per sequence (the dense
    cache: every sequence reserves the longest length, and no prefix is shared)."""
    attention_kernel: AttentionKernel = "xla"
    """How a decode step reads the KV pages. "xla": each chunk gathers its rows' windows (a copy)
    and attends them, on every platform and mesh. "pallas": each step writes its token into the
    page and attends the rows' pages in place with the paged-attention kernels JAX ships (Triton
    on a GPU, Mosaic on a TPU; on a CPU the GPU kernel in interpret mode, for tests, slow). On one
    device, or a mesh of `tensor` alone (each device attends its own kv heads); a mesh with data
    axes, or a model with sliding-window layers (Gemma 2/3), is refused naming this field."""
    decode_steps: int = ranged(8, ge=1, le=1024)
    """Tokens decoded per host round trip: more amortises the sync, fewer admits new requests sooner."""
    prefill_tokens: int = ranged(2048, ge=1)
    """Prompt tokens prefilled per engine step, so a burst of long prompts does not stall decoding."""
    max_prefill_rows: int = ranged(16, ge=1)
    """Prompts prefilled together in one call (at least one request is admitted per step)."""
    max_seq_len: int = ranged(0, ge=0)
    """Prompt + completion tokens one sequence may reach (its page table's length); 0 = the model's max_seq_len."""
    max_top_logprobs: int = ranged(0, ge=0, le=20)
    """Most alternatives per generated token a request may ask for (the OpenAI endpoint's chat
    `top_logprobs`, its completions' `logprobs`): every prefill and decode program then also
    returns, per sampled token, the K most likely tokens of the distribution it was drawn from
    (K is compiled into the programs, so any request's K up to it reuses them). 0: off, the
    programs as without it; a request that asks for alternatives is refused."""
    openai_port: int = ranged(0, ge=0, le=65535, special={-1: "off"})
    """Port of the OpenAI-compatible HTTP endpoint (/v1/chat/completions, /v1/completions, /v1/models)
    on server.host: 0 picks a free one (its URL is in the heartbeat and GetModelInfo), -1 turns it off."""
    openai_max_connections: int = ranged(1024, ge=1, le=1 << 20)
    """Connections the OpenAI endpoint holds open at once (and at most half the process's open-file
    limit): one more is closed as soon as it is accepted, so a flood of idle connections cannot take
    the descriptors gRPC needs. Black-box agents hold about one each while their episode runs."""
    openai_read_timeout_s: float = ranged(30.0, gt=0, le=3600)
    """A connection to the OpenAI endpoint that has not sent a whole request head within this long
    (of connecting, or of its first byte after a reply) is closed, and a request body that has not
    arrived within this long is answered 408: slow or idle clients cannot hold connections for ever."""
    openai_max_episodes: int = ranged(4096, ge=1)
    """Episodes whose OpenAI calls are recorded at once (X-Arlo-Episode); the least recently used is dropped."""
    openai_max_calls: int = ranged(256, ge=1)
    """Calls recorded per episode at most; later ones are served but counted as dropped."""
    openai_episode_ttl_s: float = ranged(1800.0, gt=0, le=MAX_WAIT_S)
    """An episode record nobody fetched (GetEpisode) or extended for this long is dropped."""
    min_rows: int = ranged(0, ge=0)
    """Fewest rows a decode step runs (a power of two; fewer sequences are padded up to it): a
    higher floor means fewer programs to compile. 0 = automatic: 16, where a step costs the same
    at 1 and 16 rows (accelerators; small models anywhere), and 1 on a CPU with a model of 16.8M
    parameters or more, where a step costs in proportion to its rows. A prefill's sampling runs
    at least 16 rows (or this floor when higher), so one call can prefill that many prompts."""
    warmup_programs: int = ranged(16, ge=0)
    """At start, compile every program the limits above allow (max_prompt_tokens, max_tokens,
    max_batch, max_prefill_rows) when they allow at most this many, before serving, so a run
    compiles nothing mid-run; a larger set compiles on first use (the start-up log gives its
    size: tighten the limits to the workload to bring it under). 0: never."""
    compile_when_idle: bool = True
    """A program set larger than `warmup_programs` is compiled in the background instead, one
    program at a time while the engine has served nothing for a moment (an SFT warm start, a
    synchronous run's train step, a quiet endpoint), so the shapes a run needs later are ready
    when it needs them; a shape needed before its turn compiles on first use, as without it.
    Compiles made this way count as `ahead_compiles`, not late ones. False (or `warmup_programs`
    0): the larger set only compiles on first use."""
    runs: tuple[str, ...] = ()
    """Other runs this service serves beside `run_id`, over the same base model: each trains its
    own LoRA adapter (trainer.lora, the same shape in every run) and gets an adapter slot of its own
    here, followed from its own weight pointer, versioned on its own, and batched with the others'
    requests (a request names its run; docs/deploy.md#several-runs-on-one-inference-fleet).
    Empty: this run alone."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        self.server.validate(f"{path}.server")
        for i, run in enumerate(self.runs):
            check_run_id(run, f"{path}.runs[{i}]")
        _check(f"{path}.runs", len(set(self.runs)) == len(self.runs), "lists a run twice")
        _check(f"{path}.min_rows", self.min_rows & (self.min_rows - 1) == 0, "must be 0 (automatic) or a power of two")
        _check(f"{path}.page_size", self.page_size & (self.page_size - 1) == 0, "must be 0 (dense) or a power of two")
        _check(f"{path}.page_size", self.attention_kernel != "pallas" or self.page_size >= MIN_KERNEL_PAGE,
               f"must be at least {MIN_KERNEL_PAGE} with attention_kernel 'pallas' (a kernel block of keys is "
               f"whole pages, and Triton's matmuls want 16 or more; 0, the dense layout, is one page of "
               f"max_seq_len, not a power of two), got {self.page_size}")
        _check(f"{path}.max_batch", self.max_batch >= self.max_n, "must be >= max_n (a request's samples run together)")
        self.mesh.validate(f"{path}.mesh")
