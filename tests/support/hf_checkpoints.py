"""Tiny real-format Hugging Face checkpoints for tests: the writer lives in
arlo/model/tiny_checkpoints.py, where examples/own_format/make_checkpoint.py uses it too."""

from arlo.model.tiny_checkpoints import FAMILIES, train_tokenizer, write_checkpoint, write_tokenizer

__all__ = ["FAMILIES", "train_tokenizer", "write_checkpoint", "write_tokenizer"]
