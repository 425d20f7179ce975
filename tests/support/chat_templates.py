"""The families' real chat templates, for tests: they live in arlo/model/family_templates.py,
where examples/own_format's checkpoint writer reads them too."""

from arlo.model.family_templates import GEMMA2, GEMMA3, LLAMA31, QWEN25

__all__ = ["GEMMA2", "GEMMA3", "LLAMA31", "QWEN25"]
