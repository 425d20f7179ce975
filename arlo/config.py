"""Typed run configuration: frozen dataclasses, loaded from YAML, validated at load.

A run is one YAML file whose sections map onto `RunConfig`'s fields; every field has a
default, so `{}` is a valid (the built-in) config. Unknown keys and wrong types are errors
that name the field's full path, e.g. `trainer.learning_rate: expected float, got 'abc'`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from arlo.choices import Advantage, Aggregation, Dtype, Isolation, KlKind, RatioLevel, Reference, Remat
from arlo.jsonfields import parse_json_object
from arlo.private_files import write_private

T = TypeVar("T")

_RUN_ID_EXTRA = frozenset("-_.")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def _frozen(cls: type[T]) -> type[T]:
    return dataclass(frozen=True, kw_only=True, slots=True)(cls)


def check_run_id(run_id: str, path: str = "run_id") -> None:
    """The one rule for run ids: non-empty, ASCII letters, digits, '-', '_' and '.' (they name Redis
    keys, and keep glob characters out of SCAN patterns). Raises ConfigError naming `path`."""
    ok = bool(run_id) and all((c.isascii() and c.isalnum()) or c in _RUN_ID_EXTRA for c in run_id)
    _check(path, ok, f"must be non-empty and use only letters, digits, '-', '_' and '.', got {run_id!r}")


def _check(path: str, ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


@_frozen
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL; `arlo up` starts a local, persistent redis-server at this port when nothing answers here."""
    socket_timeout_s: float = 10.0
    """Socket timeout; blocking reads always block for less than this (redis-py raises otherwise)."""
    max_backlog: int = 4096
    """Unread trajectories allowed in the stream before producers are told to back off."""
    reconnect_max_s: float = 5.0
    """Cap of the exponential reconnect backoff."""

    def validate(self, path: str) -> None:
        _check(f"{path}.url", self.url.startswith(("redis://", "rediss://", "unix://")), "must be a redis:// URL")
        _check(f"{path}.max_backlog", self.max_backlog >= 1, "must be >= 1")


@_frozen
class TlsConfig:
    """TLS for every server and client channel (PEM files; a pod mounts its own at these paths)."""

    enabled: bool = False
    """Serve and dial TLS instead of plaintext."""
    cert_file: str = ""
    """Certificate chain this process presents: as a server, and as a client under mTLS."""
    key_file: str = ""
    """Private key of cert_file."""
    ca_file: str = ""
    """CA bundle that verifies peers: servers for clients (empty: system roots), clients for mTLS servers."""
    require_client_cert: bool = False
    """mTLS: servers refuse clients without a certificate signed by ca_file."""
    server_name: str = ""
    """Name clients check in the server certificate instead of the target host (e.g. a shared service cert)."""

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        _check(f"{path}.cert_file", bool(self.cert_file), "must be set when tls is enabled")
        _check(f"{path}.key_file", bool(self.key_file), "must be set when tls is enabled")
        _check(f"{path}.ca_file", not self.require_client_cert or bool(self.ca_file),
               "must be set with require_client_cert (it verifies client certificates)")


@_frozen
class AuthConfig:
    token_env: str = "ARLO_TOKEN"
    """Environment variable holding the bearer token."""
    token_file: str = ""
    """File holding the token (used when the variable is unset)."""
    disabled: bool = False
    """Serve without auth. Only ever on when set explicitly."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """Transport security of every RPC (the token alone travels in the clear without it)."""

    def validate(self, path: str) -> None:
        self.tls.validate(f"{path}.tls")


@_frozen
class ServerConfig:
    """Where one service listens. Port 0 picks a free port (tests)."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 for all (others then dial $ARLO_ADVERTISE_HOST or the host name)."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    metrics_port: int = 0
    """Prometheus /metrics port; 0 picks a free port, -1 disables it."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message sent or received (weights travel in chunks below it)."""
    grace_s: float = 5.0
    """On SIGTERM: NOT_SERVING, then this long for in-flight RPCs to finish."""
    max_concurrent_rpcs: int = 0
    """RPCs in flight on the whole server (health included); the excess gets RESOURCE_EXHAUSTED. 0 = no cap."""
    max_rpcs_per_client: int = 1024
    """RPCs in flight from one client connection (health exempt); the excess gets RESOURCE_EXHAUSTED. 0 = no cap."""
    max_health_watches: int = 256
    """Open grpc.health.v1 Watch streams on the server (unauthenticated, long-lived); the excess gets RESOURCE_EXHAUSTED."""
    max_health_watches_per_client: int = 16
    """Open health Watch streams from one client host (all its connections); the excess gets RESOURCE_EXHAUSTED."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def validate(self, path: str) -> None:
        _check(f"{path}.port", 0 <= self.port < 65536, "must be in [0, 65535]")
        _check(f"{path}.metrics_port", -1 <= self.metrics_port < 65536, "must be in [-1, 65535]")
        _check(f"{path}.max_message_bytes", 1024 <= self.max_message_bytes < 2**31, "must be in [1 KiB, 2 GiB)")
        _check(f"{path}.max_concurrent_rpcs", self.max_concurrent_rpcs >= 0, "must be >= 0 (0 = no cap)")
        _check(f"{path}.max_rpcs_per_client", self.max_rpcs_per_client >= 0, "must be >= 0 (0 = no cap)")
        _check(f"{path}.max_health_watches", self.max_health_watches >= 1, "must be >= 1")
        _check(f"{path}.max_health_watches_per_client", self.max_health_watches_per_client >= 1, "must be >= 1")


@_frozen
class ModelSpec:
    """The policy: a named preset (random init from `seed`) or a local Hugging Face checkpoint."""

    name: str = "tiny"
    """Preset name (tiny, demo, small; see arlo.model.config), used when `path` is empty."""
    path: str = ""
    """A local Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
    tokenizer_config.json with a chat_template); wins over `name`, and its weights are version 0."""
    tokenizer: str = "byte"
    """Tokenizer of a preset ("byte") or a Hugging Face directory holding tokenizer.json; with
    `path` set, "byte" (the default) means the checkpoint's own tokenizer."""
    seed: int = 0
    """Seed of a preset's initial weights (trainer and a cold inference server agree on it)."""
    dtype: Dtype = "float32"
    """Compute dtype of the forward pass (matmuls); norms and softmax run in float32."""
    param_dtype: Dtype = "float32"
    """Dtype of the stored parameters that inference serves and every publish carries
    (bfloat16 halves the bytes); the trainer keeps a float32 master copy either way."""
    max_seq_len: int = 0
    """Longest sequence (prompt + generated); 0 = the preset's or the checkpoint's
    max_position_embeddings (often far more than a run needs: cap it)."""

    def validate(self, path: str) -> None:
        _check(f"{path}.max_seq_len", self.max_seq_len >= 0, "must be >= 0 (0 = the model's own)")
        if self.path:
            from arlo.model.source import check_model_dir

            try:
                check_model_dir(Path(self.path))
            except ValueError as e:
                raise ConfigError(f"{path}.path: {e}") from None
        else:
            from arlo.model import ModelConfig

            try:
                ModelConfig.named(self.name)
            except ValueError as e:
                raise ConfigError(f"{path}.name: {e}") from None
            if self.tokenizer != "byte" and not Path(self.tokenizer).is_dir():
                raise ConfigError(f"{path}.tokenizer: must be 'byte' or a Hugging Face directory, "
                                  f"got {self.tokenizer!r}")

    def source(self) -> Any:
        """The arlo.model.source ModelSource every service builds its model and tokenizer from."""
        from arlo.model.source import resolve_model

        return resolve_model(name=self.name, path=self.path, tokenizer=self.tokenizer, seed=self.seed,
                             dtype=self.dtype, param_dtype=self.param_dtype, max_seq_len=self.max_seq_len)


@_frozen
class MeshConfig:
    """Named device mesh axes, e.g. data x fsdp x tensor.

    One size may be -1: "all the devices the other axes leave". The defaults put every
    device on `data` (pure data parallelism), which is right on one device too.
    """

    axis_names: tuple[str, ...] = ("data", "fsdp", "tensor")
    """Names of the mesh axes, outermost first."""
    axis_sizes: tuple[int, ...] = (-1, 1, 1)
    """Size of each axis; one may be -1 (all the devices the others leave)."""
    dcn_axis: str = "data"
    """With devices of several TPU slices (multislice), this axis is split across slices
    (over the data-centre network); the others stay inside a slice (ICI)."""

    def validate(self, path: str = "mesh") -> None:
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise ConfigError(f"{path}.axis_sizes: needs one size per axis name "
                              f"({len(self.axis_names)} names, {len(self.axis_sizes)} sizes)")
        if len(set(self.axis_names)) != len(self.axis_names) or not all(self.axis_names):
            raise ConfigError(f"{path}.axis_names: must be distinct and non-empty, got {list(self.axis_names)}")
        if any(s == 0 or s < -1 for s in self.axis_sizes):
            raise ConfigError(f"{path}.axis_sizes: each must be >= 1 or -1 (the rest), got {list(self.axis_sizes)}")
        if list(self.axis_sizes).count(-1) > 1:
            raise ConfigError(f"{path}.axis_sizes: at most one -1, got {list(self.axis_sizes)}")
        if self.dcn_axis not in self.axis_names:
            raise ConfigError(f"{path}.dcn_axis: {self.dcn_axis!r} is not one of {list(self.axis_names)}")

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """The concrete axis sizes for `num_devices` devices (-1 resolved); ValueError if they don't fit."""
        self.validate()
        known = math.prod(s for s in self.axis_sizes if s != -1)
        if -1 in self.axis_sizes:
            if num_devices % known:
                raise ValueError(f"mesh {self._describe()} does not divide {num_devices} devices "
                                 f"(the fixed axes need a multiple of {known})")
            return tuple(num_devices // known if s == -1 else s for s in self.axis_sizes)
        if known != num_devices:
            raise ValueError(f"mesh {self._describe()} has {known} devices, but there are {num_devices}; "
                             "make one axis -1 to take the rest")
        return tuple(self.axis_sizes)

    def _describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes, strict=True))


@_frozen
class InferenceConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50051, metrics_port=9101))
    """Where the inference service listens."""
    max_n: int = 64
    """Most samples one request may ask for (its `n`)."""
    max_tokens: int = 256
    """Most new tokens one request may ask for."""
    max_prompt_tokens: int = 512
    """Longest prompt a request may send, in tokens."""
    weight_poll_s: float = 2.0
    """Poll the weight pointer this often in case a pub/sub event was missed."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh axes (data/fsdp/tensor; -1 = the rest); see arlo.distributed."""
    max_batch: int = 64
    """Sequences decoded together (engine slots); at least max_n."""
    kv_cache_mib: float = 0.0
    """KV cache budget; fewer slots are made when it holds fewer, and requests then queue. 0 = max_batch full-length slots."""
    decode_steps: int = 8
    """Tokens decoded per host round trip: more amortises the sync, fewer admits new requests sooner."""
    prefill_tokens: int = 2048
    """Prompt tokens prefilled per engine step, so a burst of long prompts does not stall decoding."""
    max_prefill_rows: int = 16
    """Prompts prefilled together in one call (at least one request is admitted per step)."""
    max_seq_len: int = 0
    """Prompt + completion tokens one slot holds (KV cache length); 0 = the model's max_seq_len."""
    openai_port: int = 0
    """Port of the OpenAI-compatible HTTP endpoint (/v1/chat/completions, /v1/completions, /v1/models)
    on server.host: 0 picks a free one (its URL is in the heartbeat and GetModelInfo), -1 turns it off."""
    openai_max_episodes: int = 4096
    """Episodes whose OpenAI calls are recorded at once (X-Arlo-Episode); the least recently used is dropped."""
    openai_max_calls: int = 256
    """Calls recorded per episode at most; later ones are served but counted as dropped."""
    openai_episode_ttl_s: float = 1800.0
    """An episode record nobody fetched (GetEpisode) or extended for this long is dropped."""
    warmup_programs: int = 16
    """At start, compile every program the limits above allow (max_prompt_tokens, max_tokens,
    max_batch, max_prefill_rows) when they allow at most this many, before serving, so a run
    compiles nothing mid-run; a larger set compiles on first use (the start-up log gives its
    size: tighten the limits to the workload to bring it under). 0: never."""

    def validate(self, path: str) -> None:
        self.server.validate(f"{path}.server")
        _check(f"{path}.warmup_programs", self.warmup_programs >= 0, "must be >= 0")
        _check(f"{path}.openai_port", -1 <= self.openai_port < 65536, "must be in [-1, 65535] (0 = free, -1 = off)")
        _check(f"{path}.openai_max_episodes", self.openai_max_episodes >= 1, "must be >= 1")
        _check(f"{path}.openai_max_calls", self.openai_max_calls >= 1, "must be >= 1")
        _check(f"{path}.openai_episode_ttl_s", self.openai_episode_ttl_s > 0, "must be > 0")
        _check(f"{path}.max_n", 1 <= self.max_n <= 1024, "must be in [1, 1024]")
        _check(f"{path}.max_batch", self.max_batch >= self.max_n, "must be >= max_n (a request's samples run together)")
        _check(f"{path}.kv_cache_mib", self.kv_cache_mib >= 0, "must be >= 0")
        _check(f"{path}.decode_steps", 1 <= self.decode_steps <= 1024, "must be in [1, 1024]")
        _check(f"{path}.prefill_tokens", self.prefill_tokens >= 1, "must be >= 1")
        _check(f"{path}.max_prefill_rows", self.max_prefill_rows >= 1, "must be >= 1")
        _check(f"{path}.max_seq_len", self.max_seq_len >= 0, "must be >= 0 (0 = the model's)")
        _check(f"{path}.max_tokens", 1 <= self.max_tokens <= 65536, "must be in [1, 65536]")
        _check(f"{path}.max_prompt_tokens", 1 <= self.max_prompt_tokens <= 1 << 20, "must be in [1, 1048576]")
        _check(f"{path}.weight_poll_s", self.weight_poll_s > 0, "must be > 0")
        self.mesh.validate(f"{path}.mesh")


@_frozen
class AlgorithmConfig:
    """The RL objective. Defaults are GRPO; the other fields switch on its known variants."""

    advantage: Advantage = "grpo"
    """"grpo", "dr_grpo" (no std scaling), "rloo", "reinforce_pp" (batch whitening), or "gae":
    PPO with a learned critic (a value head on a copy of the policy backbone, its own AdamW),
    per-token advantages by GAE over the model tokens (docs/algorithms.md)."""
    clip_eps: float = 0.2
    """PPO clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    clip_eps_high: float = 0.0
    """Upper clip (DAPO clip-higher); 0 means the same as clip_eps."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1; 0 disables."""
    ratio_level: RatioLevel = "token"
    """"token" (PPO/GRPO) or "sequence" (GSPO)."""
    aggregation: Aggregation = "token_mean"
    """"token_mean", "seq_mean_token_mean" or "seq_sum_norm" (needs norm_constant)."""
    norm_constant: float = 0.0
    """Divisor of "seq_sum_norm" per sequence (Dr. GRPO: a fixed token budget, so length does not bias the loss)."""
    decoupled: bool = False
    """Clip the ratio against the trainer's own logprobs at the batch's start (the proximal
    policy) instead of the sampler's; the sampler's logprobs then only enter through is_cap.
    Implied by is_cap > 0."""
    is_cap: float = 0.0
    """Truncated importance sampling (TIS, as verl and TRL ship it): the ratio is against the
    proximal policy and each token's loss is weighted by min(pi_proximal / pi_sampler, is_cap),
    correcting for a stale or numerically different sampler; 0 disables."""
    kl_coef: float = 0.0
    """KL to the reference policy; 0 disables (and holds no reference copy)."""
    reference: Reference = "initial"
    """The KL reference: "initial" (the loaded checkpoint or the preset's init) or "after_sft"
    (the policy once the SFT warm start is done; "initial" when there is none)."""
    kl_kind: KlKind = "k3"
    """KL estimator (Schulman's k1, k2 or k3) of the KL term."""
    kl_in_reward: bool = False
    """Subtract kl_coef x the sequence's summed KL from its reward instead of adding a loss term."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 disables."""
    filter_zero_variance: bool = False
    """Dynamic sampling: drop groups whose rewards are all equal (their advantage is 0)."""
    overlong_max_tokens: int = 0
    """Generated tokens past which the overlong penalty is -1 (DAPO); 0 disables."""
    overlong_buffer_tokens: int = 0
    """Soft overlong penalty on generated tokens; both 0 disables."""
    gae_gamma: float = 1.0
    """advantage "gae": the discount per model token (1: undiscounted, as for a final reward)."""
    gae_lambda: float = 0.95
    """advantage "gae": GAE's lambda (1: Monte-Carlo returns minus the value, 0: one-step TD)."""
    value_clip: float = 0.2
    """advantage "gae": PPO's clipped value loss, the new value kept within +-value_clip of the
    batch-start value (the loss is the larger of the clipped and unclipped errors); 0 disables."""
    critic_learning_rate: float = 0.0
    """advantage "gae": peak AdamW learning rate of the critic (the trainer's warmup, decay, weight
    decay and grad-norm clip); 0: trainer.learning_rate."""
    whiten_advantages: bool = True
    """advantage "gae": whiten the per-token advantages over the batch's model tokens (the returns
    the critic learns are not whitened)."""

    def validate(self, path: str) -> None:
        _check(f"{path}.clip_eps", 0 < self.clip_eps < 1, "must be in (0, 1)")
        _check(f"{path}.clip_eps_high", 0 <= self.clip_eps_high < 10, "must be in [0, 10)")
        _check(f"{path}.dual_clip", self.dual_clip == 0 or self.dual_clip > 1, "must be 0 (off) or > 1")
        _check(f"{path}.norm_constant", self.aggregation != "seq_sum_norm" or self.norm_constant > 0,
               "must be > 0 with aggregation seq_sum_norm")
        _check(f"{path}.is_cap", self.is_cap >= 0, "must be >= 0")
        _check(f"{path}.kl_coef", self.kl_coef >= 0, "must be >= 0")
        _check(f"{path}.entropy_coef", self.entropy_coef >= 0, "must be >= 0")
        _check(f"{path}.gae_gamma", 0 <= self.gae_gamma <= 1, "must be in [0, 1]")
        _check(f"{path}.gae_lambda", 0 <= self.gae_lambda <= 1, "must be in [0, 1]")
        _check(f"{path}.value_clip", self.value_clip >= 0, "must be >= 0 (0: no value clipping)")
        _check(f"{path}.critic_learning_rate", 0 <= self.critic_learning_rate < 1, "must be in [0, 1)")
        _check(f"{path}.overlong_buffer_tokens",
               0 <= self.overlong_buffer_tokens <= self.overlong_max_tokens or self.overlong_max_tokens == 0,
               "must be in [0, overlong_max_tokens]")


@_frozen
class SFTConfig:
    """A supervised warm start before RL: the same learner, cross-entropy on the demonstrations'
    assistant tokens. It runs first when the trainer is resumed, then RL takes over."""

    data: str = ""
    """Demonstrations: a JSONL path (one {"messages": [{role, content, ...}, ...], "tools": [...]}
    per line; messages may carry tool_calls and tool results with their name, `tools` is optional)
    or a built-in set ("builtin:arith", "builtin:arith_tool"). Rendered with the model's chat template."""
    steps: int = 0
    """SFT optimizer steps before RL; 0 disables the warm start."""
    batch_size: int = 64
    """Demonstrations per SFT step."""
    learning_rate: float = 0.0
    """0: trainer.learning_rate. SFT has its own AdamW state; RL starts with a fresh one."""
    warmup_steps: int = 20
    """Linear warmup of the SFT learning rate, in steps."""

    def validate(self, path: str) -> None:
        _check(f"{path}.steps", self.steps >= 0, "must be >= 0")
        _check(f"{path}.data", not self.steps or bool(self.data), "must name the demonstrations when steps > 0")
        _check(f"{path}.batch_size", self.batch_size >= 1, "must be >= 1")
        _check(f"{path}.learning_rate", 0 <= self.learning_rate < 1, "must be in [0, 1)")
        _check(f"{path}.warmup_steps", self.warmup_steps >= 0, "must be >= 0")


@_frozen
class TrainerConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50052, metrics_port=9102))
    """Where the trainer service listens (and serves weights from)."""
    groups_per_step: int = 4
    """GRPO groups in one optimizer step."""
    micro_batch_size: int = 0
    """Rows per micro-batch (gradient accumulation); 0 = the whole batch at once."""
    learning_rate: float = 1e-3
    """Peak AdamW learning rate of RL."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warmup from 0, in optimizer steps (ppo_epochs x mini_batches per batch)."""
    total_steps: int = 0
    """> 0: cosine decay over this many optimizer steps."""
    ppo_epochs: int = 1
    """Passes over each batch. With several updates per batch the proximal policy is the
    trainer's own logprobs at the batch's start, computed once (one forward pass, no gradient)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: each epoch shuffles the batch's rows into this many
    mini-batches (never more than its rows). One published version per batch either way."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL objective (GRPO and its variants)."""
    max_staleness: int = 1
    """No trained token is more than this many versions behind the version its step trains from
    (groups are dropped as stale at intake and again just before their step); 0 = on-policy."""
    checkpoint_dir: str = ""
    """Orbax checkpoint directory; empty disables checkpoints."""
    checkpoint_every: int = 0
    """Write a checkpoint every k versions; 0 disables."""
    read_block_ms: int = 1000
    """How long one read of the trajectory stream blocks waiting for data."""
    remat: Remat = "none"
    """Activation rematerialisation: "none", "full" (recompute each layer) or "dots" (keep matmul outputs)."""
    logprob_chunk: int = 0
    """> 0: compute logprobs in pieces of this many tokens (never [batch, length, vocab] logits whole)."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh axes (data/fsdp/tensor; -1 = the rest); see arlo.distributed."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Optional supervised warm start on demonstrations before RL."""
    start_paused: bool = False
    """Take no step until a Resume RPC: `arlo up`/`demo` set it, so that `arlo train` drives the run
    (evaluation first, then the warm start, then RL). False: train as soon as data arrives."""
    warmup_programs: int = 3
    """At start, compile the RL step for every batch length bucket up to the longest episode
    (`rollout.max_episode_tokens`, within the model's context) when there are at most this many
    buckets, so no step compiles mid-run; more buckets compile on first use (each logged). 0: never."""

    def validate(self, path: str) -> None:
        self.server.validate(f"{path}.server")
        self.sft.validate(f"{path}.sft")
        _check(f"{path}.warmup_programs", self.warmup_programs >= 0, "must be >= 0")
        _check(f"{path}.groups_per_step", self.groups_per_step >= 1, "must be >= 1")
        _check(f"{path}.logprob_chunk", self.logprob_chunk >= 0, "must be >= 0")
        self.mesh.validate(f"{path}.mesh")
        _check(f"{path}.micro_batch_size", self.micro_batch_size >= 0, "must be >= 0")
        _check(f"{path}.ppo_epochs", 1 <= self.ppo_epochs <= 64, "must be in [1, 64]")
        _check(f"{path}.mini_batches", 1 <= self.mini_batches <= 1024, "must be in [1, 1024]")
        _check(f"{path}.learning_rate", 0 < self.learning_rate < 1, "must be in (0, 1)")
        _check(f"{path}.weight_decay", self.weight_decay >= 0, "must be >= 0")
        _check(f"{path}.warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        _check(f"{path}.total_steps", self.total_steps >= 0, "must be >= 0")
        self.algorithm.validate(f"{path}.algorithm")
        _check(f"{path}.max_staleness", self.max_staleness >= 0, "must be >= 0")
        _check(f"{path}.checkpoint_every", self.checkpoint_every >= 0, "must be >= 0")
        _check(f"{path}.checkpoint_every", not self.checkpoint_every or bool(self.checkpoint_dir),
               "needs checkpoint_dir")


@_frozen
class SandboxConfig:
    """Limits for untrusted code (env code execution, reward code tests)."""

    cpu_seconds: int = 5
    """CPU time limit (RLIMIT_CPU) of the sandboxed process."""
    memory_mb: int = 512
    """Memory of the whole tool call (all its processes together, one cgroup) and address-space limit of each
    process; where no cgroup can be created, only the per-process limit holds (docs/reliability.md)."""
    file_size_mb: int = 16
    """Largest file the sandboxed process may write (RLIMIT_FSIZE)."""
    max_processes: int = 32
    """Processes (threads included) the tool call may run at once: its cgroup's pids.max, and RLIMIT_NPROC."""
    wall_timeout_s: float = 10.0
    """Wall-clock limit; past it the whole process group is killed."""
    isolation: Isolation = "auto"
    """"auto" (bubblewrap if installed, else unshare; says so when namespaces are refused), "bwrap", "unshare", "none"."""
    uid: int = 65534
    """Unprivileged uid the code runs as (when started as root)."""
    max_output_bytes: int = 65536
    """stdout/stderr are each cut to this many bytes."""

    def validate(self, path: str) -> None:
        _check(f"{path}.cpu_seconds", 1 <= self.cpu_seconds <= 3600, "must be in [1, 3600]")
        _check(f"{path}.memory_mb", 16 <= self.memory_mb <= 1 << 20, "must be in [16, 1048576]")
        _check(f"{path}.file_size_mb", 1 <= self.file_size_mb <= 1 << 20, "must be in [1, 1048576]")
        _check(f"{path}.max_processes", 1 <= self.max_processes <= 4096, "must be in [1, 4096]")
        _check(f"{path}.wall_timeout_s", 0 < self.wall_timeout_s <= 3600, "must be in (0, 3600]")
        _check(f"{path}.max_output_bytes", 1024 <= self.max_output_bytes <= 1 << 24, "must be in [1 KiB, 16 MiB]")


@_frozen
class RemoteEnvConfig:
    """An external environment service (implements arlo.v1.Environment) proxied by the gateway."""

    address: str
    """host:port (or a dns:/// target) of the remote Environment service."""
    env_names: tuple[str, ...] = ()
    """Environment names served by this backend; empty means ask it (ListEnvironments) at start."""
    max_concurrency: int = 64
    """In-flight calls to this backend; more wait."""
    timeout_s: float = 30.0
    """Deadline of each call (shortened to the caller's remaining deadline)."""
    retries: int = 2
    """Retries of idempotent calls (ListEnvironments, Close) on UNAVAILABLE."""
    breaker_failures: int = 5
    """Consecutive failures that open the circuit breaker."""
    breaker_reset_s: float = 10.0
    """How long an open breaker fails fast before letting one call through."""
    token_env: str = ""
    """Env var with the backend's bearer token; empty sends the gateway's own token."""

    def validate(self, path: str) -> None:
        _check(f"{path}.address", bool(self.address), "must be set")
        _check(f"{path}.max_concurrency", self.max_concurrency >= 1, "must be >= 1")
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")
        _check(f"{path}.retries", 0 <= self.retries <= 10, "must be in [0, 10]")
        _check(f"{path}.breaker_failures", self.breaker_failures >= 1, "must be >= 1")
        _check(f"{path}.breaker_reset_s", self.breaker_reset_s > 0, "must be > 0")


@_frozen
class EnvPluginConfig:
    """An environment from the user's package, registered under `name` at gateway start."""

    name: str
    """The environment name clients Reset with; must not clash with a built-in or a remote."""
    target: str
    """"package.module:attr": an `EnvSpec`, a class (instantiated once per session), or a factory
    taking the `EnvContext` and returning an `EnvSpec`."""
    description: str = ""
    """Overrides the description ListEnvironments shows (default: the spec's, or the class docstring)."""

    def validate(self, path: str) -> None:
        _check(f"{path}.name", bool(self.name), "must be set")
        module, _, attr = self.target.partition(":")
        _check(f"{path}.target", bool(module) and bool(attr), "must look like 'package.module:attr'")


@_frozen
class McpServerConfig:
    """An MCP tool server whose tools make the environment `mcp:<name>` (see docs/mcp.md). Set exactly
    one of `command` (the gateway runs it and talks over its stdin/stdout) or `url` (streamable HTTP)."""

    name: str
    """The environment is `mcp:<name>`; letters, digits, '-', '_' and '.'."""
    command: tuple[str, ...] = ()
    """stdio: the program and its arguments, e.g. ["python", "-m", "my_tools"]; run by the gateway."""
    env: dict[str, str] = field(default_factory=dict)
    """stdio: environment variables for the server, over a minimal default set (HOME, PATH, ...)."""
    cwd: str = ""
    """stdio: the server's working directory; empty is the gateway's."""
    url: str = ""
    """streamable HTTP: the server's endpoint, e.g. "http://127.0.0.1:8000/mcp"."""
    headers: dict[str, str] = field(default_factory=dict)
    """streamable HTTP: headers sent with every request (e.g. Authorization)."""
    timeout_s: float = 30.0
    """Deadline of one tool call (shortened to the caller's remaining deadline); past it the agent
    gets an error observation."""
    connect_timeout_s: float = 20.0
    """Deadline of (re)connecting: starting the process or reaching the URL, and the MCP handshake."""
    max_concurrency: int = 64
    """Tool calls in flight on this server; more wait (within their deadline)."""
    breaker_failures: int = 3
    """Consecutive failures (crashes, timeouts, failed connects) that open the circuit breaker."""
    breaker_reset_s: float = 5.0
    """How long an open breaker fails fast before one reconnect is tried: the restart backoff."""
    max_turns: int = 8
    """Upper bound on an episode's turns (Reset's config may ask for fewer)."""
    description: str = ""
    """What ListEnvironments says about the environment; empty describes the server's tools."""

    def validate(self, path: str) -> None:
        _check(f"{path}.name", bool(self.name) and all(c.isascii() and (c.isalnum() or c in "-_.") for c in self.name),
               f"must be non-empty and use only letters, digits, '-', '_' and '.', got {self.name!r}")
        _check(path, bool(self.command) != bool(self.url),
               "set exactly one of command (a stdio server) or url (a streamable HTTP server)")
        if self.command:
            _check(f"{path}.command", all(self.command), "must not hold empty strings")
            _check(f"{path}.headers", not self.headers, "is for url servers; a stdio server takes env")
        else:
            _check(f"{path}.url", self.url.startswith(("http://", "https://")), f"must be http(s)://..., got {self.url!r}")
            _check(f"{path}.env", not self.env and not self.cwd, "env and cwd are for command servers")
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")
        _check(f"{path}.connect_timeout_s", self.connect_timeout_s > 0, "must be > 0")
        _check(f"{path}.max_concurrency", self.max_concurrency >= 1, "must be >= 1")
        _check(f"{path}.breaker_failures", self.breaker_failures >= 1, "must be >= 1")
        _check(f"{path}.breaker_reset_s", self.breaker_reset_s > 0, "must be > 0")
        _check(f"{path}.max_turns", 1 <= self.max_turns <= 64, "must be in [1, 64]")


@_frozen
class EnvGatewayConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50053, metrics_port=9103))
    """Where the environment gateway listens."""
    session_idle_timeout_s: float = 600.0
    """An episode session untouched this long is closed and its state freed."""
    max_sessions: int = 10000
    """Live sessions at most; new ones are refused past it."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits for environments that run untrusted code."""
    remotes: tuple[RemoteEnvConfig, ...] = ()
    """External Environment services whose environments the gateway proxies."""
    retrieval_docs_dir: str = ""
    """Directory of .txt/.md documents for the retrieval env; empty uses the built-in set."""
    dataset_roots: tuple[str, ...] = (".",)
    """Directories the dataset environment may read from (relative ones from the gateway's working
    directory at start; each must exist). A dataset path outside all of them, after resolving
    symlinks and "..", is refused with INVALID_ARGUMENT: the path comes from clients; so is a file
    a save_to_disk directory names, and anything in $ARLO_HOME (unless a root is inside it).
    Default: the working directory only; [] allows no dataset files."""
    plugins: tuple[EnvPluginConfig, ...] = ()
    """Environments from your own package (see docs/environments.md); a broken one stops start-up."""
    mcp_servers: tuple[McpServerConfig, ...] = ()
    """MCP tool servers, each served as the environment `mcp:<name>` (see docs/mcp.md)."""

    def validate(self, path: str) -> None:
        self.server.validate(f"{path}.server")
        _check(f"{path}.session_idle_timeout_s", self.session_idle_timeout_s > 0, "must be > 0")
        self.sandbox.validate(f"{path}.sandbox")
        for i, root in enumerate(self.dataset_roots):
            _check(f"{path}.dataset_roots[{i}]", bool(root.strip()), "must be a directory, not empty")
        for i, remote in enumerate(self.remotes):
            remote.validate(f"{path}.remotes[{i}]")
        names: set[str] = set()
        for i, plugin in enumerate(self.plugins):
            plugin.validate(f"{path}.plugins[{i}]")
            _check(f"{path}.plugins[{i}].name", plugin.name not in names, f"repeats {plugin.name!r}")
            names.add(plugin.name)
        servers: set[str] = set()
        for i, server in enumerate(self.mcp_servers):
            server.validate(f"{path}.mcp_servers[{i}]")
            _check(f"{path}.mcp_servers[{i}].name", server.name not in servers, f"repeats {server.name!r}")
            servers.add(server.name)


@_frozen
class RewardPluginConfig:
    """A user verifier: `target` is "package.module:function", registered under `name`."""

    name: str
    """Name the verifier is registered (and asked for) under."""
    target: str
    """"package.module:function" of the verifier."""
    description: str = ""
    """Shown in the reward function listing; empty uses the function's docstring."""

    def validate(self, path: str) -> None:
        _check(f"{path}.name", bool(self.name), "must be set")
        module, _, fn = self.target.partition(":")
        _check(f"{path}.target", bool(module) and bool(fn), "must look like 'package.module:function'")


@_frozen
class RewardConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50054, metrics_port=9104))
    """Where the reward service listens."""
    timeout_s: float = 15.0
    """Per-item verifier deadline; past it the item gets SCORE_STATUS_TIMEOUT. Keep it above
    sandbox.wall_timeout_s, or a slow code test times out while its program still runs."""
    plugins: tuple[RewardPluginConfig, ...] = ()
    """User verifiers registered next to the built-in reward functions."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits for running code-correctness tests."""

    def validate(self, path: str) -> None:
        self.server.validate(f"{path}.server")
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")
        self.sandbox.validate(f"{path}.sandbox")
        _check(f"{path}.timeout_s", self.timeout_s > self.sandbox.wall_timeout_s,
               f"must exceed sandbox.wall_timeout_s ({self.sandbox.wall_timeout_s}) so code tests finish in time")
        for i, plugin in enumerate(self.plugins):
            plugin.validate(f"{path}.plugins[{i}]")


@_frozen
class SamplingConfig:
    """How the policy samples. The trainer computes its logprobs under the same temperature and
    filters (arlo.model.logprobs.sampled_token_logprobs), so its importance ratios compare the
    policy it trains with the one that sampled."""

    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables. Without top_k it costs the trainer a full vocabulary
    sort per token (top_k caps that to a top-k)."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    max_tokens: int = 8
    """New tokens per model turn."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; 0 disables."""
    stop: tuple[str, ...] = ()
    """Strings that end a model turn (kept in the output), e.g. "</tool_call>"; at most 16, each at
    most 64 bytes. A turn ended so is closed with the tokenizer's end-of-turn token as context."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a turn, besides the tokenizer's own stop ids (every eos id of the model)."""
    seed: int | None = None
    """Set: each turn's sampling seed is derived from it, the task, the episode's place in its group
    and the turn, so a run with the same config and tasks samples the same tokens. null: fresh seeds."""


@_frozen
class EvalConfig:
    """Held-out evaluation, run by the rollout workers on request and never trained on: each of
    `num_tasks` tasks once greedily and `samples` times at the training temperature."""

    env_config_json: str = ""
    """JSON object merged over each mixture entry's config_json for evaluation, e.g. {"split": "eval"}
    for environments with a held-out split; an entry's own eval_config_json replaces it for that
    entry. Evaluation seeds are 0..num_tasks-1 either way."""
    num_tasks: int = 64
    """Held-out tasks per evaluation and environment (seeds 0..num_tasks-1 of each mixture entry)."""
    samples: int = 4
    """k of pass@k, and the samples behind the mean sampled reward."""
    every_versions: int = 0
    """`arlo train`/`demo` request an evaluation whenever the version passes a multiple of this
    (and always at the start and the end); 0: start and end only."""
    timeout_s: float = 600.0
    """Deadline of one evaluation, all the mixture's entries together (num_tasks x (1 + samples)
    episodes each): past it the request reports an error and no figures, so raise it with the
    number of entries."""

    def validate(self, path: str) -> None:
        try:
            parse_json_object(self.env_config_json.strip(), f"{path}.env_config_json")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check(f"{path}.num_tasks", 1 <= self.num_tasks <= 100_000, "must be in [1, 100000]")
        _check(f"{path}.samples", 1 <= self.samples <= 64, "must be in [1, 64]")
        _check(f"{path}.every_versions", self.every_versions >= 0, "must be >= 0")
        _check(f"{path}.timeout_s", self.timeout_s > 0, "must be > 0")


TASK_SEEDS = ("auto", "random", "cursor")
_LABEL = re.compile(r"[-\w.]*")


def _check_label(path: str, label: str) -> None:
    """A label names TensorBoard tags (`eval/<label>/...`: TensorBoard turns anything else into
    '_', so "a b" and "a_b" would be one series, and a '/' nests), metric keys and a Redis key."""
    _check(path, bool(_LABEL.fullmatch(label)), f"must be letters, digits, '_', '-' or '.', got {label!r}")


@_frozen
class RolloutEnvConfig:
    """One environment of the run's mixture (`rollout.envs`)."""

    name: str
    """Environment name at the gateway (a built-in such as "dataset", a plugin or a remote one)."""
    config_json: str = ""
    """JSON object passed to Reset, e.g. the dataset's path and field mapping."""
    reward_fn: str = "exact_match"
    """Reward function the reward service scores this environment's answers with."""
    weight: float = 1.0
    """Share of groups drawn from this entry: weight / sum of weights."""
    label: str = ""
    """Name of this entry in trajectories (Trajectory.env_name), metrics and its task cursor; empty
    means `name`. Set it when two entries use the same environment (two datasets). Letters,
    digits, '_', '-' and '.' only: it names TensorBoard tags."""
    seeds: str = "auto"
    """How group seeds are chosen: "cursor" takes the next one from a durable Redis counter
    (every task once per epoch, across restarts), "random" draws one; "auto" is "cursor" for the
    dataset environment and "random" for the others."""
    eval_config_json: str = ""
    """JSON object merged over config_json for this entry's held-out evaluation, instead of
    rollout.eval.env_config_json (empty: that one applies; "{}": evaluate on config_json as is)."""

    @property
    def key(self) -> str:
        return self.label or self.name

    def validate(self, path: str) -> None:
        _check(f"{path}.name", bool(self.name), "must be set")
        _check(f"{path}.weight", 0 < self.weight < float("inf"), "must be > 0")
        _check(f"{path}.seeds", self.seeds in TASK_SEEDS, f"must be one of {', '.join(TASK_SEEDS)}")
        _check_label(f"{path}.label", self.label)
        for name in ("config_json", "eval_config_json"):
            try:
                parse_json_object(getattr(self, name).strip(), f"{path}.{name}")
            except ValueError as e:
                raise ConfigError(str(e)) from None


DATASET_FORMATS = ("auto", "jsonl", "parquet", "hf")
DATASET_SPLITS = ("all", "train", "eval")
DATASET_ANSWER_FORMATS = ("text", "last_integer", "normalized")
DATASET_MAX_TURNS = 32


@_frozen
class DatasetConfig:
    """The `dataset` environment's config (its Reset config_json; the fields of `rollout.tasks`):
    a task file and the mapping of its columns. Declared here once, for the environment
    (services/env_gateway/envs/dataset.py) and the rollout's short form alike."""

    path: str = ""
    """The dataset: a .jsonl/.parquet file or a save_to_disk directory, on the gateway's disk
    (under env_gateway.dataset_roots)."""
    format: str = "auto"
    """"jsonl", "parquet", "hf" (save_to_disk), or "auto" from the path."""
    hf_split: str = ""
    """Which split of a saved DatasetDict (empty: its only one)."""
    prompt_field: str = "prompt"
    """Column holding the prompt text (the user message)."""
    messages_field: str = ""
    """Column holding a list of {role, content} messages; when set it is used instead of prompt_field."""
    answer_field: str = "answer"
    """Column holding the reference answer (non-strings are written as JSON)."""
    id_field: str = ""
    """Column with a stable task id (empty: the row number). The held-out split is drawn by id."""
    metadata_fields: str = ""
    """Comma-separated columns returned as the task's metadata (Reset's metadata_json), e.g. "tests"."""
    system_prompt: str = ""
    """A system message put before the prompt (not with messages_field)."""
    split: str = "all"
    """"train" or "eval": the part of a fixed partition by task id; "all" for separate files."""
    eval_fraction: float = 0.0
    """Share of the tasks held out as "eval" (with split "train"/"eval")."""
    split_seed: int = 0
    """Seeds the partition: change it and another set of tasks is held out."""
    shuffle_seed: int = 0
    """Seeds every epoch's order (epoch e is shuffled by (shuffle_seed, e))."""
    answer_format: str = "text"
    """How the final reply becomes the answer: "text" (stripped), "last_integer", or "normalized"
    (lower case, no punctuation or articles; the reference is normalised the same way)."""
    tool: bool = False
    """The agent has a calculator tool; the episode ends at its first reply without a tool call."""
    max_turns: int = 1
    """Turns before the episode ends unanswered (only matters with tool)."""

    def validate(self, path: str = "") -> None:
        """ValueError naming the key (the environment prefixes "dataset config: "); with `path`, a
        ConfigError prefixed with it."""
        try:
            self._validate()
        except ValueError as e:
            if path:
                raise ConfigError(f"{path}: {e}") from None
            raise

    def _validate(self) -> None:
        if not self.path:
            raise ValueError("path is required: a .jsonl or .parquet file or a save_to_disk directory")
        for name, allowed in (("format", DATASET_FORMATS), ("split", DATASET_SPLITS),
                              ("answer_format", DATASET_ANSWER_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not (self.prompt_field or self.messages_field):
            raise ValueError("set prompt_field or messages_field")
        if not self.answer_field:
            raise ValueError("answer_field is required")
        if not 0.0 <= self.eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0.0, 1.0], got {self.eval_fraction}")
        if self.split != "all" and not 0 < self.eval_fraction < 1:
            raise ValueError(f"split {self.split!r} needs eval_fraction in (0, 1); for separate train and "
                             "eval files use split 'all' and a different path for evaluation")
        if not 1 <= self.max_turns <= DATASET_MAX_TURNS:
            raise ValueError(f"max_turns must be in [1, {DATASET_MAX_TURNS}], got {self.max_turns}")

    @property
    def metadata_columns(self) -> tuple[str, ...]:
        return tuple(f.strip() for f in self.metadata_fields.split(",") if f.strip())


@_frozen
class TasksConfig(DatasetConfig):
    """`rollout.tasks`: the short form of a run on one dataset. Set `path` (and the field mapping,
    the dataset environment's keys) and the run's mixture is the one `dataset` entry it describes;
    leave `path` empty (the default) and it is off. For several environments use `rollout.envs`."""

    reward_fn: str = "exact_match"
    """Reward function the reward service scores the answers with (a built-in or a plugin)."""
    label: str = ""
    """Name of the tasks in trajectories, metrics and the task cursor; empty means "dataset".
    Letters, digits, '_', '-' and '.' only."""
    eval_path: str = ""
    """A separate held-out file (with split "all"). Empty: with split "train", evaluation takes the
    "eval" part of the same partition; with split "all", rollout.eval.env_config_json applies."""

    def validate(self, path: str = "rollout.tasks") -> None:
        if not self.path:  # off: any other key set means a forgotten path, and a run on arith
            given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
            _check(f"{path}.path", not given, f"must be set when {', '.join(given)} "
                   f"{'is' if len(given) == 1 else 'are'} (without a path rollout.tasks is off)")
            return
        super(TasksConfig, self).validate(path)  # noqa: UP008 (a slotted dataclass has no __class__ cell)
        _check(f"{path}.split", self.split != "eval", "'eval' would train on the held-out tasks (and evaluate "
               "on them too): use 'train', and evaluation takes the 'eval' part")
        _check_label(f"{path}.label", self.label)
        _check(f"{path}.eval_path", not self.eval_path or self.split == "all",
               f"is a separate held-out file: use it with split 'all', not {self.split!r}")

    def entry(self, eval_env_config_json: str = "") -> RolloutEnvConfig:
        """The `rollout.envs` entry this is short for; `eval_env_config_json` (rollout.eval's) is
        merged under the held-out override this derives from split/eval_path."""
        dataset = {f.name: getattr(self, f.name) for f in dataclasses.fields(DatasetConfig)
                   if getattr(self, f.name) != f.default}
        held_out = {"path": self.eval_path} if self.eval_path else {"split": "eval"} if self.split == "train" else {}
        eval_json = ""
        if held_out:
            eval_json = json.dumps({**parse_json_object(eval_env_config_json.strip(), "rollout.eval.env_config_json"),
                                    **held_out})
        return RolloutEnvConfig(name="dataset", label=self.label, config_json=json.dumps(dataset),
                                reward_fn=self.reward_fn, eval_config_json=eval_json)


@_frozen
class RolloutConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50055, metrics_port=9105))
    """Where the rollout service listens."""
    env_name: str = "arith"
    """Environment the training episodes run in (served by the env gateway)."""
    env_config_json: str = ""
    """JSON object passed to the environment at each reset; empty = {}."""
    reward_fn: str = "exact_match"
    """Reward function (reward service) that scores each episode's final answer."""
    group_size: int = 4
    """Samples per task (a GRPO group): their rewards are compared with each other."""
    max_turns: int = 3
    """Model turns per episode at most."""
    max_episode_tokens: int = 256
    """Generated tokens per episode at most, over all its turns."""
    episode_timeout_s: float = 120.0
    """Wall-time limit of an episode: no turn starts after it (finish_reason "max_wall_time")."""
    concurrent_groups: int = 4
    """Groups in flight per worker."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How the policy samples during training episodes."""
    rpc_timeout_s: float = 30.0
    """Deadline of each call to inference, the env gateway and the reward service."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (greedy and pass@k), reported apart from the training reward."""
    envs: tuple[RolloutEnvConfig, ...] = ()
    """A mixture of environments, each group drawn from one by weight; empty means the one entry
    {name: env_name, config_json: env_config_json, reward_fn: reward_fn}. Evaluation runs every entry."""
    task_lease_s: float = 900.0
    """A cursor-drawn task not finished this long after it was handed out (its worker died) is
    handed out again: at-least-once. Keep it above the longest a group can take."""
    agent: str = ""
    """A black-box agent, "module:function" naming `async def run(task, client) -> str | float`: it
    drives the policy through the OpenAI endpoint instead of the built-in turn loop (docs/openai.md)."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """Tasks from a dataset file, the short form of a one-entry `envs` (docs/datasets.md): its
    path, field mapping and reward_fn. Set, it replaces env_name/env_config_json/reward_fn."""
    admission_poll_s: float = 2.0
    """The staleness gate wakes on Redis pub/sub events (a new version, a version served, a stale
    drop, a finished group); it also re-checks this often in case an event was lost."""

    @property
    def mixture(self) -> tuple[RolloutEnvConfig, ...]:
        """`envs`, or the dataset entry `tasks` is short for, or the single entry the
        env_name/env_config_json/reward_fn fields describe."""
        if self.envs:
            return self.envs
        if self.tasks.path:
            return (self.tasks.entry(self.eval.env_config_json),)
        return (RolloutEnvConfig(name=self.env_name, config_json=self.env_config_json, reward_fn=self.reward_fn),)

    def validate(self, path: str) -> None:
        self.server.validate(f"{path}.server")
        self.eval.validate(f"{path}.eval")
        keys: set[str] = set()
        for i, entry in enumerate(self.envs):
            entry.validate(f"{path}.envs[{i}]")
            _check(f"{path}.envs[{i}].label", entry.key not in keys,
                   f"two entries are both called {entry.key!r}: give one a label")
            keys.add(entry.key)
        self.tasks.validate(f"{path}.tasks")
        if self.tasks.path:
            _check(f"{path}.tasks", not self.envs, "set rollout.tasks (one dataset) or rollout.envs (a mixture), "
                   "not both; a dataset in a mixture is an envs entry with name: dataset")
            defaults = RolloutConfig()
            for name in ("env_name", "env_config_json", "reward_fn"):
                _check(f"{path}.{name}", getattr(self, name) == getattr(defaults, name),
                       f"conflicts with rollout.tasks, which sets the environment"
                       f"{' (give reward_fn under rollout.tasks)' if name == 'reward_fn' else ''}: remove it")
        _check(f"{path}.task_lease_s", self.task_lease_s > 0, "must be > 0")
        _check(f"{path}.agent", not self.agent or self.agent.count(":") == 1 and all(self.agent.split(":")),
               'must be "module:function" (or empty for the built-in loop)')
        _check(f"{path}.admission_poll_s", self.admission_poll_s > 0, "must be > 0")
        _check(f"{path}.group_size", 1 <= self.group_size <= 1024, "must be in [1, 1024]")
        _check(f"{path}.max_turns", self.max_turns >= 1, "must be >= 1")
        _check(f"{path}.concurrent_groups", self.concurrent_groups >= 1, "must be >= 1")
        _check(f"{path}.sampling.temperature", 0 <= self.sampling.temperature <= 10, "must be in [0, 10]")
        _check(f"{path}.sampling.max_tokens", self.sampling.max_tokens >= 1, "must be >= 1")
        _check(f"{path}.sampling.top_p", 0 < self.sampling.top_p <= 1, "must be in (0, 1]")
        _check(f"{path}.sampling.top_k", self.sampling.top_k >= 0, "must be >= 0")
        _check(f"{path}.sampling.min_p", 0 <= self.sampling.min_p < 1, "must be in [0, 1)")
        _check(f"{path}.sampling.stop", len(self.sampling.stop) <= 16 and all(
            0 < len(s.encode()) <= 64 for s in self.sampling.stop), "at most 16 non-empty strings of <= 64 bytes")
        _check(f"{path}.sampling.stop_token_ids", len(self.sampling.stop_token_ids) <= 32 and all(
            i >= 0 for i in self.sampling.stop_token_ids), "at most 32 ids, each >= 0")
        _check(f"{path}.sampling.seed", self.sampling.seed is None or 0 <= self.sampling.seed < 2**63,
               "must be null or in [0, 2**63)")


@_frozen
class RunConfig:
    run_id: str = "default"
    """Namespace of every Redis key (`arlo:{run_id}:...`)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy model, shared by trainer and inference."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """The Redis that holds the trajectory stream, weight pointer and heartbeats."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """Bearer-token auth of every RPC but health."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """The inference service: request limits, batching, KV cache."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer service: optimizer, RL objective, checkpoints."""
    env_gateway: EnvGatewayConfig = field(default_factory=EnvGatewayConfig)
    """The environment gateway: sessions, sandbox, remote environments."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward service: verifier deadline, plugins, sandbox."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers: the task, group sampling, episode limits."""

    def validate(self, path: str = "") -> None:
        check_run_id(self.run_id)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "validate"):
                value.validate(f.name)


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass `cls` from plain data, checking keys and types; errors name the field."""
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        # `type(value) is type(a)`: YAML's `true` must not pass as 1, nor 1 as 1.0.
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must be set (null is not allowed)")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(options[0], value, path)
        for option in options:  # the first alternative that takes the value
            try:
                return _coerce(option, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {' or '.join(type_name(o) for o in options)}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(key_type, k, f"{path} key"): _coerce(value_type, v, f"{path}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def type_name(tp: Any) -> str:
    """A field type as the docs and errors show it: `int`, `list of str`, `one of "a", "b"`, `float or null`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        return f"map of {type_name(key_type)} to {type_name(value_type)}"
    return getattr(tp, "__name__", str(tp))


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain data (lists, not tuples) that YAML can write and `from_dict` reads back."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Loads a YAML run config (the built-in one when `path` is None) and validates it."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
    if overrides:
        data = _merge(data, overrides)
    cfg = from_dict(RunConfig, data)
    cfg.validate()
    return cfg


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Written 0600 (atomically): redis.url may carry a password."""
    write_private(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def replace_config(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """A copy of `cfg` with nested `overrides` applied, validated like a loaded config."""
    new = from_dict(RunConfig, _merge(to_dict(cfg), overrides))
    new.validate()
    return new
