"""Tiny real-format Hugging Face checkpoints written by `transformers` itself (random weights,
the families' real config classes, safetensors single or sharded), with a BPE tokenizer trained
here by `tokenizers` (a Qwen-style pre-tokenizer, so transformers' own tokenizer classes give
the file's ids) and the family's real chat template (arlo/model/family_templates.py). No hub:
everything is made on disk. Tests write their checkpoints with it (tests/support/hf_checkpoints.py),
and examples/own_format/make_checkpoint.py the one its demo learns in."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from arlo.model.family_templates import GEMMA2, GEMMA3, LLAMA31, QWEN25

# Qwen2's split: single digits, letters with one leading non-letter, punctuation runs, spaces.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_CORPUS = [
    "What is 12*7? Use the calculator tool if you need it.", "The answer is 84.", "calc 12*7", "84",
    '{"name": "calculator", "arguments": {"expression": "12*7"}}', "You are a helpful assistant.",
    "Given the following functions, please respond with a JSON for a function call",
    "<tool_call>\n</tool_call>\n<tool_response>\n</tool_response>", "Cutting Knowledge Date: December 2023",
    "Today Date: 26 Jul 2024", "Environment: ipython", "parameters", "description", "properties", "type",
    "string", "object", "required", "function", "expression", "Evaluate an arithmetic expression.",
] * 4

_GEMMA_TOKENS: dict[str, Any] = dict(
    tokenizer_class="PreTrainedTokenizerFast", specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
    added=[], bos="<bos>", eos="<end_of_turn>", pad="<pad>", extra_eos=["<eos>"])

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": dict(config_class="Qwen2Config", template=QWEN25, tokenizer_class="Qwen2Tokenizer",
                  specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<tool_call>", "</tool_call>"],
                  bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra_eos=["<|endoftext|>"],
                  config=dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": dict(config_class="Qwen3Config", template=QWEN25, tokenizer_class="Qwen2Tokenizer",
                  specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<tool_call>", "</tool_call>"],
                  bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra_eos=["<|endoftext|>"],
                  config=dict(tie_word_embeddings=True, head_dim=16, rope_theta=1e6)),
    # Qwen3-MoE: 8 experts, top-2, renormalised (Qwen3-30B-A3B's norm_topk_prob), Qwen's chat template.
    "qwen3_moe": dict(config_class="Qwen3MoeConfig", template=QWEN25, tokenizer_class="Qwen2Tokenizer",
                      specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<tool_call>", "</tool_call>"],
                      bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra_eos=["<|endoftext|>"],
                      config=dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e6, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)),
    "llama3": dict(config_class="LlamaConfig", template=LLAMA31, tokenizer_class="PreTrainedTokenizerFast",
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], added=[],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>",
                   extra_eos=["<|end_of_text|>", "<|eom_id|>"],
                   config=dict(tie_word_embeddings=False, rope_theta=500000.0)),
    # Gemma: layer 0 slides over 8 positions, layer 1 is full (Gemma 3's sliding_window_pattern 2
    # instead of 6, so 2 layers have both kinds); query_pre_attn_scalar differs from head_dim.
    "gemma2": dict(config_class="Gemma2Config", template=GEMMA2, **_GEMMA_TOKENS,
                   config=dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8)),
    "gemma3": dict(config_class="Gemma3TextConfig", template=GEMMA3, **_GEMMA_TOKENS,
                   config=dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2)),
}


def train_tokenizer(specials: list[str], added: list[str], vocab_size: int = 400,
                    corpus: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer with Qwen2's pre-tokenizer, trained on `corpus` (by default a
    few lines of the calculator task and the Qwen2.5 tools prompt)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS if corpus is None else corpus, trainer)
    if added:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def write_checkpoint(path: Path, family: str, *, layers: int = 2, hidden: int = 32, seed: int = 0,
                     max_shard_size: str | None = None, dtype: str = "float32", intermediate: int = 0,
                     heads: int = 4, kv_heads: int = 2, max_positions: int = 512, init_range: float = 0.2,
                     vocab_size: int = 400, corpus: Iterable[str] | None = None,
                     config: dict[str, Any] | None = None) -> Path:
    """A `family` (a FAMILIES key) checkpoint at `path`, written by transformers: random weights
    (normal with std `init_range`), `intermediate` MLP width (0: 2 x hidden), the tokenizer of
    `write_tokenizer`; `config` overrides the family's config fields (rope_theta, ...). Needs torch and transformers (the hf extra)."""
    import torch
    import transformers

    spec = FAMILIES[family]
    tok, ids = write_tokenizer(path, family, vocab_size=vocab_size, corpus=corpus)
    vocab = -(-tok.get_vocab_size() // 8) * 8
    eos_ids = [ids[spec["eos"]], *(ids[t] for t in spec["extra_eos"])]
    torch.manual_seed(seed)
    config = getattr(transformers, spec["config_class"])(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, initializer_range=init_range, bos_token_id=ids.get(spec["bos"]) if spec["bos"] else None,
        eos_token_id=eos_ids[0], pad_token_id=ids[spec["pad"]], **{**spec["config"], **(config or {})})
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = eos_ids
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def write_tokenizer(path: Path, family: str, *, vocab_size: int = 400,
                    corpus: Iterable[str] | None = None) -> tuple[Tokenizer, dict[str, int]]:
    """The family's tokenizer files alone (tokenizer.json, tokenizer_config.json with its chat
    template) at `path`: what tests of chat formats need, without a model. Returns the
    tokenizer and the ids of its special and added tokens."""
    spec = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec["specials"], spec["added"], vocab_size, corpus)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in [*spec["specials"], *spec["added"]]}
    tokenizer_config = {
        "tokenizer_class": spec["tokenizer_class"], "chat_template": spec["template"],
        "eos_token": spec["eos"], "pad_token": spec["pad"], "bos_token": spec["bos"],
        "model_max_length": 512, "clean_up_tokenization_spaces": False, "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": t in spec["specials"], "normalized": False, "lstrip": False,
                     "rstrip": False, "single_word": False} for t, i in ids.items()},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tok, ids
