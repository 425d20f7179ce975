"""How many KV pages an engine gets and how long they are: one function of the inference config and
the model, shared by the engine, `arlo plan` (services/inference/memory_plan.py) and the run
config's check (arlo/config/run.py). Plain arithmetic: no JAX, so config loading stays light."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from arlo.model.config import ModelConfig

if TYPE_CHECKING:
    from arlo.config import InferenceConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class KVLayout:
    page_size: int
    """Positions per page (the whole `cache_len` in the dense layout)."""
    pages: int
    """Pages the scheduler hands out (the null page comes on top)."""
    max_seqs: int
    """Sequences in flight at most (inference.max_batch)."""
    slot_len: int
    """Positions one sequence may reach (prompt + completion)."""
    cache_len: int
    """slot_len + decode_steps: a decode chunk's band may run that far past a sequence's end."""

    @property
    def table_len(self) -> int:
        """Pages of one sequence at its longest (its page table's length)."""
        return -(-self.cache_len // self.page_size)


def position_bytes(model_cfg: ModelConfig) -> int:
    """KV bytes of one position over every layer (keys and values)."""
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * DTYPE_BYTES[model_cfg.dtype]


def kv_layout(config: InferenceConfig, model_cfg: ModelConfig) -> KVLayout:
    """`model_cfg.max_seq_len` is the engine's sequence limit (already capped by
    inference.max_seq_len). Raises ValueError when the budget cannot hold one request of max_n
    samples at full length (it could never be admitted)."""
    slot_len = model_cfg.max_seq_len
    cache_len = slot_len + config.decode_steps
    # A page past the sequence's whole length would only waste its tail: that is the dense layout.
    page_size = min(config.page_size or cache_len, cache_len)
    per_seq = -(-cache_len // page_size)
    per_page = position_bytes(model_cfg) * page_size
    pages = config.max_batch * per_seq
    if config.kv_cache_mib:
        pages = math.floor(config.kv_cache_mib * 2**20 / per_page)
    if pages < config.max_n * per_seq:
        raise ValueError(f"inference.kv_cache_mib: {pages} KV pages ({config.kv_cache_mib} MiB, page_size "
                         f"{config.page_size}, {per_page / 2**20:.3f} MiB per page) cannot hold n = {config.max_n} "
                         f"(inference.max_n) sequences of {slot_len} positions ({per_seq} pages each): raise it to "
                         f"at least {math.ceil(config.max_n * per_seq * per_page / 2**20)}, or lower inference.max_n "
                         "or inference.max_seq_len")
    return KVLayout(page_size=page_size, pages=pages, max_seqs=config.max_batch, slot_len=slot_len,
                    cache_len=cache_len)
