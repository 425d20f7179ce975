"""`trainer`: the optimizer, the RL objective (`algorithm`) and the SFT warm start."""

from __future__ import annotations

from dataclasses import field
from typing import get_args

from arlo.choices import (
    Advantage,
    Aggregation,
    KlKind,
    LoraInit,
    LoraQuantize,
    LoraTarget,
    RatioLevel,
    Reference,
    Remat,
    SftTooLong,
)
from arlo.config.base import (
    MAX_WAIT_S,
    MIN_POLL_S,
    MeshConfig,
    ServerConfig,
    _check,
    _frozen,
    check_ranges,
    ranged,
)


@_frozen
class AlgorithmConfig:
    """The RL objective. Defaults are GRPO; the other fields switch on its known variants."""

    advantage: Advantage = "grpo"
    """"grpo", "dr_grpo" (no std scaling), "rloo", "reinforce_pp" (batch whitening), or "gae":
    PPO with a learned critic (a value head on a copy of the policy backbone, its own AdamW),
    per-token advantages by GAE over the model tokens (docs/algorithms.md)."""
    clip_eps: float = ranged(0.2, gt=0, lt=1)
    """PPO clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]; in (0, 1)."""
    clip_eps_high: float = ranged(0.0, ge=0, lt=10)
    """Upper clip (DAPO clip-higher); 0 means the same as clip_eps."""
    dual_clip: float = ranged(0.0, gt=1, special={0: "off"})
    """Dual-clip constant c > 1; 0 disables."""
    ratio_level: RatioLevel = "token"
    """"token" (PPO/GRPO) or "sequence" (GSPO)."""
    aggregation: Aggregation = "token_mean"
    """"token_mean", "seq_mean_token_mean" or "seq_sum_norm" (needs norm_constant)."""
    norm_constant: float = ranged(0.0, ge=0)
    """Divisor of "seq_sum_norm" per sequence (Dr. GRPO: a fixed token budget, so length does not bias the
    loss); must be > 0 with that aggregation, unused (0 is fine) with the others."""
    decoupled: bool = False
    """Clip the ratio against the trainer's own logprobs at the batch's start (the proximal
    policy) instead of the sampler's; the sampler's logprobs then only enter through is_cap.
    Implied by is_cap > 0."""
    is_cap: float = ranged(0.0, ge=0)
    """Truncated importance sampling (TIS, as verl and TRL ship it): the ratio is against the
    proximal policy and each token's loss is weighted by min(pi_proximal / pi_sampler, is_cap),
    correcting for a stale or numerically different sampler; 0 disables."""
    kl_coef: float = ranged(0.0, ge=0)
    """KL to the reference policy; 0 disables (and holds no reference copy)."""
    reference: Reference = "initial"
    """The KL reference: "initial" (the loaded checkpoint or the preset's init) or "after_sft"
    (the policy once the SFT warm start is done; "initial" when there is none)."""
    kl_kind: KlKind = "k3"
    """KL estimator (Schulman's k1, k2 or k3) of the KL term."""
    kl_in_reward: bool = False
    """Subtract kl_coef x the sequence's summed KL from its reward instead of adding a loss term."""
    entropy_coef: float = ranged(0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss); 0 disables."""
    filter_zero_variance: bool = False
    """Dynamic sampling: drop groups whose rewards are all equal (their advantage is 0)."""
    overlong_max_tokens: int = ranged(0, ge=0)
    """Generated tokens past which the overlong penalty is -1 (DAPO); 0 disables."""
    overlong_buffer_tokens: int = ranged(0, ge=0)
    """Soft overlong penalty on generated tokens, at most overlong_max_tokens; both 0 disables."""
    gae_gamma: float = ranged(1.0, ge=0, le=1)
    """advantage "gae": the discount per model token (1: undiscounted, as for a final reward)."""
    gae_lambda: float = ranged(0.95, ge=0, le=1)
    """advantage "gae": GAE's lambda (1: Monte-Carlo returns minus the value, 0: one-step TD)."""
    value_clip: float = ranged(0.2, ge=0)
    """advantage "gae": PPO's clipped value loss, the new value kept within +-value_clip of the
    batch-start value (the loss is the larger of the clipped and unclipped errors); 0 disables."""
    critic_learning_rate: float = ranged(0.0, ge=0, lt=1)
    """advantage "gae": peak AdamW learning rate of the critic (the trainer's warmup, decay, weight
    decay and grad-norm clip); 0: trainer.learning_rate."""
    whiten_advantages: bool = True
    """advantage "gae": whiten the per-token advantages over the batch's model tokens (the returns
    the critic learns are not whitened)."""
    reward_weight: float = ranged(1.0, ge=0)
    """Weight of the reward service's score (`Trajectory.reward`, with any overlong penalty) in the
    reward every estimator optimises: reward_weight x score + env_reward_weight x the episode's
    environment turn rewards, the same sum under GRPO and GAE (docs/algorithms.md#the-reward)."""
    env_reward_weight: float = ranged(0.0, ge=0)
    """Weight of the environment's own per-turn rewards (`StepResponse.reward`): summed per episode
    for group advantages, at each turn's last model token for GAE. 0 (the default): the reward
    service's score alone. The built-in environments report their 0/1 correctness there too, so
    weighting both counts it twice."""
    routing_replay: bool = False
    """Routing replay ("R3", a model with routed experts: Qwen3-MoE). The rollout asks inference
    for the experts every routed layer chose at each generated token's predicting position (the
    last prompt token for a turn's first token, the previous generated token for the others),
    carries them in the trajectory (`Trajectory.routed_experts`; a black-box agent's calls to the
    OpenAI endpoint are recorded with them too, and GenerateStream streams them), and the trainer's policy forward
    (its logprobs, and the proximal policy's) uses them at exactly those positions; its own router
    everywhere else (prompt, observations). The KL reference and the critic route themselves.
    Reported per step whenever routing was recorded, replay on or off: `routing_mismatch`, the
    fraction of recorded tokens where any routed layer's experts in the trainer's forward differ (as
    a set) from the sampler's (0 with replay), and `routing_own_mismatch`, the same for the routers'
    own top-k (what replay overrides). The record travels compactly (1 byte per expert id up to 256
    experts, 2 above; arlo/routing_replay.py). Not with trainer.pack."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.norm_constant", self.aggregation != "seq_sum_norm" or self.norm_constant > 0,
               "must be > 0 with aggregation seq_sum_norm")
        _check(f"{path}.overlong_buffer_tokens",
               self.overlong_buffer_tokens <= self.overlong_max_tokens or self.overlong_max_tokens == 0,
               "must be in [0, overlong_max_tokens]")
        _check(f"{path}.reward_weight", self.reward_weight > 0 or self.env_reward_weight > 0,
               "must be > 0 when env_reward_weight is 0 (else there is no reward to optimise)")
        # The penalty is added to the reward service's score where the batch is built.
        _check(f"{path}.overlong_max_tokens", not self.overlong_max_tokens or self.reward_weight > 0,
               "needs reward_weight > 0 (the overlong penalty is part of the reward service's term)")
        # The rollout's admission and the trainer's intake judge a group by Trajectory.reward alone.
        _check(f"{path}.filter_zero_variance", not self.filter_zero_variance or not self.env_reward_weight,
               "judges groups by the reward service's score alone; not with env_reward_weight > 0")


@_frozen
class SFTConfig:
    """A supervised warm start before RL: the same learner, cross-entropy on the demonstrations'
    assistant tokens. It runs first when the trainer is resumed, then RL takes over."""

    data: str = ""
    """Demonstrations: a JSONL path (one {"messages": [{role, content, ...}, ...], "tools": [...]}
    per line; messages may carry tool_calls and tool results with their name, `tools` is optional)
    or a built-in set ("builtin:arith", "builtin:arith_tool"). Rendered with the model's chat template."""
    steps: int = ranged(0, ge=0)
    """SFT optimizer steps before RL; 0 disables the warm start."""
    batch_size: int = ranged(64, ge=1)
    """Demonstrations per SFT step."""
    learning_rate: float = ranged(0.0, ge=0, lt=1)
    """0: trainer.learning_rate. SFT has its own AdamW state; RL starts with a fresh one."""
    warmup_steps: int = ranged(20, ge=0)
    """Linear warmup of the SFT learning rate, in steps."""
    too_long: SftTooLong = "drop"
    """A demonstration longer than model.max_seq_len: "drop" (left out), "truncate_left" (its last
    max_seq_len tokens kept: the later assistant turns, without the start of the conversation), or
    "error" (the trainer refuses to start). Either way the trainer logs how many; one with no
    assistant token left is dropped, and fewer demonstrations left than batch_size is an error."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        _check(f"{path}.data", not self.steps or bool(self.data), "must name the demonstrations when steps > 0")


LORA_TARGETS: tuple[LoraTarget, ...] = get_args(LoraTarget)
FULL_FINETUNE_LR = 1e-3
"""trainer.learning_rate's default, tuned for full fine-tuning; LoRA wants about 10x a full
fine-tuning rate ("LoRA Without Regret"), so a LoRA run left at it is warned about."""


@_frozen
class LoraConfig:
    """LoRA: train low-rank adapters on the frozen base (arlo/model/lora.py). The base keeps no
    optimizer state and is held in model.param_dtype; the adapters and their AdamW moments are
    float32. Publishes carry only the adapters, and inference applies them unmerged."""

    rank: int = ranged(0, ge=0, le=4096, special={0: "off (full fine-tuning)"})
    """Rank of every adapter; 0 trains the whole model."""
    alpha: float = ranged(0.0, ge=0, special={0: "2 x rank"})
    """Scale numerator: updates are scaled by alpha / rank (alpha / sqrt(rank) with rslora)."""
    targets: tuple[LoraTarget, ...] = LORA_TARGETS
    """Projections that get an adapter, by Hugging Face module name: q_proj, k_proj, v_proj,
    o_proj (attention), gate_proj, up_proj, down_proj (MLP). Default: all of them."""
    dropout: float = ranged(0.0, ge=0, lt=1)
    """Must stay 0 in RL: dropout in the trainer's forward alone makes its logprobs differ from
    the sampler's, which the importance ratio would read as policy change."""
    init: LoraInit = "default"
    """A's initialisation (B starts at zero, so a fresh adapter changes nothing): "default"
    (PEFT's kaiming-uniform) or "gaussian" (normal, std 1/rank). "pissa" / "olora" are refused:
    they move part of the base into the adapters, so an adapter-only publish would serve a base
    inference does not have."""
    rslora: bool = False
    """Scale by alpha / sqrt(rank) (rank-stabilised LoRA) instead of alpha / rank."""
    quantize: LoraQuantize = "none"
    """QLoRA: store the frozen base's projection weights quantised, "int8" (1 byte per weight) or
    "nf4" (4-bit NormalFloat, half a byte), dequantised layer by layer in the forward, in the
    trainer and in inference alike (so both compute the same function); embeddings and norms stay
    in model.param_dtype. Pair it with trainer.remat, or the backward may keep dequantised copies."""
    quant_block: int = ranged(64, ge=2, le=65536)
    """Elements per quantisation block (one float32 scale each) along a weight's last axis; a
    last axis it does not divide is one block per row."""
    train_norms: bool = False
    """Also train every RMSNorm scale (each layer's norms and the final norm) in full, as PEFT's
    `modules_to_save` does: model.dim floats per norm, optimised, published, checkpointed and
    served with the adapters. Helps where the frozen base's norms cap how sharp the policy can
    get (a randomly initialised base: the LoRA demo's held-out reward went from about 0.1 to 0.7
    with it, docs/quickstart.md section 5). The merged export writes the trained norms; a PEFT adapter
    export (`arlo export --adapter`) is refused, and an engine serving several adapters at once
    cannot hold per-run norms."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        if not self.rank:
            return
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        _check(f"{path}.targets", bool(self.targets) and not unknown,
               f"{unknown or 'none given'}: name projections among {list(LORA_TARGETS)}")
        _check(f"{path}.targets", len(set(self.targets)) == len(self.targets), "lists a projection twice")
        _check(f"{path}.dropout", self.dropout == 0, "must be 0: dropout in the trainer alone makes its "
               "logprobs differ from the sampler's (the RL ratio would read it as policy change)")
        _check(f"{path}.init", self.init in ("default", "gaussian"),
               f"{self.init!r} moves part of the base weights into the adapters, so an adapter-only "
               "publish would be applied to a base inference does not have; use default or gaussian")

    @property
    def effective_alpha(self) -> float:
        return self.alpha or 2.0 * self.rank


def lora_rate_warning(tc: TrainerConfig) -> str | None:
    """What to tell a user whose LoRA run kept the full fine-tuning learning rate (None: nothing)."""
    if not tc.lora.rank or tc.learning_rate != FULL_FINETUNE_LR:
        return None
    return (f"trainer.lora.rank is {tc.lora.rank} but trainer.learning_rate is still the full fine-tuning default "
            f"({FULL_FINETUNE_LR:g}); LoRA usually needs about 10x the rate full fine-tuning of the same model "
            "uses (\"LoRA Without Regret\"): set trainer.learning_rate explicitly")


@_frozen
class WeightPublishConfig:
    """How each version reaches the inference replicas (docs/deploy.md, "Sync topology")."""

    full_every: int = ranged(1, ge=1, le=10_000)
    """Publish a full version every k versions and the ones between as deltas: the serving-dtype
    elements changed since the version before (arlo/model/weight_delta.py; a few percent of a full
    copy at a learning rate of 1e-6). 1: every version full. A delta is sent full anyway when it
    is not smaller than max_delta_ratio of a full copy, and after a re-numbered version."""
    max_delta_ratio: float = ranged(0.5, gt=0, le=1)
    """A delta at least this fraction of a full copy is published full instead (a high learning
    rate changes most elements, and an index per element costs more than the copy)."""
    storage: str = ""
    """`file:///dir`: the trainer writes each version there once (a full or a delta, atomically) and
    the replicas read it, so the trainer's egress is one copy per version whatever the number of
    replicas; every inference replica must see the same directory at the same path (a shared
    volume, or a GCS/S3 bucket mounted by its CSI driver on Kubernetes). Empty: each replica pulls
    from the trainer over PullWeights."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        if self.storage:
            _check(f"{path}.storage", self.storage.startswith("file:///"),
                   f"must be empty or a file:/// URI of an absolute directory, got {self.storage!r}")


@_frozen
class TrainerConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50052, metrics_port=9102))
    """Where the trainer service listens (and serves weights from)."""
    groups_per_step: int = ranged(4, ge=1)
    """GRPO groups in one optimizer step."""
    micro_batch_size: int = ranged(0, ge=0)
    """Rows per micro-batch (gradient accumulation); 0 = the whole batch at once."""
    learning_rate: float = ranged(FULL_FINETUNE_LR, gt=0, lt=1)
    """Peak AdamW learning rate of RL."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = ranged(0, ge=0)
    """Linear learning-rate warmup from 0, in optimizer steps (ppo_epochs x mini_batches per batch)."""
    total_steps: int = ranged(0, ge=0)
    """> 0: cosine decay over this many optimizer steps."""
    ppo_epochs: int = ranged(1, ge=1, le=64)
    """Passes over each batch. With several updates per batch the proximal policy is the
    trainer's own logprobs at the batch's start, computed once (one forward pass, no gradient)."""
    mini_batches: int = ranged(1, ge=1, le=1024)
    """Optimizer steps per epoch: each epoch shuffles the batch's rows into this many
    mini-batches (never more than its rows). One published version per batch either way."""
    max_grad_norm: float = ranged(1.0, gt=0)
    """Gradients are clipped to this global norm."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL objective (GRPO and its variants)."""
    max_staleness: int = ranged(1, ge=0)
    """No trained token is more than this many versions behind the version its step trains from
    (groups are dropped as stale at intake and again just before their step); 0 = on-policy."""
    expiring_wait_s: float = ranged(10.0, ge=0, le=3600)
    """How long a step may wait for a group still being generated that it would otherwise leave
    to age past max_staleness (younger groups filled the batch first; services/trainer/core/expiring.py).
    Bounded because a rollout worker may have died with the group; 0: never wait (it is dropped)."""
    checkpoint_dir: str = ""
    """Orbax checkpoint directory, local or mounted (every trainer host must see the same one);
    empty disables checkpoints. Not a URI: `gs://` and the like are refused. A save that lands
    after another trainer took the run is moved to `set-aside/` under it (the newest 3 kept), never restored."""
    checkpoint_every: int = ranged(0, ge=0)
    """Write a checkpoint every k versions; 0 disables."""
    lease_ttl_s: float = ranged(10.0, ge=1.0, le=600.0)
    """The run's one-trainer lease (arlo/coord/lease.py) expires this long after its last renewal
    (renewed every third of it). A second trainer of the run is refused within about a third of
    it; a trainer restarted on another host (a rescheduled pod) waits at most this long for a dead
    one's lease (on the same host a dead holder is taken over at once)."""
    read_block_ms: int = ranged(1000, ge=round(MIN_POLL_S * 1000), le=round(MAX_WAIT_S * 1000))
    """How long one read of the trajectory stream blocks waiting for data: at least 10 (a shorter
    wait only polls Redis in a loop) and below redis.socket_timeout_s by min(1 s, half of it)."""
    remat: Remat = "none"
    """Activation rematerialisation: "none", "full" (recompute each layer) or "dots" (keep matmul outputs)."""
    logprob_chunk: int = ranged(0, ge=0)
    """> 0: compute logprobs in pieces of this many tokens (never [batch, length, vocab] logits whole)."""
    pack: bool = False
    """Sequence packing: the RL step's forward passes run several trajectories per row (first-fit
    decreasing into rows of the batch's length bucket; attention never crosses a trajectory, each
    restarts at position 0), so a long-tail batch costs its tokens rather than rows x its longest.
    The loss is the padded batch's (services/trainer/packing.py). Needs mini_batches 1 (the rows a
    mini-batch gets are shuffled inside the step, after packing) and a group advantage (not "gae":
    the critic's forward is not packed). Each packed row count compiles its own step."""
    router_aux_loss_coef: float = ranged(0.0, ge=0, special={0: "off"})
    """Weight of the routers' load-balancing loss (Switch Transformer's, as HF Qwen3-MoE computes it:
    arlo/model/moe.py) added to the RL and SFT objectives, over the tokens the loss trains on; needs a
    model with routed experts. HF trains Qwen3-MoE with 0.001."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh axes (data/fsdp/tensor; -1 = the rest); see arlo.distributed."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Optional supervised warm start on demonstrations before RL."""
    weights: WeightPublishConfig = field(default_factory=WeightPublishConfig)
    """How versions reach the inference replicas: deltas, shared storage."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (rank > 0)."""
    start_paused: bool = False
    """Take no step until a Resume RPC: `arlo up`/`demo` set it, so that `arlo train` drives the run
    (evaluation first, then the warm start, then RL). False: train as soon as data arrives."""
    warmup_programs: int = ranged(3, ge=0)
    """At start, compile the RL step for every batch length bucket up to the longest episode
    (`rollout.max_episode_tokens`, within the model's context) when there are at most this many
    buckets, so no step compiles mid-run; more buckets compile on first use (each logged). The SFT
    warm start's step likewise, for the lengths its demonstrations' batches can take. 0: never."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
        self.server.validate(f"{path}.server")
        self.sft.validate(f"{path}.sft")
        self.weights.validate(f"{path}.weights")
        self.lora.validate(f"{path}.lora")
        # The critic is a full copy of the policy's backbone (critic.py): no frozen base to share.
        _check(f"{path}.lora.rank", not self.lora.rank or self.algorithm.advantage != "gae",
               "LoRA with algorithm.advantage gae is not supported (the critic copies the whole backbone)")
        self.mesh.validate(f"{path}.mesh")
        self.algorithm.validate(f"{path}.algorithm")
        _check(f"{path}.pack", not self.pack or self.algorithm.advantage != "gae",
               "sequence packing does not pack the critic's forward: use a group advantage, or pack: false")
        _check(f"{path}.pack", not self.pack or not self.algorithm.routing_replay,
               "is not supported with trainer.algorithm.routing_replay (the replayed experts are not packed); "
               "turn one of them off")
        _check(f"{path}.pack", not self.pack or self.mini_batches == 1,
               "needs mini_batches: 1 (mini-batches are dealt from shuffled rows inside the step, after packing)")
        _check(f"{path}.checkpoint_every", not self.checkpoint_every or bool(self.checkpoint_dir),
               "needs checkpoint_dir")
        # A URI would resolve to a relative local path ("./gs:/bucket"): checkpoints on the pod's
        # own disk, gone with it, while the run believes them durable.
        _check(f"{path}.checkpoint_dir", "://" not in self.checkpoint_dir,
               f"must be a directory, local or mounted, got the URI {self.checkpoint_dir!r} "
               "(object stores are not read directly; use a shared volume, e.g. Filestore)")
