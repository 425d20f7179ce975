"""The routers' load-balancing loss in the trainer (`trainer.router_aux_loss_coef`) on a tiny
Qwen3-MoE written by transformers: RL and SFT steps report it and it trains the routers; a
model without routed experts refuses the setting, naming it."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from arlo.config import TrainerConfig
from arlo.model.source import preset_source, resolve_model
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from services.trainer.sft import SFTBatch
from tests.unit.test_trainer_learner import random_groups

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.hf_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def _routers(learner: Learner) -> list[np.ndarray]:
    return [np.asarray(layer["mlp"]["router_de"][...]) for layer in learner.state["layers"].values()]


def test_rl_and_sft_steps_report_and_train_on_the_aux_loss(moe_dir: Path) -> None:
    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=256)
    assert source.cfg.moe is not None
    batch = build_batch(random_groups(2, 4), 256, 256)
    routers = {}
    for coef in (0.0, 1.0):
        learner = Learner(source, cfg=TrainerConfig(learning_rate=1e-2, router_aux_loss_coef=coef))
        m = learner.step(batch)
        assert not m.skipped and np.isfinite(m.loss)
        assert ("router_aux_loss" in m.extra) == bool(coef)
        routers[coef] = _routers(learner)
    # Balanced routing gives top_k (2); a random router is close to it, never below 1.
    assert 1.0 < m.extra["router_aux_loss"] < 8.0
    assert max(float(np.abs(a - b).max()) for a, b in zip(routers[0.0], routers[1.0], strict=True)) > 1e-6
    tokens = np.asarray(batch.tokens_bt[:4, :32], np.int32)
    sft = SFTBatch(tokens_bt=tokens, mask_bt=np.ones(tokens.shape, np.float32), num_tokens=int(tokens.size))
    m = learner.sft_step(sft)
    assert np.isfinite(m.extra["router_aux_loss"]) and np.isfinite(m.loss)
    assert jax.tree.leaves(learner.state)  # still a model


def test_a_dense_model_refuses_the_setting() -> None:
    with pytest.raises(ValueError, match="trainer.router_aux_loss_coef"):
        Learner(preset_source("tiny"), cfg=TrainerConfig(router_aux_loss_coef=0.001))


def test_the_engine_serves_the_models_greedy_tokens(moe_dir: Path) -> None:
    """The inference engine (chunked buffered decode, continuous batching) serves a Qwen3-MoE
    checkpoint with transformers' own greedy tokens."""
    import torch
    import transformers

    from arlo.config import InferenceConfig
    from services.inference.engine import Engine, SamplingRequest

    source = resolve_model(name="tiny", path=str(moe_dir), tokenizer="", seed=0, max_seq_len=64)
    prompts = [(5, 17, 42, 99, 7), tuple(range(30, 52))]
    engine = Engine(source, config=InferenceConfig(max_n=1, max_tokens=12, max_prompt_tokens=32, max_batch=4,
                                                   max_seq_len=64, decode_steps=4))
    try:
        served = [h.result(300)[0].token_ids for h in engine.submit_many(
            [SamplingRequest(prompt=p, n=1, max_tokens=12, temperature=0.0, ignore_eos=True) for p in prompts])]
    finally:
        engine.close()
    # Each served token is transformers' argmax after the prompt and the tokens served before it
    # (not `generate`, whose min_new_tokens masks the eos ids the engine, told ignore_eos, may pick).
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, attn_implementation="eager").eval()
    for prompt, tokens in zip(prompts, served, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1: -1]
        assert list(tokens) == logits.argmax(-1).tolist()


def test_lora_on_routed_experts_is_refused_naming_the_targets(moe_dir: Path) -> None:
    from arlo.config import ConfigError, RunConfig, from_dict

    with pytest.raises(ConfigError, match="trainer.lora.targets"):
        from_dict(RunConfig, {"model": {"path": str(moe_dir)}, "trainer": {"lora": {"rank": 4}}}).validate()
    from_dict(RunConfig, {"model": {"path": str(moe_dir)},
                          "trainer": {"lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}}}).validate()
