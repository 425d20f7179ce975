"""What one micro-batch contributes to the loss: the RL objective and the SFT objective.

Pure functions of (model, micro-batch, whole-batch denominators); the learner sums their
gradients over micro-batches, so a batch trains the same whatever the micro-batch size.
They read the run's `trainer` section directly: `algorithm` for the objective, `remat` and
`logprob_chunk` for the memory of the forward pass, and the run's `rollout.sampling`: the
policy's logprobs are taken under the distribution the rollout sampled from (the same
temperature, top-k, top-p, min-p), so a ratio of 1 means "the same policy" (docs/algorithms.md).

Every forward here honours `logprob_chunk`: the policy's logprobs, its own (unfiltered) logprobs
for the KL and its entropy come out of one chunked pass (`policy_terms_fn`), and the reference's
logprobs are computed once per batch before the step (`with_reference_logprobs`), so with
`logprob_chunk` > 0 no [batch, length, vocab] logits exist anywhere in the train step.

With `trainer.pack` a micro-batch also carries its packed rows (services/trainer/packing.py):
every forward here runs on those (`forward_layout`) and its per-target outputs come back in the
batch's own layout (`to_batch_layout`) before any loss term reads them, so the loss is computed
exactly as for the padded batch.

Routing replay (`trainer.algorithm.routing_replay`, a model with routed experts): a micro-batch
whose trajectories carry their sampler's experts has them as "experts_btlk" / "replay_bt" (at the
input positions, batching.Batch). The policy's forward (`routed_hidden`) and the proximal
policy's (`old_logprobs`, and the KL-in-reward policy forward) use them at the replayed positions
and their own router elsewhere; the KL reference routes itself (it is another policy: replaying
the sampler's choices into it would not measure its own distribution). Whenever a micro-batch
carries recorded experts, replay on or off, the step reports `routing_mismatch` (the fraction of
replayed positions where any routed layer's experts in the forward differ as a set from the
recorded ones: 0 with replay) and `routing_own_mismatch` (the same for the routers' own top-k,
which replay overrides: what the mismatch would be without it).

Filter replay (arlo/filter_replay.py, `rollout.sampling.top_k` > 0): a micro-batch whose
trajectories carry the kept set each token was drawn from has them as "kept_btk"; the behaviour
distribution's logprobs (`sampled_targets`) are then taken over exactly those sets, so no sampled
token is outside the set that scores it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from arlo.config import AlgorithmConfig, Remat, SamplingConfig, TrainerConfig
from arlo.model import token_logprobs
from arlo.model.logprobs import (
    LogprobFn,
    SampledTargets,
    chunked_token_logprobs,
    sampled_token_logprobs,
    sampled_token_logprobs_and_outside,
    target_ids,
    token_entropy,
)
from arlo.model.moe import load_balancing_loss, routing_mismatch_bt
from services.trainer.advantages import (
    batch_normalized_advantages,
    grpo_advantages,
    rloo_advantages,
)
from services.trainer.losses import (
    aggregate,
    kl_estimate,
    masked_mean,
    mismatch_metrics,
    policy_loss,
    sft_loss,
)
from services.trainer.packing import unpack

_UNFILTERED = SamplingConfig()


def behaviour_logprob_fn(sampling: SamplingConfig, *, with_outside: bool = False) -> LogprobFn:
    """The logprobs of the distribution `sampling` draws from (static settings: one program);
    `with_outside`: (logprobs, outside), outside marking the sampled tokens the trainer's own
    filter would not have kept (scored with their own mass added to the kept set's)."""
    fn = sampled_token_logprobs_and_outside if with_outside else sampled_token_logprobs
    return functools.partial(fn, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                             min_p=sampling.min_p)


def forward_logprobs(model, inputs: Array, targets: Any, *, remat: Remat = "none", logprob_chunk: int = 0,
                     logprob_fn: LogprobFn = token_logprobs, h: Array | None = None,
                     layout: dict[str, Array] | None = None) -> tuple[Any, Array | None, Array]:
    """(logprobs_bt (or what `logprob_fn` returns), logits_btv or None when chunked, hidden_btd):
    `logprob_chunk` > 0 never holds [batch, length, vocab] logits whole. `layout`: packed rows'
    segment ids and positions (`forward_layout`)."""
    h = model.hidden(inputs, remat=remat, **(layout or {})) if h is None else h  # `h`: already computed
    if logprob_chunk:
        return chunked_token_logprobs(model, h, targets, logprob_chunk, logprob_fn), None, h
    logits = model.logits_from_hidden(h)
    return logprob_fn(logits, targets), logits, h


def recorded_routing(mb: dict[str, Array], inputs: Array) -> tuple[Array, Array] | None:
    """(experts_lbtk int32 [routed layers, rows, t, top_k], replay_bt [rows, t]) of the sampler's
    recorded experts at the forward's t input positions; None when the micro-batch carries none."""
    if "experts_btlk" not in mb:
        return None
    if "packed_tokens_bt" in mb:
        raise ValueError("trainer.pack: the recorded experts of routing replay are not packed; turn one off")
    t = inputs.shape[1]
    return jnp.moveaxis(mb["experts_btlk"][:, :t].astype(jnp.int32), 2, 0), mb["replay_bt"][:, :t]


def routed_hidden(model, inputs: Array, count_bt: Array, tc: TrainerConfig,
                  layout: dict[str, Array] | None = None,
                  mb: dict[str, Array] | None = None) -> tuple[Array, Array | None, dict[str, Array]]:
    """The policy's hidden states; with `trainer.router_aux_loss_coef`, its routers'
    load-balancing loss over the tokens `count_bt` marks (arlo.model.moe.load_balancing_loss),
    None without it; and with recorded experts in `mb` (routing replay), the routing metrics
    (module docstring), replaying them when `trainer.algorithm.routing_replay`. `layout`: packed
    rows (`forward_layout`)."""
    layout = layout or {}
    recorded = None if mb is None else recorded_routing(mb, inputs)
    if not tc.router_aux_loss_coef and recorded is None:
        return model.hidden(inputs, remat=tc.remat, **layout), None, {}
    replay = recorded is not None and tc.algorithm.routing_replay
    h, routings = model.hidden_routed(inputs, remat=tc.remat, count_bt=count_bt,
                                      experts_lbtk=recorded[0] if replay else None,
                                      replay_bt=recorded[1] if replay else None, **layout)
    if not routings:
        raise ValueError("trainer.router_aux_loss_coef / trainer.algorithm.routing_replay: the model has no "
                         "routed experts")
    metrics = {}
    if recorded is not None:
        experts, replay_bt = recorded
        replayed = jnp.maximum(replay_bt.sum(), 1.0)
        used = routing_mismatch_bt([r._replace(own_btk=r.experts_btk) for r in routings], experts)
        own = routing_mismatch_bt(routings, experts)
        metrics = {"routing_mismatch": (used * replay_bt).sum() / replayed,
                   "routing_own_mismatch": (own * replay_bt).sum() / replayed}
    return h, load_balancing_loss(routings) if tc.router_aux_loss_coef else None, metrics


def replayed_hidden(model, mb: dict[str, Array], inputs: Array, tc: TrainerConfig | None) -> Array | None:
    """The policy's hidden states with the recorded experts replayed (routing replay on and the
    micro-batch carrying them), for a forward without gradient; None otherwise (route itself)."""
    if tc is None or not tc.algorithm.routing_replay:
        return None
    recorded = recorded_routing(mb, inputs)
    if recorded is None:
        return None
    return model.hidden_routed(inputs, remat=tc.remat, experts_lbtk=recorded[0], replay_bt=recorded[1])[0]


def with_router_aux(loss: Array, metrics: dict[str, Array], aux: Array | None, mask_bt: Array,
                    batch_tokens: Array, tc: TrainerConfig) -> tuple[Array, dict[str, Array]]:
    """`loss` plus the micro-batch's load-balancing loss weighted by its share of the batch's
    counted tokens, so the micro-batches add up to their token-weighted mean (as HF computes it
    per forward and averages over accumulation steps)."""
    if aux is None:
        return loss, metrics
    share = mask_bt.sum() / jnp.maximum(batch_tokens, 1.0)
    return loss + tc.router_aux_loss_coef * aux * share, {**metrics, "router_aux_loss": aux}


def policy_terms_fn(sampling: SamplingConfig, *, model_logprobs: bool, entropy: bool) -> LogprobFn:
    """Everything the RL objective reads off the policy's logits, from one pass over them:
    {"logprobs", "outside"} under the behaviour distribution (`behaviour_logprob_fn`), plus
    "model_logprobs" (temperature 1, unfiltered: the KL's) and "entropy" (the bonus's) when asked.
    Chunked (`forward_logprobs` with `logprob_chunk`), each chunk's logits serve all of them."""
    behaviour = behaviour_logprob_fn(sampling, with_outside=True)

    def terms(logits_btv: Array, targets: Any) -> dict[str, Array]:
        logprobs, outside = behaviour(logits_btv, targets)
        out = {"logprobs": logprobs, "outside": outside}
        if model_logprobs:
            out["model_logprobs"] = token_logprobs(logits_btv, target_ids(targets))
        if entropy:
            out["entropy"] = token_entropy(logits_btv)
        return out

    return terms


def reference_logprobs(ref_model, mb: dict[str, Array], tc: TrainerConfig) -> Array:
    """The reference policy's logprobs of a micro-batch's targets (temperature 1, unfiltered: a
    filtered reference would put the floor on tokens it filters out and blow the KL up), chunked
    by `logprob_chunk`; no gradient."""
    return jax.lax.stop_gradient(batch_logprobs(ref_model, mb, logprob_chunk=tc.logprob_chunk))


def with_reference_logprobs(ref_model, mbs: dict[str, Array], tc: TrainerConfig) -> dict[str, Array]:
    """`mbs` ([micro_batches, rows, length] arrays) plus "ref_logprobs_bt", the reference's
    logprobs computed once for the batch, before any update and outside the differentiated
    function; kept when `mbs` already has them (critic.prepare_gae computed them for GAE's KL).

    Why before the step rather than inside each update's loss: the reference gets no gradient,
    so in the loss it would run again on every update (ppo_epochs x mini_batches forwards of the
    whole batch instead of one) for the same numbers. Memory does not decide it: XLA plans the
    same temporaries either way (compiled RL step, kl_coef 0.05, chunk 128, remat full, dim 64,
    2 layers: 8,834 MiB at vocab 151,936 and 8 x 4096, 152 MiB at vocab 32,768 and 8 x 512,
    inside the loss and before it alike; bench/long_context.py), since a forward without
    gradient keeps no residuals; the [rows, length] float32 it leaves costs 128 KiB at 8 x 4096.
    """
    if "ref_logprobs_bt" in mbs:
        return mbs
    return {**mbs, "ref_logprobs_bt": jax.lax.map(lambda mb: reference_logprobs(ref_model, mb, tc), mbs)}


def old_logprobs(model, mb: dict[str, Array], tc: TrainerConfig, sampling: SamplingConfig, *,
                 with_outside: bool = False) -> Any:
    """The trainer's logprobs of a micro-batch's targets before any update of this batch (the
    proximal policy of several updates per batch), under the behaviour distribution; no gradient.
    `with_outside`: (logprobs, outside), for `mb["old_outside_bt"]` (see rl_objective)."""
    out = batch_logprobs(model, mb, logprob_chunk=tc.logprob_chunk,
                         logprob_fn=behaviour_logprob_fn(sampling, with_outside=with_outside), replay=tc,
                         sampled=True)
    return jax.lax.stop_gradient(out)


def advantages_b(cfg: AlgorithmConfig, rewards_gk: Array) -> Array:
    """Per-sequence advantages, flattened in group-major order (the batch's row order)."""
    if cfg.advantage == "grpo":
        adv = grpo_advantages(rewards_gk, scale_by_std=True)
    elif cfg.advantage == "dr_grpo":
        adv = grpo_advantages(rewards_gk, scale_by_std=False)
    elif cfg.advantage == "rloo":
        adv = rloo_advantages(rewards_gk)
    elif cfg.advantage == "reinforce_pp":
        centred = rewards_gk - rewards_gk.mean(axis=1, keepdims=True)
        adv = batch_normalized_advantages(centred.reshape(-1)).reshape(rewards_gk.shape)
    else:
        raise ValueError(f"unknown advantage estimator {cfg.advantage!r}")
    return adv.reshape(-1)


def shifted(mb: dict[str, Array]) -> tuple[Array, Array, Array, Array]:
    """Inputs, targets and the per-target arrays: token t is predicted from tokens < t."""
    tokens = mb["tokens_bt"]
    return tokens[:, :-1], tokens[:, 1:], mb["behaviour_logprobs_bt"][:, 1:], mb["mask_bt"][:, 1:]


def forward_layout(mb: dict[str, Array], inputs: Array, targets: Array,
                   count_bt: Array) -> tuple[Array, Array, dict[str, Array], Array]:
    """(inputs, targets, the forward's `layout`, count_bt) of the rows the model runs on: the
    batch's own (as given), or with `trainer.pack` its packed rows (services/trainer/packing.py:
    each episode attends only to itself, at its own positions). Their per-target outputs come
    back in the batch's layout through `to_batch_layout`."""
    if "packed_tokens_bt" not in mb:
        return inputs, targets, {}, count_bt
    tokens = mb["packed_tokens_bt"]
    layout = {"segment_ids_bt": mb["packed_segment_ids_bt"][:, :-1],
              "positions_bt": mb["packed_positions_bt"][:, :-1]}
    return tokens[:, :-1], tokens[:, 1:], layout, mb["packed_count_bt"]


def to_batch_layout(out: Any, mb: dict[str, Array]) -> Any:
    """Per-target outputs of the forward ([rows, length - 1] arrays, or a tree of them) in the
    batch's own layout, whatever layout the forward ran in; so the loss is the padded batch's."""
    if "packed_index_bt" not in mb:
        return out
    return jax.tree.map(lambda x: unpack(x, mb["packed_index_bt"]), out)


def sampled_targets(mb: dict[str, Array], targets: Array) -> Any:
    """The forward's targets with the kept sets the sampler recorded (filter replay,
    arlo/filter_replay.py) when the micro-batch carries them, for the behaviour distribution's
    logprobs; the targets alone otherwise. Packed rows carry none (trainer.pack: the trainer's own
    filter scores them)."""
    if "kept_btk" not in mb or "packed_tokens_bt" in mb:
        return targets
    return SampledTargets(targets, mb["kept_btk"][:, 1:])


def batch_logprobs(model, mb: dict[str, Array], *, remat: Remat = "none", logprob_chunk: int = 0,
                   logprob_fn: LogprobFn = token_logprobs, replay: TrainerConfig | None = None,
                   sampled: bool = False) -> Any:
    """`forward_logprobs` of the micro-batch's targets, in its own layout (packed or not).
    `replay`: the trainer config, to replay the micro-batch's recorded experts when its
    `algorithm.routing_replay` says so (the policy's forwards); None: the model routes itself.
    `sampled`: `logprob_fn` scores the behaviour distribution (`sampled_targets`)."""
    inputs, targets, _, mask = shifted(mb)
    inputs, targets, layout, _ = forward_layout(mb, inputs, targets, mask)
    targets = sampled_targets(mb, targets) if sampled else targets
    out, _, _ = forward_logprobs(model, inputs, targets, remat=remat, logprob_chunk=logprob_chunk,
                                 logprob_fn=logprob_fn, layout=layout, h=replayed_hidden(model, mb, inputs, replay))
    return to_batch_layout(out, mb)


def rl_objective(model, mb: dict[str, Array], denominator: Array, tc: TrainerConfig,
                 ref_model=None, sampling: SamplingConfig = _UNFILTERED,
                 batch_tokens: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """`tc.algorithm`: with `decoupled` or `is_cap` the ratio is against the trainer's own
    logprobs at the batch's start (the proximal policy), weighted by min(proximal/behaviour,
    is_cap) when is_cap > 0 (truncated importance sampling); else against the behaviour policy.

    `mb["advantages_bt"]` ([rows, length - 1], GAE) replaces `mb["advantages_b"]` when present.
    `mb["old_logprobs_bt"]`, when present, holds the trainer's batch-start logprobs (several
    updates per batch); without it this is the batch's only update, so the current logprobs
    without gradient are exactly the batch-start ones (no second forward pass needed).
    `mb["old_outside_bt"]` (old_logprobs' `with_outside`), when present, is the batch start's
    `logprob_outside` mask; without it the mask is this update's forward's.
    `mb["ref_logprobs_bt"]` (with_reference_logprobs), when present, holds the reference's
    logprobs for the KL term; without it they are computed here from `ref_model`.
    `batch_tokens`: the whole batch's loss tokens, which weigh the routers' load-balancing loss
    (`trainer.router_aux_loss_coef`, see with_router_aux); None: this micro-batch is the batch.
    """
    cfg = tc.algorithm
    norm = cfg.norm_constant or None
    inputs, targets, behaviour, mask = shifted(mb)
    kl_in_loss = bool(cfg.kl_coef) and not cfg.kl_in_reward
    inputs, targets, layout, count = forward_layout(mb, inputs, targets, mask)
    h, router_aux, routing_metrics = routed_hidden(model, inputs, count, tc, layout, mb)
    terms, _, _ = forward_logprobs(
        model, inputs, sampled_targets(mb, targets), remat=tc.remat, logprob_chunk=tc.logprob_chunk,
        logprob_fn=policy_terms_fn(sampling, model_logprobs=kl_in_loss, entropy=cfg.entropy_coef > 0), h=h)
    terms = to_batch_layout(terms, mb)
    logprobs, outside = terms["logprobs"], terms["outside"]
    old = mb["old_logprobs_bt"] if "old_logprobs_bt" in mb else jax.lax.stop_gradient(logprobs)
    proximal = old if cfg.decoupled or cfg.is_cap else behaviour
    # Per-token advantages (GAE) when the batch has them; else one per sequence, on every token.
    adv_bt = mb["advantages_bt"] if "advantages_bt" in mb else jnp.broadcast_to(mb["advantages_b"][:, None],
                                                                                 logprobs.shape)
    loss, metrics = policy_loss(logprobs, proximal, behaviour, adv_bt, mask, cfg, denominator)
    # Sampler vs trainer on the same weights, whatever the ratio's denominator is: the numeric
    # part on tokens both kept, and apart from it the tokens outside the trainer's filter.
    metrics.update(mismatch_metrics(old, behaviour, mask, mb.get("old_outside_bt", outside)))
    metrics.update(routing_metrics)
    if kl_in_loss:
        # KL between the models themselves (temperature 1, unfiltered), see reference_logprobs.
        ref_lp = mb["ref_logprobs_bt"] if "ref_logprobs_bt" in mb else reference_logprobs(ref_model, mb, tc)
        kl = kl_estimate(terms["model_logprobs"], ref_lp, cfg.kl_kind)
        loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.aggregation, norm, denominator)
        metrics["kl_ref"] = masked_mean(kl, mask)
    if cfg.entropy_coef:
        entropy = terms["entropy"]
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.aggregation, norm, denominator)
        metrics["entropy"] = masked_mean(entropy, mask)
    return with_router_aux(loss, metrics, router_aux, mask, mask.sum() if batch_tokens is None else batch_tokens, tc)


def model_kl_bt(model, mb: dict[str, Array], tc: TrainerConfig) -> Array:
    """Per-target KL(pi || pi_ref) estimate (`algorithm.kl_kind`) of a micro-batch, masked, no
    gradient: the KL penalty folded into the reward (`kl_in_reward`). The policy's logprobs are
    chunked by `logprob_chunk`; the reference's are `mb["ref_logprobs_bt"]` (with_reference_logprobs)."""
    inputs, targets, _, mask = shifted(mb)
    inputs, targets, layout, _ = forward_layout(mb, inputs, targets, mask)
    lp, _, _ = forward_logprobs(model, inputs, targets, logprob_chunk=tc.logprob_chunk, layout=layout,
                                h=replayed_hidden(model, mb, inputs, tc))
    lp = to_batch_layout(lp, mb)
    return jax.lax.stop_gradient(kl_estimate(lp, mb["ref_logprobs_bt"], tc.algorithm.kl_kind)) * mask


def sequence_kl(model, mb: dict[str, Array], tc: TrainerConfig) -> Array:
    """Summed per-token KL of each sequence, for a KL penalty folded into the reward."""
    return model_kl_bt(model, mb, tc).sum(axis=1)


def sft_objective(model, mb: dict[str, Array], denominator: Array,
                  tc: TrainerConfig) -> tuple[Array, dict[str, Array]]:
    """`mb` holds tokens_bt and mask_bt only (an SFT batch has no sampler logprobs)."""
    tokens = mb["tokens_bt"]
    mask = mb["mask_bt"][:, 1:]
    h, router_aux, _ = routed_hidden(model, tokens[:, :-1], mask, tc)
    logprobs, _, _ = forward_logprobs(model, tokens[:, :-1], tokens[:, 1:], remat=tc.remat,
                                      logprob_chunk=tc.logprob_chunk, h=h)
    loss, metrics = sft_loss(logprobs, mask)
    # sft_loss is a token mean over this micro-batch; rescale to the whole batch's token count.
    return with_router_aux(loss * jnp.maximum(mask.sum(), 1.0) / denominator, metrics, router_aux, mask,
                           denominator, tc)
