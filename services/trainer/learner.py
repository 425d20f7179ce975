"""The learner: functional, jitted RL and SFT steps over an NNX model's state.

The model is split once (`nnx.split`); each step is `jax.jit` over (state, opt_state, batch)
with state and optimizer state donated, because `nnx.jit` would walk the module graph in
Python on every call. A batch is cut into micro-batches whose gradients are summed in a
`lax.scan`; every micro-batch loss is divided by the WHOLE batch's denominator, so the
gradient equals the full-batch gradient whatever the micro-batch size, a partial last
micro-batch included (it is padded with rows whose mask is 0).

The learner takes the run's `trainer` section (`TrainerConfig`) as it is: the optimizer,
micro-batching, memory options and `algorithm` are read from there, never copied; and the
run's `rollout.sampling`, the distribution the trainer's logprobs are taken under.

An RL step is `ppo_epochs` x `mini_batches` optimizer updates on one batch (one published
version): each epoch deals the batch's rows, shuffled, round-robin into mini-batches, each
mini-batch's loss normalised by its own denominator and its gradient summed over its
micro-batches. With more than one update the trainer's batch-start logprobs (the proximal
policy) are computed once first.

With `algorithm.advantage: gae` the learner also holds a critic (`critic.py`: a value head on
a copy of the backbone, its own AdamW): at the batch's start (no gradient) its values and
GAE give per-token advantages and returns; the policy's updates use those advantages, then
the critic takes the same epochs x mini-batches (the same shuffles) on the clipped value
loss, in a second jitted function, skipped on a non-finite loss or gradient like the policy.

With `trainer.pack` each micro-batch also carries its packed rows (`packing.packed_micro_batches`,
built on the host with the batch): the forward passes run on those, the losses on the batch's
own rows (objectives.forward_layout / to_batch_layout).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arlo.config import SamplingConfig, TrainerConfig
from arlo.model import abstract_model
from arlo.model.lora import merge_states, split_adapters
from arlo.model.quantize import quantize_base
from arlo.model.sharding import batch_sharding, fitted_state_shardings, state_shardings
from arlo.model.source import ModelSource, cast_state
from arlo.routing_replay import routing_shape
from services.trainer.batching import Batch, objective_rewards
from services.trainer.critic import make_critic, prepare_gae, value_objective
from services.trainer.losses import aggregate_denominator
from services.trainer.objectives import (
    advantages_b,
    old_logprobs,
    rl_objective,
    sequence_kl,
    sft_objective,
    with_reference_logprobs,
)
from services.trainer.optimizers import critic_optimizer, rl_optimizer, sft_optimizer
from services.trainer.packing import packed_micro_batches
from services.trainer.sft import SFTBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    loss: float
    reward_mean: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    num_tokens: int
    extra: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: bool = False
    """The loss or gradient norm was non-finite: weights and optimizer state are unchanged."""


class Learner:
    """Holds the policy and optimizer state; `step` applies one RL update, `sft_step` one SFT update."""

    def __init__(self, source: ModelSource, *, cfg: TrainerConfig, mesh: Mesh | None = None,
                 sampling: SamplingConfig | None = None) -> None:
        """`source`: the decoder and its initial weights (the checkpoint, or a preset's seed).
        The learner holds them as a float32 master copy (what AdamW updates and checkpoints
        keep); the forward pass and every publish see them in `source.param_dtype`.
        `sampling`: the run's `rollout.sampling`, so the trainer's logprobs are the sampler's
        (None: temperature 1, nothing filtered)."""
        if cfg.router_aux_loss_coef and source.cfg.moe is None:
            raise ValueError("trainer.router_aux_loss_coef: the model has no routed experts (a Qwen3-MoE "
                             "checkpoint in model.path has); set it to 0")
        if cfg.algorithm.routing_replay and routing_shape(source.cfg) is None:
            raise ValueError("trainer.algorithm.routing_replay: the model has no routed experts (a Qwen3-MoE "
                             "checkpoint in model.path has); set it to false")
        if cfg.algorithm.routing_replay and cfg.pack:
            raise ValueError("trainer.pack is not supported with trainer.algorithm.routing_replay; turn one off")
        if cfg.pack and (cfg.algorithm.advantage == "gae" or cfg.mini_batches > 1):
            raise ValueError("trainer.pack needs a group advantage (not gae) and mini_batches 1; see its docstring")
        self.model_cfg = source.cfg
        self.param_dtype = source.param_dtype
        self.cfg = cfg
        self.sampling = sampling = sampling or SamplingConfig()
        self.mesh = mesh
        self.graphdef = nnx.split(abstract_model(source.cfg))[0]
        # Parameters sharded by their logical axes (placed as they load), fitted as inference fits
        # them: a dimension the mesh does not divide (2 kv heads on tensor 4) stays replicated.
        # The optimizer state and the critic follow.
        shardings = None if mesh is None else fitted_shardings(source.abstract_state("float32"), mesh)
        # `state` is what the optimizer updates, checkpoints keep and publishes carry: the whole
        # model, or with LoRA only the adapters; `frozen` is the LoRA base, in param_dtype, never
        # updated, donated or published (None without LoRA).
        self.state, self.frozen = initial_params(source, shardings)
        # The KL reference is the initial policy (trainer.algorithm.reference "after_sft": the
        # policy once the warm start is done, see `set_reference`), held apart in the serving
        # dtype: never donated, never updated.
        self.ref_state = self._reference() if cfg.algorithm.kl_coef else None
        self._tx = rl_optimizer(cfg)
        self.opt_state = self._tx.init(self.state)
        self.step_count = 0
        rl = functools.partial(_rl_step, self.graphdef, self._tx, cfg, self.param_dtype, sampling)
        # SFT keeps its own optimizer (its own learning rate and warmup) and state, made on the
        # first SFT step, so a warm start leaves RL a fresh AdamW and RL-only runs pay nothing.
        self._sft_tx = sft_optimizer(cfg)
        self.sft_opt_state: Any = None
        sft = functools.partial(_sft_step, self.graphdef, self._sft_tx, cfg, self.param_dtype)
        self._rl_step = jax.jit(rl, donate_argnums=(0, 1), static_argnums=(6,))
        self._sft_step = jax.jit(sft, donate_argnums=(0, 1))
        # `frozen` goes to every step as a (never donated) keyword argument: bound into the
        # function instead, jit would bake the whole base into the program as a constant.
        self.step_kwargs = {} if self.frozen is None else {"frozen": self.frozen}
        self._init_critic()

    def _init_critic(self) -> None:
        """advantage "gae": the critic, from the policy state as it is now; else none (costs nothing)."""
        self.critic: dict[str, Any] | None = None
        self.critic_opt_state: Any = None
        if self.cfg.algorithm.advantage != "gae":
            return
        self._critic_tx = critic_optimizer(self.cfg)
        self.critic = self.fresh_critic()
        self.critic_opt_state = self._critic_tx.init(self.critic)
        self._prepare_gae = jax.jit(functools.partial(prepare_gae, self.graphdef, self.cfg))
        self._critic_step = jax.jit(functools.partial(_critic_step, self.graphdef, self._critic_tx, self.cfg),
                                    donate_argnums=(0, 1), static_argnums=(5,))

    def fresh_critic(self) -> dict[str, Any]:
        """A critic whose backbone is the policy's current weights (head at 0)."""
        critic = make_critic(self.state, self.model_cfg.dim)
        critic["head"] = {k: self._replicated(v) for k, v in critic["head"].items()}
        return critic

    def step(self, batch: Batch) -> StepMetrics:
        """One batch: ppo_epochs x mini_batches optimizer updates, one version."""
        mini = min(self.cfg.mini_batches, len(batch.tokens_bt))
        rewards_gk, rows = self.device_inputs(batch, mini_batches=mini)
        key = self._replicated(jax.random.key_data(jax.random.key(self.step_count)))
        rewards = self._replicated(rewards_gk)
        start: dict[str, jax.Array] = {}
        if self.critic is not None:  # values, rewards and GAE before any update of this batch
            rows, start = self._prepare_gae(self.critic, self.state, self.ref_state, rows)
        self.state, self.opt_state, metrics = self._rl_step(
            self.state, self.opt_state, self.ref_state, rows, rewards, key, mini, **self.step_kwargs)
        if self.critic is not None:
            self.critic, self.critic_opt_state, value_metrics = self._critic_step(
                self.critic, self.critic_opt_state, rows, rewards, key, mini)
            metrics = {**metrics, **start, **value_metrics}
        return self._finish(metrics, batch, reward_mean=float(np.mean(rewards_gk)))

    def restore(self, state: nnx.State, opt_state: Any, step: int, critic: dict[str, Any] | None = None) -> None:
        """Continues from a checkpoint; the KL reference stays the initial policy.

        `critic`: {"params", "opt_state"} as checkpointed. None while advantage is "gae" (a
        checkpoint written without a critic): a fresh critic from the restored policy, with a
        fresh AdamW, so the run goes on and its first values are 0 (the checkpointer warns)."""
        self.state, self.opt_state, self.step_count = state, opt_state, step
        if self.critic is None:
            return
        if critic is None:
            self.critic = self.fresh_critic()
            self.critic_opt_state = self._critic_tx.init(self.critic)
        else:
            self.critic, self.critic_opt_state = critic["params"], critic["opt_state"]

    def critic_checkpoint(self) -> dict[str, Any] | None:
        """What a checkpoint holds of the critic ({"params", "opt_state"}); None without one."""
        return None if self.critic is None else {"params": self.critic, "opt_state": self.critic_opt_state}

    def serving_state(self) -> nnx.State:
        """What every publish carries, as inference serves it: the master copy (with LoRA, the
        adapters alone) in param_dtype (the same arrays when that is float32)."""
        return cast_state(self.state, self.param_dtype)

    def policy_state(self) -> nnx.State:
        """The whole policy in param_dtype (with LoRA: the frozen base and the adapters, unmerged)."""
        serving = self.serving_state()
        return serving if self.frozen is None else merge_states(self.frozen, serving)

    def set_reference(self) -> None:
        """Makes the current policy the KL reference (after the SFT warm start, reference "after_sft")."""
        if self.ref_state is not None:
            self.ref_state = self._reference()

    def _reference(self) -> nnx.State:
        # A copy: with param_dtype float32 the cast returns the very arrays a step donates.
        return jax.tree.map(jnp.copy, self.serving_state())

    def sft_step(self, batch: SFTBatch) -> StepMetrics:
        if self.sft_opt_state is None:
            self.sft_opt_state = self._sft_tx.init(self.state)
        rows = self._on_device({"tokens_bt": batch.tokens_bt, "mask_bt": batch.mask_bt})
        self.state, self.sft_opt_state, metrics = self._sft_step(self.state, self.sft_opt_state, rows,
                                                                 **self.step_kwargs)
        return self._finish(metrics, batch, reward_mean=0.0)

    def device_inputs(self, batch: Batch, *, mini_batches: int) -> tuple[np.ndarray, dict[str, jax.Array]]:
        """(the rewards the step optimises per trajectory, [groups, group_size] on the host; the
        batch's rows on the device). `algorithm.reward_weight` / `env_reward_weight` choose the
        reward once here, for group advantages and GAE alike (`batching.objective_rewards`)."""
        rewards_gk, token_rewards = objective_rewards(batch, self.cfg.algorithm)
        rows = {"tokens_bt": batch.tokens_bt, "behaviour_logprobs_bt": batch.behaviour_logprobs_bt,
                "mask_bt": batch.mask_bt}
        if self.critic is not None:
            rows["token_rewards_bt"] = token_rewards
        if batch.experts_btlk is not None and batch.replay_bt is not None and not self.cfg.pack:
            # Routing replay's records (or, replay off, what routing_mismatch is measured against;
            # packed rows carry none: trainer.pack and routing replay exclude each other).
            rows["experts_btlk"], rows["replay_bt"] = batch.experts_btlk, batch.replay_bt
        if batch.kept_btk is not None and not self.cfg.pack:  # filter replay (packed rows: the own filter)
            rows["kept_btk"] = batch.kept_btk
        return rewards_gk, self._on_device(rows, mini_batches=mini_batches, pack=self.cfg.pack)

    def _on_device(self, rows: dict[str, np.ndarray], *, mini_batches: int = 1,
                   pack: bool = False) -> dict[str, jax.Array]:
        """[micro_batches, rows, ...] arrays on the device; `pack`: plus each micro-batch's packed
        rows (trainer.pack, packing.packed_micro_batches), which the forward passes run on."""
        mini_rows = -(-len(rows["tokens_bt"]) // mini_batches)
        size = self.cfg.micro_batch_size or mini_rows
        # Whole micro-batches per mini-batch: rows padded to mini_batches x ceil(mini_rows / size) x size.
        padded = pad_rows(rows, multiple=mini_batches * size * -(-mini_rows // size))
        # [micro_batches, rows, ...]: static shapes, so one compiled step per bucket.
        shaped = {k: v.reshape(-1, size, *v.shape[1:]) for k, v in padded.items()}
        if pack:
            shaped.update(packed_micro_batches(shaped["tokens_bt"], shaped["mask_bt"]))
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in shaped.items()}
        # Packed rows number fewer than the batch's: each array is split over its own rows.
        return {k: jax.device_put(v, batch_sharding(self.mesh, v.shape[1], ndim=v.ndim)) for k, v in shaped.items()}

    def _replicated(self, array: np.ndarray) -> jax.Array:
        # On a mesh spanning several processes a jitted step takes only global arrays.
        if self.mesh is None:
            return jnp.asarray(array)
        return jax.device_put(array, NamedSharding(self.mesh, PartitionSpec()))

    def _finish(self, metrics: dict[str, jax.Array], batch: Batch | SFTBatch, *, reward_mean: float) -> StepMetrics:
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}  # one deliberate sync per step
        # Several updates per batch: the step counts as skipped (weights unchanged) only when all were.
        skipped = host.pop("skipped", 0.0) >= 1.0
        self.step_count += 0 if skipped else 1
        return StepMetrics(
            skipped=skipped,
            loss=host.pop("loss"), reward_mean=reward_mean, clip_fraction=host.pop("clip_fraction", 0.0),
            approx_kl=host.pop("approx_kl", 0.0), grad_norm=host.pop("grad_norm"), num_tokens=batch.num_tokens,
            extra=host,
        )


def fitted_shardings(abstract: nnx.State, mesh: Mesh) -> Any:
    """`fitted_state_shardings`, logging the parameters whose sharding the fit gave up (they cost
    their full size on every device of the axis)."""
    wanted = jax.tree.leaves(state_shardings(abstract, mesh))
    fitted = fitted_state_shardings(abstract, mesh)
    paths = [(jax.tree_util.keystr(p), w.spec, f.spec) for (p, f), w
             in zip(jax.tree_util.tree_leaves_with_path(fitted), wanted, strict=True) if w.spec != f.spec]
    if paths:
        log.info("trainer mesh %s: %d parameters keep a dimension replicated the mesh does not divide, e.g. "
                 "%s %s -> %s", dict(mesh.shape), len(paths), *paths[0])
    return fitted


def initial_params(source: ModelSource, shardings: Any) -> tuple[nnx.State, nnx.State | None]:
    """(trained parameters in float32, the frozen LoRA base in param_dtype or None)."""
    if source.cfg.lora is None:
        return source.initial_state(shardings, dtype="float32"), None
    # Loaded in param_dtype, so a float32 copy of the base never exists; the adapters' A is
    # random anyway (and B zero), so their round trip through param_dtype loses nothing that matters.
    adapters, base = split_adapters(source.initial_state(shardings, dtype=source.param_dtype))
    return cast_state(adapters, "float32"), quantize_base(base, source.cfg.lora.quantize, source.cfg.lora.quant_block)


def policy_model(graphdef: Any, params: nnx.State, frozen: nnx.State | None) -> Any:
    """The model from its trained parameters and, with LoRA, the frozen base."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def pad_rows(arrays: dict[str, np.ndarray], *, multiple: int) -> dict[str, np.ndarray]:
    """Pads the batch dimension up to a multiple with all-zero rows (mask 0: they add nothing)."""
    n = len(next(iter(arrays.values())))
    extra = (-n) % multiple
    if not extra:
        return arrays
    return {k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)]) for k, v in arrays.items()}


def _accumulate(
    graphdef: Any, objective: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
    state: nnx.State, mbs: dict[str, jax.Array], param_dtype: str = "float32", frozen: nnx.State | None = None,
) -> tuple[jax.Array, nnx.State, dict[str, jax.Array]]:
    """Sums loss and gradients over the leading (micro-batch) axis; `objective(model, mb)`. The
    forward runs on the master copy cast to param_dtype (exactly the weights inference serves);
    the cast's gradient brings the gradients back to float32 for the master update. Gradients
    are taken of `state` alone: with LoRA, the adapters, never the `frozen` base."""
    return _accumulate_params(
        lambda state, mb: objective(policy_model(graphdef, cast_state(state, param_dtype), frozen), mb), state, mbs)


def _accumulate_params(
    loss_fn: Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]],
    state: Any, mbs: dict[str, jax.Array],
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """`_accumulate` for any parameter tree: `loss_fn(params, mb)`."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    num_mb = next(iter(mbs.values())).shape[0]

    def body(carry: tuple[jax.Array, nnx.State, dict[str, jax.Array]], mb: dict[str, jax.Array]):
        loss_sum, grads_sum, metrics_sum = carry
        (loss, metrics), grads = grad_fn(state, mb)
        metrics_sum = jax.tree.map(lambda a, b: a + b / num_mb, metrics_sum, metrics)
        return (loss_sum + loss, jax.tree.map(jnp.add, grads_sum, grads), metrics_sum), None

    first = jax.tree.map(lambda x: x[0], mbs)
    metrics_shape = jax.eval_shape(loss_fn, state, first)[1]
    init = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape))
    (loss, grads, metrics), _ = jax.lax.scan(body, init, mbs)
    return loss, grads, metrics


def _apply(tx: optax.GradientTransformation, state: nnx.State, opt_state: Any, grads: nnx.State):
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state


def _apply_if_finite(tx: optax.GradientTransformation, state: nnx.State, opt_state: Any, grads: nnx.State,
                     loss: jax.Array) -> tuple[nnx.State, Any, dict[str, jax.Array]]:
    """The update, or none at all when the loss or gradient norm is non-finite.

    Decided inside the jitted step: the state is donated, so once the step returns the old
    arrays are gone and a check on the host could no longer keep them. A skipped step leaves
    weights and optimizer state (Adam's moments and count) exactly as they were.
    """
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    state, opt_state = jax.lax.cond(ok, lambda: _apply(tx, state, opt_state, grads), lambda: (state, opt_state))
    return state, opt_state, {"loss": loss, "grad_norm": grad_norm, "skipped": 1.0 - ok.astype(jnp.float32)}


def _rl_step(graphdef: Any, tx: optax.GradientTransformation, tc: TrainerConfig, param_dtype: str,
             sampling: SamplingConfig, state: nnx.State, opt_state: Any, ref_state: nnx.State | None,
             mbs: dict[str, jax.Array], rewards_gk: jax.Array, key_data: jax.Array, mini_batches: int,
             frozen: nnx.State | None = None):
    obj = tc.algorithm
    ref_model = policy_model(graphdef, ref_state, frozen) if ref_state is not None else None
    num_mb, size = mbs["mask_bt"].shape[:2]
    total_rows, real_rows = num_mb * size, rewards_gk.size
    if obj.kl_coef:  # once per batch, chunked, no gradient (objectives.with_reference_logprobs says why)
        mbs = with_reference_logprobs(ref_model, mbs, tc)
    if "advantages_bt" not in mbs:  # group advantages; GAE (critic.prepare_gae) brings per-token ones
        if obj.kl_coef and obj.kl_in_reward:
            model = policy_model(graphdef, cast_state(state, param_dtype), frozen)
            kl_b = jax.lax.map(lambda mb: sequence_kl(model, mb, tc), mbs).reshape(-1)
            kl_gk = jax.lax.stop_gradient(kl_b[: rewards_gk.size]).reshape(rewards_gk.shape)
            rewards_gk = rewards_gk - obj.kl_coef * kl_gk
        adv = advantages_b(obj, rewards_gk)
        mbs = {**mbs, "advantages_b": jnp.pad(adv, (0, total_rows - adv.size)).reshape(num_mb, size)}
    updates = tc.ppo_epochs * mini_batches
    if updates > 1:
        # The proximal policy: the trainer's logprobs before this batch's first update, once.
        model = policy_model(graphdef, cast_state(state, param_dtype), frozen)
        mbs["old_logprobs_bt"] = jax.lax.map(lambda mb: old_logprobs(model, mb, tc, sampling), mbs)

    def update(carry, rows: dict[str, jax.Array]):
        state, opt_state = carry
        real = rows.pop("real_b")
        mask = rows["mask_bt"][:, :, 1:].reshape(-1, rows["mask_bt"].shape[-1] - 1)
        denominator = aggregate_denominator(mask, obj.aggregation, obj.norm_constant or None, num_rows=real.sum())
        loss, grads, metrics = _accumulate(
            graphdef, lambda model, mb: rl_objective(model, mb, denominator, tc, ref_model, sampling, mask.sum()),
            state, rows, param_dtype, frozen)
        state, opt_state, outcome = _apply_if_finite(tx, state, opt_state, grads, loss)
        return (state, opt_state), {**metrics, **outcome}

    (state, opt_state), metrics = _epochs(update, (state, opt_state), mbs, key_data, tc.ppo_epochs, mini_batches,
                                          real_rows)
    return state, opt_state, metrics


def _epochs(update: Callable, carry: Any, mbs: dict[str, jax.Array], key_data: jax.Array, ppo_epochs: int,
            mini_batches: int, real_rows: int) -> tuple[Any, dict[str, jax.Array]]:
    """`update(carry, rows)` over ppo_epochs x mini_batches mini-batches of `mbs` ([micro-batches,
    rows, ...]); rows["real_b"] marks the real rows. Returns the carry and every update's
    diagnostics averaged ("skipped" is then the fraction of updates skipped)."""
    num_mb, size = mbs["mask_bt"].shape[:2]
    total_rows = num_mb * size
    flat = {k: v.reshape(total_rows, *v.shape[2:]) for k, v in mbs.items()} if mini_batches > 1 else {}
    keys = jax.random.split(jax.random.wrap_key_data(key_data), ppo_epochs)

    def epoch(carry, key: jax.Array):
        if mini_batches == 1:  # the batch as it is: no gather
            rows = {k: v[None] for k, v in mbs.items()}
            rows["real_b"] = (jnp.arange(total_rows) < real_rows).astype(jnp.float32).reshape(1, num_mb, size)
            return jax.lax.scan(update, carry, rows)
        # Real rows shuffled, padding last, dealt round-robin: every mini-batch gets floor or
        # ceil of real_rows / mini_batches real rows, never only padding.
        order = jnp.concatenate([jax.random.permutation(key, real_rows), jnp.arange(real_rows, total_rows)])
        index = order.reshape(-1, mini_batches).T.reshape(mini_batches, -1, size)
        rows = {k: v[index] for k, v in flat.items()}
        rows["real_b"] = (index < real_rows).astype(jnp.float32)
        return jax.lax.scan(update, carry, rows)

    carry, per_update = jax.lax.scan(epoch, carry, keys)
    return carry, jax.tree.map(jnp.mean, per_update)


def _critic_step(graphdef: Any, tx: optax.GradientTransformation, tc: TrainerConfig, critic: dict[str, Any],
                 opt_state: Any, mbs: dict[str, jax.Array], rewards_gk: jax.Array, key_data: jax.Array,
                 mini_batches: int):
    """The critic's ppo_epochs x mini_batches updates on the batch's returns (`prepare_gae`), with
    the policy step's key, so the same shuffles. Each mini-batch's value loss is its model
    tokens' mean; a non-finite loss or gradient skips that update (and only it)."""

    def update(carry, rows: dict[str, jax.Array]):
        critic, opt_state = carry
        rows.pop("real_b")
        denominator = jnp.maximum(rows["mask_bt"][:, :, 1:].sum(), 1.0)
        loss, grads, metrics = _accumulate_params(
            lambda params, mb: value_objective(graphdef, tc, params, mb, denominator), critic, rows)
        critic, opt_state, outcome = _apply_if_finite(tx, critic, opt_state, grads, loss)
        return (critic, opt_state), {**metrics, **{f"value_{k}": v for k, v in outcome.items()}}

    (critic, opt_state), metrics = _epochs(update, (critic, opt_state), mbs, key_data, tc.ppo_epochs,
                                           mini_batches, rewards_gk.size)
    return critic, opt_state, metrics


def _sft_step(graphdef: Any, tx: optax.GradientTransformation, tc: TrainerConfig, param_dtype: str,
              state: nnx.State, opt_state: Any, mbs: dict[str, jax.Array], frozen: nnx.State | None = None):
    denominator = jnp.maximum(mbs["mask_bt"][:, :, 1:].sum(), 1.0)
    loss, grads, metrics = _accumulate(graphdef, lambda model, mb: sft_objective(model, mb, denominator, tc),
                                       state, mbs, param_dtype, frozen)
    state, opt_state, outcome = _apply_if_finite(tx, state, opt_state, grads, loss)
    return state, opt_state, {**metrics, **outcome}
