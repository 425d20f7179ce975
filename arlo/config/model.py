"""`model`: the policy every service builds (a preset or a Hugging Face checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arlo.choices import Dtype, ToolFormat
from arlo.config.base import ConfigError, _frozen, check_ranges, ranged


@_frozen
class ModelSpec:
    """The policy: a named preset (random init from `seed`) or a local Hugging Face checkpoint."""

    name: str = "tiny"
    """Preset name (tiny, demo, small, or a bench/grpo_tiny.py shape: qwen3-76k, qwen3-596k, qwen2-4m; see
    arlo.model.config), used when `path` is empty."""
    path: str = ""
    """A local Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
    tokenizer_config.json with a chat_template); wins over `name`, and its weights are version 0."""
    tokenizer: str = "byte"
    """Tokenizer of a preset ("byte") or a Hugging Face directory holding tokenizer.json; with
    `path` set, "byte" (the default) means the checkpoint's own tokenizer."""
    seed: int = ranged(0, ge=0, le=2**32 - 1)
    """Seed of a preset's initial weights (trainer and a cold inference server agree on it); JAX
    keeps 32 bits of it, so a larger one would silently repeat a smaller one's weights."""
    dtype: Dtype = "float32"
    """Compute dtype of the forward pass (matmuls); norms and softmax run in float32."""
    param_dtype: Dtype = "float32"
    """Dtype of the stored parameters that inference serves and every publish carries
    (bfloat16 halves the bytes); the trainer keeps a float32 master copy either way."""
    max_seq_len: int = ranged(0, ge=0)
    """Longest sequence (prompt + generated); 0 = the preset's or the checkpoint's
    max_position_embeddings (often far more than a run needs: cap it). A preset's is set by it,
    raised too (a random init with RoPE positions: the `small` preset at 16,384 for long
    episodes); a checkpoint's is only capped, never raised past its max_position_embeddings."""
    tool_format: ToolFormat = "auto"
    """How the model writes tool calls, read by the env gateway and the OpenAI endpoint's replies:
    hermes (`<tool_call>{json}</tool_call>`: Qwen2.5/3), llama3 (a whole-message JSON call),
    qwen3_coder (`<tool_call><function=NAME><parameter=KEY>`), mistral (`[TOOL_CALLS]`), gemma
    (`<|tool_call>call:NAME{...}`, FunctionGemma's `<start_function_call>` alike); "auto" reads any
    of them by its markers. A chosen format reads only its own markup."""

    def validate(self, path: str) -> None:
        check_ranges(self, path)
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

    def source(self, lora: Any = None) -> Any:
        """The arlo.model.source ModelSource every service builds its model and tokenizer from.
        `lora`: the run's `trainer.lora` (LoraConfig); with rank > 0 the decoder carries adapters.
        Services call `RunConfig.model_source()`, which passes it."""
        from arlo.model.source import resolve_model

        shape = None
        if lora is not None and lora.rank:
            from arlo.model.config import LoraShape

            shape = LoraShape(rank=lora.rank, alpha=lora.effective_alpha, targets=tuple(lora.targets),
                              rslora=lora.rslora, init=lora.init, quantize=lora.quantize,
                              quant_block=lora.quant_block, train_norms=lora.train_norms)
        return resolve_model(name=self.name, path=self.path, tokenizer=self.tokenizer, seed=self.seed,
                             dtype=self.dtype, param_dtype=self.param_dtype, max_seq_len=self.max_seq_len,
                             lora=shape)
