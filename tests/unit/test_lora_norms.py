"""`trainer.lora.train_norms` (issue 35's learning bar): every RMSNorm scale trained in full beside
the adapters (PEFT's `modules_to_save`), published and served with them, checkpointed with them,
and written into the merged export in place of the base's norms."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import InferenceConfig, RunConfig, SamplingConfig, TrainerConfig, from_dict
from arlo.config.trainer import LoraConfig
from arlo.model import create_model, lora, state_from_bytes, state_to_bytes
from arlo.model.lora_export import export_peft_adapter
from services.inference.engine import Engine, SamplingRequest
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from tests.unit.test_lora import TOKENS, lora_cfg
from tests.unit.test_trainer_behaviour_logprobs import PROMPT, group_from
from tests.unit.test_trainer_learner import random_groups


def _norms(state: nnx.State) -> dict[tuple, np.ndarray]:
    return {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)
            if isinstance(v, lora.TrainedNorm)}


def _learner(**kw) -> tuple[Learner, object]:
    tc = TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=4, train_norms=True))
    source = RunConfig(trainer=tc).model_source()
    return Learner(source, cfg=tc, **kw), source


def test_off_keeps_the_norms_in_the_frozen_base() -> None:
    state = nnx.state(create_model(lora_cfg(), 0))
    assert not _norms(state)
    assert not any(str(p[-1]) == "scale" for p, _ in nnx.to_flat_state(lora.split_adapters(state)[0]))


def test_the_norms_train_beside_the_adapters_and_the_base_stays() -> None:
    learner, source = _learner()
    cfg = source.cfg
    norms = _norms(learner.state)
    # every layer's attn and mlp norm, and the final norm; none left in the frozen base
    assert len(norms) == 2 * cfg.num_layers + 1 + (2 * cfg.num_layers if cfg.qk_norm else 0)
    assert not any(str(p[-1]) == "scale" for p, _ in nnx.to_flat_state(learner.frozen))
    assert sum(x.size for x in jax.tree.leaves(learner.state)) == lora.adapter_count(cfg)
    base_before = jax.tree.map(np.asarray, learner.frozen)
    for _ in range(2):
        m = learner.step(build_batch(random_groups(2, 4), 256, 256))
        assert not m.skipped and np.isfinite(m.loss)
    after = _norms(learner.state)
    assert all(np.abs(after[k] - norms[k]).max() > 0 for k in norms)  # every norm moved
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(learner.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert _norms(learner.serving_state()).keys() == norms.keys()  # published with the adapters


def test_the_engine_serves_the_published_norms_with_the_trainers_logprobs() -> None:
    learner, source = _learner(sampling=SamplingConfig(temperature=0.8, top_p=0.95))
    for _ in range(2):
        learner.step(build_batch(random_groups(2, 4), 256, 256))
    engine = Engine(source, config=InferenceConfig(max_n=8, max_tokens=32, max_prompt_tokens=64))
    published = state_from_bytes(state_to_bytes(learner.serving_state()), engine.published_state)
    assert _norms(published)
    engine.swap(published, 1)
    served = _norms(engine._policy.state)  # the engine's frozen base took the published norms
    for k, v in _norms(learner.serving_state()).items():
        np.testing.assert_array_equal(served[k], v.astype(served[k].dtype))
    samples = engine.generate(SamplingRequest(prompt=PROMPT, n=8, max_tokens=24, temperature=0.8, top_p=0.95,
                                              seed=5))
    m = learner.step(build_batch([group_from(samples, lambda i: float(i % 2))], 256, 256))
    assert m.extra["logprob_mismatch"] < 1e-5, m.extra["logprob_mismatch"]


def test_an_engine_serving_several_adapters_refuses_trained_norms() -> None:
    tc = TrainerConfig(learning_rate=1e-2, lora=LoraConfig(rank=4, train_norms=True))
    with pytest.raises(ValueError, match="train_norms"):
        Engine(RunConfig(trainer=tc).model_source(), adapters=2)


def test_a_checkpoint_holds_the_trained_norms(tmp_path: Path) -> None:
    from services.trainer.checkpoint import Checkpointer, CheckpointMeta

    saved, _ = _learner()
    batch = build_batch(random_groups(2, 4), 256, 256)
    saved.step(batch)
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.start_save(saved.state, saved.opt_state, CheckpointMeta(version=1, step=saved.step_count,
                                                                        params_sha256=""))
    checkpointer.wait()
    fresh, _ = _learner()
    restored = checkpointer.restore_newest(fresh.state, fresh.opt_state)
    checkpointer.close()
    assert restored is not None
    want = _norms(saved.state)
    got = _norms(restored.params)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    fresh.restore(restored.params, restored.opt_state, restored.meta.step)
    a, b = saved.step(batch), fresh.step(batch)
    assert a.loss == pytest.approx(b.loss, abs=1e-7)


def test_the_merged_export_writes_the_trained_norms(tmp_path: Path) -> None:
    """The merged state (arlo's own forward over it, without LoRA) gives the trainer's policy
    logits; and with transformers installed, so does the exported Hugging Face directory. A PEFT
    adapter export is refused naming the field."""
    learner, source = _learner()
    learner.step(build_batch(random_groups(2, 4), 256, 256))
    policy = learner.policy_state()
    graphdef = nnx.split(create_model(source.cfg, 0))[0]
    ours = np.asarray(nnx.merge(graphdef, policy)(TOKENS))
    merged = lora.merged_weights(policy, source.cfg)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(merged))
    plain_cfg = dataclasses.replace(source.cfg, lora=None)
    plain = nnx.merge(nnx.split(create_model(plain_cfg, 0))[0], merged)
    np.testing.assert_allclose(np.asarray(plain(TOKENS)), ours, atol=2e-5)
    base_norms = nnx.merge(nnx.split(create_model(plain_cfg, 0))[0], lora.merged_weights(
        lora.merge_states(learner.frozen, _initial_adapters(source)), source.cfg))
    assert np.abs(np.asarray(base_norms(TOKENS)) - ours).max() > 1e-4  # the step moved the function: the check can fail
    with pytest.raises(ValueError, match="trainer.lora.train_norms"):
        export_peft_adapter(learner.serving_state(), source.cfg, tmp_path / "adapter")


def _initial_adapters(source) -> nnx.State:
    return lora.split_adapters(source.initial_state())[0]


def test_the_merged_hf_export_gives_the_trainers_logits(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from arlo.model.export import export_hf
    from arlo.model.transformer import abstract_model
    from tests.support.hf_checkpoints import write_checkpoint
    from tests.unit.test_lora_export import TOKENS as HF_TOKENS

    base_dir = write_checkpoint(tmp_path / "base", "qwen2", hidden=64)
    cfg = from_dict(RunConfig, {"model": {"path": str(base_dir)},
                                "trainer": {"learning_rate": 1e-2, "lora": {"rank": 4, "train_norms": True}}})
    cfg.validate()
    source = cfg.model_source()
    adapters, base = lora.split_adapters(source.initial_state())
    assert _norms(adapters)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)  # trained-like
    graphdef = nnx.split(abstract_model(source.cfg))[0]
    ours = np.asarray(nnx.merge(graphdef, base, adapters)(jnp.asarray([HF_TOKENS], jnp.int32)))[0]
    merged = lora.merged_weights(lora.merge_states(base, adapters), source.cfg)
    export_hf(merged, dataclasses.replace(source.cfg, lora=None), tmp_path / "merged", tokenizer=source.tokenizer(),
              tokenizer_dir=source.tokenizer_dir, base_config=source.base_config())
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        np.testing.assert_allclose(hf(torch.tensor([HF_TOKENS])).logits[0].numpy(), ours, atol=1e-4)
