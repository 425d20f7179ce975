"""The SFT warm start's data: demonstrations -> endless shuffled, token-aligned SFT batches.

The trainer runs `steps` SFT steps on these before its first RL step (trainer.sft), so a run
can start RL from a policy that already follows the task's format.
"""

from __future__ import annotations

from arlo.config import ConfigError, SFTConfig
from arlo.model.tokenizer import Tokenizer
from services.trainer.sft import (
    SFTBatch,
    batch_lengths,
    example_batches,
    fit_examples,
    load_demonstrations,
    tokenize_demonstration,
)


class WarmStart:
    def __init__(self, cfg: SFTConfig, tokenizer: Tokenizer, *, max_seq_len: int, seed: int = 0) -> None:
        """Any tokenizer: demonstrations are rendered with its chat template (the model's own)."""
        demos = load_demonstrations(cfg.data)  # a clear error at start for a missing or bad file
        if len(demos) < cfg.batch_size:
            raise ConfigError(f"trainer.sft.data has {len(demos)} demonstrations; batch_size is {cfg.batch_size}")
        self.steps = cfg.steps
        self.batch_size = cfg.batch_size
        # Demonstrations longer than the context: refused, left out or cut from the left, and counted.
        self.fitted = fit_examples([tokenize_demonstration(d, tokenizer) for d in demos], max_seq_len, cfg.too_long)
        examples = self.fitted.examples
        if len(examples) < cfg.batch_size:
            raise ConfigError(f"trainer.sft.batch_size: {cfg.batch_size}, but only {len(examples)} of the "
                              f"{len(demos)} demonstrations fit model.max_seq_len = {max_seq_len} (the longest has "
                              f"{self.fitted.longest} tokens); raise model.max_seq_len or lower the batch size")
        self.batch_lengths = batch_lengths(examples, max_seq_len)
        """Every length a batch can take: the SFT step programs the start-up warm-up compiles."""
        self._batches = example_batches(examples, tokenizer.pad_id, cfg.batch_size, max_seq_len=max_seq_len, seed=seed)

    def next_batch(self) -> SFTBatch:
        return next(self._batches)
