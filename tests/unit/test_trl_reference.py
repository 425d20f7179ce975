"""arlo's GRPO-family losses, gradients and advantages against TRL's (an implementation we did not write).

The loss is TRL's own code: `GRPOTrainer._compute_loss` (trl 1.16.0,
trl/trainer/grpo_trainer.py) run unbound on a minimal stand-in for the trainer that hands it
our per-token logprobs (a leaf tensor, so torch gives the gradient) instead of running a
model; everything after that, the ratio, clipping, TIS weight and each `loss_type`'s
normalisation, is TRL's. Group-normalised advantages are inline in TRL's
`_generate_and_score_completions` (grpo_trainer.py lines 2761-2787 in 1.16.0), so they are
reproduced here from those lines, with TRL's own `nanstd`. Needs the [ref] extra.
"""

from __future__ import annotations

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlo.config import AlgorithmConfig
from services.trainer.advantages import grpo_advantages
from services.trainer.losses import policy_loss

torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch)")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="needs the [ref] extra: pip install -e '.[ref]'")
trl_utils = pytest.importorskip("trl.trainer.utils")

B, T, MAX_LEN = 6, 9, 16


class _Accelerator:
    """One process: gather and reduce are the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(lp: np.ndarray, old: np.ndarray, adv_b: np.ndarray, mask: np.ndarray, *, loss_type: str,
             eps_low: float, eps_high: float, delta: float | None = None, level: str = "token",
             is_ratio: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """(loss, d loss / d logprobs) from TRL's GRPOTrainer._compute_loss."""
    logps = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN, accelerator=_Accelerator(), _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros((B, 1), dtype=torch.long), "prompt_mask": torch.ones((B, 1), dtype=torch.long),
        "completion_ids": torch.zeros((B, T), dtype=torch.long), "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(adv_b, dtype=torch.float64),
        "old_per_token_logps": torch.tensor(old, dtype=torch.float64),
        "num_items_in_batch": torch.tensor(float(mask.sum())),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = torch.tensor(is_ratio, dtype=torch.float64)
    loss = trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    return float(loss.detach()), logps.grad.numpy()


def arlo_loss(lp, prox, behav, adv_b, mask, cfg: AlgorithmConfig) -> tuple[float, np.ndarray]:
    adv_bt = jnp.broadcast_to(jnp.asarray(adv_b)[:, None], lp.shape)

    def f(x):
        return policy_loss(x, jnp.asarray(prox), jnp.asarray(behav), adv_bt, jnp.asarray(mask), cfg)[0]

    loss, grad = jax.value_and_grad(f)(jnp.asarray(lp))
    return float(loss), np.asarray(grad)


def batch(seed: int):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2, 0.5, size=(B, T))
    lp = old + rng.normal(0, 0.3, size=(B, T))  # ratios from ~0.4 to ~2.5: both clips bite
    behav = old + rng.normal(0, 0.3, size=(B, T))
    adv = rng.normal(size=B)
    mask = (rng.random(size=(B, T)) > 0.3).astype(np.int64)
    mask[:, 0] = 1  # every completion has a token (TRL's "grpo" mean counts every row)
    return [x.astype(np.float32) for x in (lp, old, behav, adv)] + [mask]


# arlo's config for each TRL loss_type: the aggregation is what distinguishes them.
CASES = {
    "grpo": (dict(loss_type="grpo", eps_low=0.2, eps_high=0.2), AlgorithmConfig(aggregation="seq_mean_token_mean")),
    "bnpo": (dict(loss_type="bnpo", eps_low=0.2, eps_high=0.2), AlgorithmConfig(aggregation="token_mean")),
    "dapo": (dict(loss_type="dapo", eps_low=0.2, eps_high=0.28),
             AlgorithmConfig(aggregation="token_mean", clip_eps=0.2, clip_eps_high=0.28)),
    "dr_grpo": (dict(loss_type="dr_grpo", eps_low=0.2, eps_high=0.2),
                AlgorithmConfig(aggregation="seq_sum_norm", norm_constant=float(MAX_LEN))),
    # TRL's two-sided clipping `delta` is arlo's dual clip: both cap a negative advantage's ratio at c.
    "grpo_dual_clip": (dict(loss_type="grpo", eps_low=0.2, eps_high=0.2, delta=3.0),
                       AlgorithmConfig(aggregation="seq_mean_token_mean", dual_clip=3.0)),
    # GSPO: one length-normalised ratio per sequence.
    "gspo": (dict(loss_type="grpo", eps_low=3e-4, eps_high=4e-4, level="sequence"),
             AlgorithmConfig(aggregation="seq_mean_token_mean", ratio_level="sequence", clip_eps=3e-4,
                             clip_eps_high=4e-4)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_losses_and_gradients_equal_trl(name: str, seed: int) -> None:
    lp, old, behav, adv, mask = batch(seed)
    trl_kw, cfg = CASES[name]
    want, want_grad = trl_loss(lp, old, adv, mask, **trl_kw)
    # On-policy arlo clips against the proximal (= TRL's old) logprobs; is_cap 0: no weight.
    got, got_grad = arlo_loss(lp, old, old, adv, mask, cfg)
    assert got == pytest.approx(want, abs=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6, rtol=0)
    assert np.abs(want_grad).max() > 1e-3  # a batch where the gradient is not trivially 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_truncated_importance_sampling_equals_trl(loss_type: str) -> None:
    """TRL's vLLM correction in "token_truncate" mode: the loss times min(pi_old / pi_sampler, cap)."""
    lp, old, behav, adv, mask = batch(2)
    cap = 1.5
    # grpo_trainer.py lines 2660-2685 (1.16.0): exp((old - sampling) * mask), clamped to [clip_min, clip_max].
    is_ratio = np.clip(np.exp((old - behav) * mask), None, cap)
    trl_kw, cfg = CASES[loss_type]
    want, want_grad = trl_loss(lp, old, adv, mask, is_ratio=is_ratio, **trl_kw)
    cfg = AlgorithmConfig(**{**{f: getattr(cfg, f) for f in ("aggregation", "clip_eps", "clip_eps_high")},
                             "is_cap": cap})
    got, got_grad = arlo_loss(lp, old, behav, adv, mask, cfg)
    assert got == pytest.approx(want, abs=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6, rtol=0)


def trl_advantages(rewards: np.ndarray, k: int, scale_rewards: str) -> np.ndarray:
    """grpo_trainer.py lines 2761-2787 (trl 1.16.0, multi_objective_aggregation "sum_then_normalize")."""
    r = torch.tensor(rewards.reshape(-1), dtype=torch.float64)
    mean = torch.nanmean(r.view(-1, k), dim=1).repeat_interleave(k, dim=0)
    if scale_rewards in ("group", "none"):
        std = trl_utils.nanstd(r.view(-1, k), dim=1).repeat_interleave(k, dim=0)
    else:
        std = trl_utils.nanstd(r).expand_as(r)
    adv = r - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return adv.numpy().reshape(rewards.shape)


@pytest.mark.parametrize(("estimator", "scale_rewards"), [("grpo", "group"), ("dr_grpo", "none")])
def test_group_advantages_equal_trl(estimator: str, scale_rewards: str) -> None:
    rng = np.random.default_rng(4)
    rewards = rng.normal(size=(5, 4)).astype(np.float32)
    rewards[1] = 1.0  # an all-equal group: advantage 0 on both sides
    want = trl_advantages(rewards, 4, scale_rewards)
    # TRL's eps is 1e-4 (arlo's default, 1e-6, is verl's); the estimator is otherwise the same.
    got = np.asarray(grpo_advantages(jnp.asarray(rewards), scale_by_std=estimator == "grpo", eps=1e-4))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert np.all(got[1] == 0.0)
