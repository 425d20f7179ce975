"""LoRA (issue 35): adapters on a frozen base, trained alone, published alone, served unmerged.

The engine under test is the real inference engine; the payload goes through the same bytes a
publish carries (`state_to_bytes` -> `state_from_bytes` shaped like the engine's published state).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import InferenceConfig, RunConfig, SamplingConfig, TrainerConfig, from_dict
from arlo.config.base import ConfigError
from arlo.config.trainer import LoraConfig, lora_rate_warning
from arlo.model import ModelConfig, abstract_model, create_model, lora, state_from_bytes, state_to_bytes
from arlo.model.config import LORA_TARGETS, LoraShape
from arlo.model.quantize import NF4_LEVELS, quantize, stored_bytes
from services.inference.engine import Engine, SamplingRequest
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from tests.unit.test_trainer_behaviour_logprobs import PROMPT, group_from
from tests.unit.test_trainer_learner import random_groups

TOKENS = jnp.asarray([[*PROMPT, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]], jnp.int32)


def lora_cfg(rank: int = 4, targets: tuple[str, ...] = LORA_TARGETS) -> ModelConfig:
    return dataclasses.replace(ModelConfig.named("tiny"), lora=LoraShape(rank=rank, alpha=2.0 * rank, targets=targets))


def perturbed_adapters(model_cfg: ModelConfig, seed: int = 3) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    graphdef, state = nnx.split(create_model(model_cfg, 0))
    adapters, base = lora.split_adapters(state)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)
    return graphdef, adapters, base


def test_a_fresh_adapter_changes_nothing_and_the_base_is_the_presets_own() -> None:
    """B starts at zero and A draws from its own random stream: with LoRA a preset's base weights
    are bit for bit the ones it has without, and so are its logits."""
    plain, with_lora = create_model(ModelConfig.named("tiny"), 0), create_model(lora_cfg(), 0)
    adapters, base = lora.split_adapters(nnx.state(with_lora))
    assert sum(x.size for x in jax.tree.leaves(adapters)) == lora.adapter_count(lora_cfg())
    for a, b in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(plain(TOKENS)), np.asarray(with_lora(TOKENS)))


@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_unmerged_adapters_compute_what_the_merged_weights_do(targets: tuple[str, ...]) -> None:
    """x@W + scale*(x@A)@B (what trainer and engine run) equals x@(W + scale*A@B) (what export writes)."""
    cfg = lora_cfg(targets=targets)
    graphdef, adapters, base = perturbed_adapters(cfg)
    unmerged = nnx.merge(graphdef, base, adapters)
    merged_state = lora.merged_weights(lora.merge_states(base, adapters), cfg)
    merged = nnx.merge(nnx.split(create_model(ModelConfig.named("tiny"), 0))[0], merged_state)
    np.testing.assert_allclose(np.asarray(unmerged(TOKENS)), np.asarray(merged(TOKENS)), atol=2e-5)
    assert np.abs(np.asarray(unmerged(TOKENS)) - np.asarray(create_model(cfg, 0)(TOKENS))).max() > 1e-3


def test_the_learner_trains_the_adapters_alone() -> None:
    """The base is frozen (held in param_dtype, never updated, no optimizer state); AdamW's
    moments and every publish cover the adapters alone."""
    tc = TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=4))
    source = RunConfig(trainer=tc).model_source()
    learner = Learner(source, cfg=tc)
    base_before = jax.tree.map(np.asarray, learner.frozen)
    adapter_count = lora.adapter_count(source.cfg)
    assert sum(x.size for x in jax.tree.leaves(learner.state)) == adapter_count
    moments = [x for x in jax.tree.leaves(learner.opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size for x in moments) == 2 * adapter_count  # Adam's mu and nu, adapters only
    batch = build_batch(random_groups(2, 4), 256, 256)
    for _ in range(2):
        m = learner.step(batch)
        assert not m.skipped and np.isfinite(m.loss)
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(learner.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    published = learner.serving_state()
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(published))
    assert max(float(np.abs(np.asarray(v.get_value())).max()) for p, v in nnx.to_flat_state(published)
               if p[-1] == "b") > 0  # B moved off zero


def test_the_engine_serves_published_adapters_unmerged_with_the_trainers_logprobs() -> None:
    """The issue's `lora_logprob_mismatch` bar: an adapter-only publish installed in the real
    engine (over its own base), sampled there, scored by the trainer on the same weights:
    mean |difference| < 1e-5 in float32."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    tc = TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=4))
    source = RunConfig(trainer=tc).model_source()
    learner = Learner(source, cfg=tc, sampling=sampling)
    for _ in range(2):
        learner.step(build_batch(random_groups(2, 4), 256, 256))
    engine = Engine(source, config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64))
    payload = state_to_bytes(learner.serving_state())
    full = state_to_bytes(learner.policy_state())
    assert len(payload) < 0.2 * len(full)  # the base (its embedding above all) stays home
    engine.swap(state_from_bytes(payload, engine.published_state), 1)
    samples = engine.generate(SamplingRequest(prompt=PROMPT, n=8, max_tokens=24, temperature=0.8, top_p=0.95,
                                              seed=5))
    batch = build_batch([group_from(samples, lambda i: float(i % 2))], 256, 256)
    m = learner.step(batch)
    assert m.extra["logprob_mismatch"] < 1e-5, m.extra["logprob_mismatch"]
    with pytest.raises(ValueError, match="not newer"):
        engine.swap(state_from_bytes(payload, engine.published_state), 1)


@pytest.mark.parametrize(("trainer", "field", "says"), [
    ({"lora": {"rank": 4, "targets": ["c_attn"]}}, "trainer.lora.targets", "c_attn"),
    ({"lora": {"rank": 32}}, "trainer.lora.rank", "k_proj's narrower side"),
    ({"lora": {"rank": 4, "dropout": 0.1}}, "trainer.lora.dropout", "sampler"),
    ({"lora": {"rank": 4, "init": "pissa"}}, "trainer.lora.init", "adapter-only publish"),
    ({"lora": {"rank": 4}, "algorithm": {"advantage": "gae"}}, "trainer.lora.rank", "critic"),
])
def test_bad_lora_settings_are_config_errors_naming_the_field(trainer: dict, field: str, says: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        from_dict(RunConfig, {"trainer": trainer}).validate()
    assert says in str(info.value)


def test_a_lora_run_left_at_the_full_fine_tuning_rate_is_warned() -> None:
    assert "10x" in (lora_rate_warning(TrainerConfig(lora=LoraConfig(rank=8))) or "")
    assert lora_rate_warning(TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=8))) is None
    assert lora_rate_warning(TrainerConfig()) is None


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantised_blocks_round_trip_within_their_step(kind: str) -> None:
    """Each element comes back within half a quantisation step of its block (int8: absmax / 127;
    nf4: half the widest gap between NormalFloat levels times absmax), a zero block stays zero,
    and the codes take 1 or 1/2 byte per element."""
    x = jax.random.normal(jax.random.key(0), (6, 4, 128), jnp.float32).at[0, 0].set(0.0)
    q = quantize(x, kind, 64)
    back = np.asarray(q.dequantize())
    absmax = np.abs(np.asarray(x)).reshape(6, 4, 2, 64).max(-1, keepdims=True)
    step = absmax / 127 / 2 if kind == "int8" else absmax * np.diff(NF4_LEVELS).max() / 2
    err = np.abs(back - np.asarray(x)).reshape(6, 4, 2, 64)
    assert (err <= step + 1e-6).all()
    np.testing.assert_array_equal(back[0, 0], 0.0)
    assert q.shape == x.shape and q.codes.nbytes == x.size // (1 if kind == "int8" else 2)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_qlora_trainer_and_engine_compute_one_function_on_a_quantised_base(kind: str) -> None:
    """QLoRA: the learner keeps its base quantised (fewer bytes than param_dtype), trains the
    adapters on it, and the engine, quantising its own base the same way, serves the published
    adapters with the trainer's logprobs (mean |difference| < 1e-5, float32)."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    tc = TrainerConfig(learning_rate=1e-2, remat="full", lora=LoraConfig(rank=4, quantize=kind, quant_block=16))
    source = RunConfig(trainer=tc).model_source()
    learner = Learner(source, cfg=tc, sampling=sampling)
    plain = lora.split_adapters(source.initial_state())[1]
    assert stored_bytes(learner.frozen) < 0.6 * stored_bytes(plain)
    learner.step(build_batch(random_groups(2, 4), 256, 256))
    engine = Engine(source, config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64))
    engine.swap(state_from_bytes(state_to_bytes(learner.serving_state()), engine.published_state), 1)
    samples = engine.generate(SamplingRequest(prompt=PROMPT, n=8, max_tokens=24, temperature=0.8, top_p=0.95,
                                              seed=5))
    m = learner.step(build_batch([group_from(samples, lambda i: float(i % 2))], 256, 256))
    assert m.extra["logprob_mismatch"] < 1e-5, m.extra["logprob_mismatch"]
    assert not m.skipped and np.isfinite(m.loss)


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state(tmp_path) -> None:
    """Orbax saves what the learner trains (adapters, float32, and AdamW's adapter-sized moments);
    a fresh LoRA learner restored from it takes the same next step as the one that saved it."""
    from services.trainer.checkpoint import Checkpointer, CheckpointMeta

    tc = TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=4))
    source = RunConfig(trainer=tc).model_source()
    batch = build_batch(random_groups(2, 4), 256, 256)
    saved = Learner(source, cfg=tc)
    saved.step(batch)
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.start_save(saved.state, saved.opt_state, CheckpointMeta(version=1, step=saved.step_count,
                                                                        params_sha256=""))
    checkpointer.wait()
    fresh = Learner(source, cfg=tc)
    restored = checkpointer.restore_newest(fresh.state, fresh.opt_state)
    checkpointer.close()
    assert restored is not None and not restored.skipped
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(restored.params))
    fresh.restore(restored.params, restored.opt_state, restored.meta.step)
    a, b = saved.step(batch), fresh.step(batch)
    assert a.loss == pytest.approx(b.loss, abs=1e-7) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)


def test_stacked_adapters_give_each_row_its_own_adapter() -> None:
    """Several adapters in one model (`LoraShape.slots`), each batch row naming its own: every row's
    logits are the ones a model holding that row's adapter alone computes (the engine's path to
    serving several runs over one base)."""
    one, slots = lora_cfg(), 3
    many = dataclasses.replace(one, lora=dataclasses.replace(one.lora, slots=slots))
    graphdef, first, base = perturbed_adapters(one, seed=10)
    sets = [first, *(perturbed_adapters(one, seed=11 + k)[1] for k in range(slots - 1))]
    stacked = lora.stacked(sets[0], slots)
    for k in range(1, slots):
        stacked = lora.with_slot(stacked, k, sets[k])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(lora.slot_of(stacked, 2)), jax.tree.leaves(sets[2]), strict=True))
    graphdef_many, abstract = nnx.split(abstract_model(many))
    rows_b = jnp.asarray([2, 0, 1, 2], jnp.int32)
    rows = [(p, v.copy(rows_b)) for p, v in nnx.to_flat_state(abstract) if isinstance(v, lora.AdapterRows)]
    model = nnx.merge(graphdef_many, lora.merge_states(base, stacked, nnx.from_flat_state(rows)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 250, (4, 20)), jnp.int32)
    got = np.asarray(model(tokens))
    for i, k in enumerate(rows_b.tolist()):
        want = np.asarray(nnx.merge(graphdef, base, sets[k])(tokens[i: i + 1]))[0]
        np.testing.assert_allclose(got[i], want, atol=2e-5)
    assert np.abs(got[1] - got[2]).max() > 1e-3  # rows 1 and 2 used different adapters
    with_rows = lora.with_rows(lora.merge_states(base, stacked, nnx.from_flat_state(rows)), jnp.zeros(4, jnp.int32))
    np.testing.assert_allclose(np.asarray(nnx.merge(graphdef_many, with_rows)(tokens))[1], got[1], atol=2e-5)


# Slow tier (~80 s under load). The default tier covers it: two runs' adapter slots on one engine, each
# request sampled by its own and reporting its own version (tests/contract/test_inference_runs.py), each
# row of a batch on its own adapter (test_stacked_adapters_give_each_row_its_own_adapter) and the engine's
# logprobs equal to the trainer's (test_the_engine_serves_published_adapters_unmerged_with_the_trainers_logprobs).
@pytest.mark.slow
def test_one_engine_serves_two_runs_adapters_in_one_batch_each_with_its_own_version() -> None:
    """Issue 35, item 2: the engine holds two adapters over one base, a request names its slot;
    requests of both run in the same batches, each gets the logprobs its own trainer computes
    (mean |difference| < 1e-5), each slot's publish bumps only its own version, and a request
    naming a slot the engine does not hold is refused."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    learners = []
    for lr in (1e-2, 3e-2):
        tc = TrainerConfig(learning_rate=lr, lora=LoraConfig(rank=4))
        learner = Learner(RunConfig(trainer=tc).model_source(), cfg=tc, sampling=sampling)
        learner.step(build_batch(random_groups(2, 4), 256, 256))
        learners.append(learner)
    source = RunConfig(trainer=TrainerConfig(lora=LoraConfig(rank=4))).model_source()
    engine = Engine(source, config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64), adapters=2)
    engine.swap(state_from_bytes(state_to_bytes(learners[1].serving_state()), engine.published_state_of(1)), 3,
                adapter=1)
    assert engine.versions == (0, 3)
    engine.swap(state_from_bytes(state_to_bytes(learners[0].serving_state()), engine.published_state_of(0)), 1,
                adapter=0)
    assert engine.versions == (1, 3)
    handles = engine.submit_many([
        SamplingRequest(prompt=PROMPT, n=8, max_tokens=24, temperature=0.8, top_p=0.95, seed=5, adapter=slot)
        for slot in (0, 1)])
    results = [h.result(timeout=240) for h in handles]
    assert engine.stats.largest_batch == 16  # both runs' samples decoded together
    assert [s.token_ids for s in results[0]] != [s.token_ids for s in results[1]]  # same seed, other adapter
    for slot, learner in enumerate(learners):
        samples = results[slot]
        assert all(v == engine.versions[slot] for s in samples for v in s.policy_versions)
        m = learner.step(build_batch([group_from(samples, lambda i: float(i % 2))], 256, 256))
        assert m.extra["logprob_mismatch"] < 1e-5, (slot, m.extra["logprob_mismatch"])
    with pytest.raises(ValueError, match="adapter slot"):
        engine.validate(SamplingRequest(prompt=PROMPT, adapter=2))
    engine.close()
