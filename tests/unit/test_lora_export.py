"""LoRA out of arlo (issue 35, item 4): the merged export and the PEFT adapter directory, each
loaded by the libraries users load them with (transformers; transformers + peft on the base
checkpoint), give arlo's logits within 1e-4 in float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import RunConfig, from_dict
from arlo.model import lora
from arlo.model.export import export_hf
from arlo.model.lora_export import export_peft_adapter
from arlo.model.transformer import abstract_model
from tests.support.hf_checkpoints import write_checkpoint

_SKIP = "LoRA export reference tests need the [hf,ref] extras (torch, transformers, peft)"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)
peft = pytest.importorskip("peft", reason=_SKIP)

TOKENS = [5, 17, 33, 2, 90, 41, 7, 64, 12, 3, 150, 77]


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("llama3", ["q_proj", "v_proj", "down_proj"]),
])
def test_merged_and_peft_exports_give_arlos_logits(tmp_path: Path, family: str, targets: list[str]) -> None:
    base_dir = write_checkpoint(tmp_path / "base", family, hidden=64)
    cfg = from_dict(RunConfig, {"model": {"path": str(base_dir)},
                                "trainer": {"learning_rate": 1e-2, "lora": {"rank": 4, "alpha": 16,
                                                                             "targets": targets}}})
    cfg.validate()
    source = cfg.model_source()
    adapters, base = lora.split_adapters(source.initial_state())
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)  # trained-like
    graphdef = nnx.split(abstract_model(source.cfg))[0]
    ours = np.asarray(nnx.merge(graphdef, base, adapters)(jnp.asarray([TOKENS], jnp.int32)))[0]

    merged_dir = tmp_path / "merged"
    merged = lora.merged_weights(lora.merge_states(base, adapters), source.cfg)
    export_hf(merged, dataclasses.replace(source.cfg, lora=None), merged_dir, tokenizer=source.tokenizer(),
              tokenizer_dir=source.tokenizer_dir, base_config=source.base_config())
    adapter_dir = export_peft_adapter(adapters, source.cfg, tmp_path / "adapter", base_model=str(base_dir))

    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_merged(ids).logits[0].numpy(), ours, atol=1e-4)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        plain = hf_base(ids).logits[0].numpy()
        with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter_dir).eval()
        np.testing.assert_allclose(with_adapter(ids).logits[0].numpy(), ours, atol=1e-4)
    assert np.abs(plain - ours).max() > 1e-3  # the adapters changed the function: the test can fail


def test_a_full_fine_tuning_run_has_no_adapter_to_export(tmp_path: Path) -> None:
    source = RunConfig().model_source()
    with pytest.raises(ValueError, match="trains no adapters"):
        export_peft_adapter(source.initial_state(), source.cfg, tmp_path / "a")
