"""bfloat16 serving with top-k / top-p: the trainer scores every token the engine sampled.

The real inference engine (KV-cached decode, its own sampler) and the trainer's full forward
on the same bf16 weights differ in the last bits, so at a near-tie on the filter's edge the
trainer's top-k / top-p can rank a sampled token just outside. Before, such a token got the
-1e4 floor: ratio ~0, no gradient, and a `logprob_mismatch` of 30 to 67 nats that hid the
numeric mismatch (issue 32). Now it is scored with its own mass added to the kept set's
(arlo.model.logprobs.sampled_token_logprobs_and_outside) and counted in `logprob_outside`.
With filter replay (arlo/filter_replay.py) the engine's own kept sets are applied and nothing is
outside: the issue's bar.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import InferenceConfig, SamplingConfig, TrainerConfig
from arlo.filter_replay import NOT_KEPT, kept_ids
from arlo.model.logprobs import SampledTargets
from arlo.model.sampling import LOGPROB_FLOOR
from arlo.model.source import preset_source
from arlo.model.transformer import create_model
from services.inference.engine import Engine, SamplingRequest
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from services.trainer.losses import mismatch_metrics
from services.trainer.objectives import behaviour_logprob_fn, forward_logprobs, old_logprobs, rl_objective
from tests.unit.test_trainer_behaviour_logprobs import PROMPT, group_from

SETTINGS = {"t0.7-p0.9-k20": SamplingConfig(temperature=0.7, top_p=0.9, top_k=20),
            "t1.3-k5": SamplingConfig(temperature=1.3, top_k=5)}
LENGTH = 48
BAR = 0.05  # the bar on the mean numeric mismatch; measured: 0.011 and 0.006


def bf16():
    return preset_source("tiny", dtype="bfloat16", param_dtype="bfloat16")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(bf16(), config=InferenceConfig(max_n=8, max_tokens=LENGTH, max_prompt_tokens=64,
                                                 max_top_logprobs=20))


def samples(engine: Engine, s: SamplingConfig) -> list:
    """32 samples of up to 48 tokens: on CPU each setting has near-ties at the filter's edge.
    With the engine's top logprobs on, each also records its kept sets (filter replay)."""
    return [smp for seed in range(4) for smp in engine.generate(SamplingRequest(
        prompt=PROMPT, n=8, max_tokens=LENGTH, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        min_p=s.min_p, seed=seed, top_logprobs=min(s.top_k, engine.config.max_top_logprobs)))]


def trainer_view(engine: Engine, s: SamplingConfig, drawn: list,
                 replay: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(engine logprobs, trainer logprobs, outside) of every sampled token, one padded forward;
    `replay`: over the kept sets the engine recorded."""
    model = nnx.merge(engine.graphdef, engine.state)
    rows = [[*PROMPT, *d.token_ids] + [0] * (LENGTH - len(d.token_ids)) for d in drawn]
    seq = jnp.asarray(rows, jnp.int32)
    start = len(PROMPT) - 1
    targets = seq[:, 1:]
    if replay:
        kept = np.full((*targets.shape, s.top_k), NOT_KEPT, np.int32)
        for i, d in enumerate(drawn):
            kept[i, start:start + len(d.token_ids)] = kept_ids(d.top_ids, d.top_logprobs, s.top_k)
        targets = SampledTargets(targets, jnp.asarray(kept))
    (lp, outside), _, _ = forward_logprobs(model, seq[:, :-1], targets,
                                           logprob_fn=behaviour_logprob_fn(s, with_outside=True))
    pick = [(i, start + j) for i, d in enumerate(drawn) for j in range(len(d.token_ids))]
    rows_i, cols_j = (np.asarray(x) for x in zip(*pick, strict=True))
    engine_lp = np.concatenate([np.asarray(d.logprobs) for d in drawn])
    return engine_lp, np.asarray(lp)[rows_i, cols_j], np.asarray(outside)[rows_i, cols_j]


def test_the_trainer_scores_every_token_the_bf16_engine_sampled(engine: Engine) -> None:
    """Engine vs trainer on the sampled tokens: mean |difference| <= 0.05 at both settings, and
    no token at the floor, including the ones the trainer's own filter ranks outside."""
    outside_total = 0
    for name, s in SETTINGS.items():
        engine_lp, trainer_lp, outside = trainer_view(engine, s, samples(engine, s))
        diff = np.abs(trainer_lp - engine_lp)
        assert len(diff) > 500, name
        assert diff.mean() <= BAR, (name, diff.mean(), diff.max())
        assert diff.max() < 1.0 and trainer_lp.min() > -50, (name, diff.max(), trainer_lp.min())
        assert outside.mean() < 0.02, (name, outside.mean())
        outside_total += int(outside.sum())
    # Without a near-tie this test would not exercise the rule; CPU numerics give a dozen.
    assert outside_total > 0


def test_with_the_engines_kept_sets_no_bf16_token_is_outside_and_the_mismatch_is_numeric(engine: Engine) -> None:
    """The issue's bar: on the same near-ties the trainer's own filter ranks outside, scoring over
    the kept sets the engine recorded leaves 0 tokens outside, the mean mismatch <= 0.05."""
    for name, s in SETTINGS.items():
        drawn = samples(engine, s)
        _, _, own_outside = trainer_view(engine, s, drawn)
        engine_lp, trainer_lp, outside = trainer_view(engine, s, drawn, replay=True)
        assert not outside.any(), (name, int(outside.sum()))
        assert np.abs(trainer_lp - engine_lp).mean() <= BAR, name
        assert np.abs(trainer_lp - engine_lp).max() < 1.0, name
        if name == "t1.3-k5":  # the setting whose near-ties the own filter is known to miss on CPU
            assert own_outside.any()


def test_the_learner_splits_the_bf16_mismatch_from_the_tokens_outside(engine: Engine) -> None:
    """On-policy, bf16, temperature 1.3 / top_k 5: `logprob_mismatch` is the numeric part
    (<= 0.05, not floors), `logprob_outside` the fraction the trainer's filter left out, and
    the step is applied; in float32 both are ~0."""
    s = SETTINGS["t1.3-k5"]
    drawn = samples(engine, s)
    groups = [group_from(drawn[i:i + 8], lambda i: float(i % 2)) for i in range(0, len(drawn), 8)]
    m = Learner(bf16(), cfg=TrainerConfig(learning_rate=1e-2), sampling=s).step(build_batch(groups, 256, 256))
    assert not m.skipped and np.isfinite(m.loss)
    assert m.extra["logprob_mismatch"] <= BAR, m.extra
    assert 0 < m.extra["logprob_outside"] < 0.02, m.extra
    # The ratio is against the sampler's logprobs: its KL is the numeric mismatch's (1e-4), no
    # longer a floor's (the issue measured 90 to 234 through the services).
    assert m.approx_kl < 0.01, m.approx_kl


def test_float32_stays_exact() -> None:
    """The float32 bar: mean |difference| < 1e-5 and nothing outside, at both settings."""
    eng = Engine(preset_source("tiny"), config=InferenceConfig(max_n=8, max_tokens=LENGTH, max_prompt_tokens=64))
    for name, s in SETTINGS.items():
        engine_lp, trainer_lp, outside = trainer_view(eng, s, samples(eng, s)[:16])
        assert np.abs(trainer_lp - engine_lp).mean() < 1e-5, name
        assert not outside.any(), name


def test_the_mismatch_is_split_from_the_tokens_outside() -> None:
    """A floored behaviour logprob or a token outside the trainer's filter counts in
    `logprob_outside`, never in the numeric `logprob_mismatch`; padding counts in neither."""
    trainer = jnp.asarray([[-1.0, -2.0, -3.0, -4.0]])
    behaviour = jnp.asarray([[-1.1, LOGPROB_FLOOR, -3.0, -9.0]])
    mask = jnp.asarray([[1, 1, 1, 0]])
    m = mismatch_metrics(trainer, behaviour, mask, jnp.asarray([[False, False, True, False]]))
    assert float(m["logprob_mismatch"]) == pytest.approx(0.1, abs=1e-6)
    assert float(m["logprob_outside"]) == pytest.approx(2 / 3)


def test_several_updates_take_outside_at_the_batch_start() -> None:
    """With `old_outside_bt` (old_logprobs' with_outside), `logprob_outside` is the batch
    start's, as `logprob_mismatch` is, not the moving weights' of each update."""
    model = create_model(preset_source("tiny").cfg, 0)
    s = SETTINGS["t1.3-k5"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    mb = {"tokens_bt": tokens, "mask_bt": jnp.ones((2, 12)), "advantages_b": jnp.asarray([1.0, -1.0])}
    tc = TrainerConfig()
    lp, outside = old_logprobs(model, {**mb, "behaviour_logprobs_bt": jnp.zeros((2, 12))}, tc, s, with_outside=True)
    mb["behaviour_logprobs_bt"] = jnp.pad(lp, ((0, 0), (1, 0)))
    assert 0 < float(outside.mean()) < 1  # random tokens: many outside top_k 5
    _, own = rl_objective(model, mb, jnp.asarray(22.0), tc, sampling=s)
    _, given = rl_objective(model, {**mb, "old_logprobs_bt": lp, "old_outside_bt": jnp.zeros_like(outside)},
                            jnp.asarray(22.0), tc, sampling=s)
    assert float(own["logprob_outside"]) == pytest.approx(float(outside.mean()))
    assert float(given["logprob_outside"]) == 0.0 and float(given["logprob_mismatch"]) < 1e-6
