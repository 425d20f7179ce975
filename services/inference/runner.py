"""The device side of the engine: one paged KV pool for every sequence and two jitted programs.

The pool has `pages` + 1 pages of `page_size` positions (rounded up to split evenly over a mesh's
data axes); page 0 is the null page, where padding rows and the entries a table does not hold
read and write (arlo/model/paged_kv.py). It lives on the device(s) and is donated to every
program, so each write is an in-place update; on a mesh every program hands it back sharded as
it came. Which sequence holds which page is the scheduler's (services/inference/pages.py): the
programs take page tables.

- prefill(rows m, tokens t, window w, samples j): gathers the window [0, w) of each prompt row
  through its table (the pages before its start come from the prefix cache or an earlier turn),
  runs the model's prefill from the row's start, writes the pages the chunk covers into the
  table of every sample that reads the row (one prefill per prompt: the full pages are shared,
  each sample's partial page is its own) and samples every first token. Requests admitted
  together with the same prompt from the same start (the G episodes of a GRPO group, each its own
  n=1 request) share one row too.
- decode chunk(rows b, window w): gathers each row's window, where w covers the furthest row's
  cached length, so attention reads only the valid region rounded up to a bucket; runs `steps`
  tokens as one lax.scan over that read-only window plus a [b, steps] buffer of the chunk's own
  keys/values, then writes the buffer into each row's pages once. With
  `inference.attention_kernel: pallas` the pool is in the kernels' layout and the chunk has no
  window (w = 0): each step writes its token into its page and attends the pages in place.
  Sampling, stop ids and max tokens are applied on the device with per-row parameters, so a
  round trip costs one host sync per chunk, not per token.

The programs themselves are in services/inference/device_programs.py; this module builds their
batches from the scheduler's sequences and keeps the pool.

With `top_logprobs` K > 0 (inference.max_top_logprobs) both programs also return, per sampled
token, the K most likely tokens of the distribution it was drawn from; K is static, one value for
the engine, so a request's K (up to it) never compiles anything, and K = 0 leaves the programs
as they are without it.

Every dimension is bucketed (services/inference/programs.py), so the programs are a small
known set: `warm_up` compiles all of them before the service takes traffic, and a shape
outside it is logged as a late compile. Weights are a traced argument: a swap never
recompiles as long as the new state has the same tree, shapes and dtypes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arlo.model.config import ModelConfig
from arlo.model.kv_cache import KVCache
from arlo.model.paged_kv import KernelPool, init_pool, pool_shardings
from arlo.model.sharding import BATCH_AXES
from services.inference.device_programs import (
    DecodeBatch,
    PrefillBatch,
    SampleParams,
    decode_jit,
    decode_kernel,
    decode_paged_jit,
    prefill_jit,
)
from services.inference.pages import NULL_PAGE
from services.inference.programs import MIN_ROWS, Buckets, Key, pack_calls, program_set
from services.inference.requests import MAX_STOP_IDS
from services.inference.scheduler import PrefillItem
from services.inference.scheduler import Sequence as Seq

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Emitted:
    seq: Seq
    token_ids: list[int]
    logprobs: list[float]
    experts: np.ndarray | None = None
    """int [tokens, routed layers, top_k]: the experts each token's predicting position went to
    (a model with routed experts; None without), for routing replay."""
    top_ids: np.ndarray | None = None
    """int32 [tokens, K]: each token's K most likely tokens, most likely first (K = the runner's
    top_logprobs > 0; None with 0)."""
    top_logprobs: np.ndarray | None = None
    """float32 [tokens, K]: their logprobs, under the distribution each token was drawn from."""


def abstract(tree):  # noqa: ANN001, ANN201 (any pytree of arrays)
    """The tree's shapes, dtypes and shardings, without its buffers: what a compile needs, and a
    compiled call then finds its program (the same lowering as with the arrays)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Runner:
    def __init__(self, graphdef: nnx.GraphDef, model_cfg: ModelConfig, *, pages: int, page_size: int, max_seqs: int,
                 slot_len: int, decode_steps: int, max_prefill_rows: int, max_n: int = 1, min_rows: int = MIN_ROWS,
                 mesh: Mesh | None = None, top_logprobs: int = 0, attention_kernel: str = "xla") -> None:
        """`pages` of `page_size` positions hold every sequence's KV; `max_seqs` sequences decode
        together at most; `slot_len` positions (prompt + completion) one sequence reaches at most;
        `top_logprobs`: K alternatives returned per sampled token (0: none); `attention_kernel`:
        "pallas" decodes against the pages in place (arlo/model/paged_attention.py)."""
        self.kernel = decode_kernel(attention_kernel, model_cfg, mesh)
        """None: decode gathers a window; else the paged-attention kernel decode runs."""
        self.graphdef = graphdef
        self.top_logprobs = top_logprobs
        self.mesh = mesh
        self.decode_steps = decode_steps
        self.max_prefill_rows = max_prefill_rows
        self.page_size = page_size
        # The band a decode chunk writes back may reach `steps` positions past a sequence's end.
        self.cache_len = slot_len + decode_steps
        self.table_len = -(-self.cache_len // page_size)
        self.buckets = Buckets(num_slots=max_seqs, cache_len=self.cache_len, max_prefill_rows=max_prefill_rows,
                               max_n=max_n, min_rows=min_rows, page_size=page_size,
                               in_place_decode=self.kernel is not None)
        self.windows = self.buckets.windows
        self._model_cfg = model_cfg
        # Pages + the null page, rounded up so the pages split evenly over the data axes.
        ways = 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)
        self.pool_pages = -(-(pages + 1) // ways) * ways
        self.pages = self.pool_pages - 1
        """Pages the scheduler may hand out (1..pages; the rounding's extra pages are usable too)."""
        self.cache_sharding: KVCache | KernelPool | None = None if mesh is None else pool_shardings(
            model_cfg, mesh, pages=self.pool_pages, page_size=page_size, kernel_layout=self.kernel is not None)
        self.cache = self._new_cache()
        self.prefill_rows = 0
        """Prompt rows prefilled so far (n samples of one prompt count once)."""
        self.prefill_tokens = 0
        """Tokens those rows prefilled (a prefix found in the cache is not prefilled)."""
        self.shared_prefills = 0
        """Requests whose prompt rode on another request's prefill row (same prompt, same step)."""
        self.shapes: set[Key] = set()
        """Bucketed shapes run so far: one compiled program each."""
        self.warm: set[Key] | None = None
        """The programs `warm_up` compiled; None before it ran (every shape then compiles on first use)."""
        self.late: list[Key] = []
        """Shapes run after the warm-up that it did not cover (each one compiled mid-run)."""

    def reset_cache(self) -> None:
        self.cache = self._new_cache()

    def _new_cache(self) -> KVCache:
        # Committed like the programs' outputs, so the first call and every later one (which
        # gets the donated output back) share one compiled program.
        cache = init_pool(self._model_cfg, pages=self.pool_pages, page_size=self.page_size,
                          kernel_layout=self.kernel is not None)
        return jax.device_put(cache, self.cache_sharding or jax.devices()[0])

    def cache_bytes(self) -> int:
        return self.cache.nbytes()

    def window(self, length: int) -> int:
        return self.buckets.window(length)

    def prefill_start(self, length: int, cached: int) -> int:
        """Where a prompt of `length` tokens whose first `cached` are in the cache starts its
        prefill: 0 when its token bucket would overrun the table (the prefix is recomputed)."""
        return self.buckets.prefill_shape(length, cached)[0]

    def program_set(self, *, max_prompt: int, max_tokens: int, recompute: bool = False) -> set[Key]:
        """Every program key requests within these limits can need (services/inference/programs.py);
        `recompute`: with the prefills of preempted samples resumed."""
        return program_set(self.buckets, max_prompt=max_prompt, max_tokens=max_tokens,
                           max_seq_len=self.cache_len - self.decode_steps, recompute=recompute)

    def warm_up(self, state: nnx.State, keys: set[Key]) -> None:
        """Compiles every program in `keys` ahead of time (nothing runs: the cache is untouched),
        so the jitted calls that need them later find them compiled."""
        for key in sorted(keys, key=str):
            self.compile_program(key, state, self.cache)
        self.warm = set(keys)

    def compile_program(self, key: Key, state: nnx.State, cache: KVCache) -> None:
        """Compiles the program of `key` (nothing runs). `state` and `cache` may be abstract
        (`abstract`): a compile beside the engine must not touch the arrays its calls donate."""
        kind, *dims = key
        if kind == "decode":
            b, w = dims
            program, static = self._decode_program(int(w))
            program.lower(*static, state, cache, _decode_batch([], int(b), self.table_len),
                          top=self.top_logprobs).compile()
        else:
            m, t, w, j = (int(d) for d in dims)
            prefill_jit.lower(self.graphdef, w, self._span(t), self.cache_sharding, state, cache,
                               _prefill_batch([], m, t, j, self.table_len), top=self.top_logprobs).compile()

    def _decode_program(self, w: int) -> tuple[Any, tuple]:
        """(the decode chunk's jitted program over window w, its static leading arguments): call it,
        or `.lower` it, with those, then (state, cache, batch, top=...). The kernel decode has no window."""
        if self.kernel is not None:
            return decode_paged_jit, (self.graphdef, self.decode_steps, self.kernel, self.cache_sharding)
        return decode_jit, (self.graphdef, self.decode_steps, w, self.cache_sharding)

    def _span(self, t: int) -> int:
        """Pages a prefill chunk of t tokens from a page boundary covers."""
        return -(-t // self.page_size)

    def _note(self, key: Key) -> None:
        if key in self.shapes:
            return
        self.shapes.add(key)
        if self.warm is not None and key not in self.warm:
            self.late.append(key)
            log.warning("program %s ran after the warm-up without being in it: it compiles now", key,
                        extra={"late_program": list(key)})

    def prefill(self, state: nnx.State, items: Sequence[PrefillItem]) -> list[Emitted]:
        """Prefills the step's prompt rows (grouped by shape) and samples each sample's next token."""
        groups: dict[tuple[int, int], dict[tuple[int, int, int, tuple[int, ...]], list[tuple[PrefillItem, int]]]] = {}
        for item in items:
            t = self.buckets.prefill_shape(len(item.tokens), item.start)[1]
            rows = groups.setdefault((t, self.window(item.start + t)), {})
            # Rows share a prompt's KV only under the same adapter: another run's adapter writes other KV.
            key = (item.start, item.adapter, item.count, item.tokens)
            rows.setdefault(key, []).append((item, item.start))
        out = []
        for (t, w), by_prompt in sorted(groups.items()):
            members = list(by_prompt.values())
            for call in pack_calls(members, rows=self.buckets.prefill_rows_cap(), samples=self.buckets.samples,
                                   size=lambda item: len(item.seqs)):
                # Counted per row as packed: a prompt whose samples fill more than one call is
                # prefilled once per row it was split into, and shares only within each.
                self.shared_prefills += sum(len(row) - 1 for row in call)
                out += self._prefill_call(state, call, t, w)
        return out

    def decode(self, state: nnx.State, seqs: Sequence[Seq]) -> list[Emitted]:
        """One chunk of `decode_steps` tokens for every running sequence."""
        b = self.buckets.decode_rows(len(seqs))
        batch = _decode_batch(seqs, b, self.table_len)
        w = self.buckets.decode_window(int(batch.pos.max()))  # the chunk's own tokens live in a buffer beside it
        self._note(("decode", b, w))
        program, static = self._decode_program(w)
        self.cache, out = program(*static, state, self.cache, batch, top=self.top_logprobs)
        tok_kb, lp_kb, emit_kb, extra = jax.device_get(out)  # extra: [steps, b, ...] each
        rows = []
        for r, seq in enumerate(seqs):
            emitted = emit_kb[:, r]
            rows.append(Emitted(seq=seq, token_ids=tok_kb[emitted, r].tolist(), logprobs=lp_kb[emitted, r].tolist(),
                                **{name: value[emitted, r] for name, value in extra.items()}))
        return rows

    def _prefill_call(self, state: nnx.State, members: list[list[tuple[PrefillItem, int]]], t: int,
                      w: int) -> list[Emitted]:
        """One prefill program: a row per distinct prompt, every sample of every item on it."""
        m = self.buckets.prefill_rows(len(members), t)
        self.prefill_rows += len(members)
        self.prefill_tokens += sum(len(same[0][0].tokens) - same[0][1] for same in members)
        j = self.buckets.samples
        self._note(("prefill", m, t, w, j))
        batch = _prefill_batch(members, m, t, j, self.table_len)
        self.cache, out = prefill_jit(self.graphdef, w, self._span(t), self.cache_sharding, state, self.cache, batch,
                                       top=self.top_logprobs)
        tok_j, lp_j, extra = jax.device_get(out)  # extra: [j, ...] each
        seqs = [seq for same in members for item, _ in same for seq in item.seqs]
        return [Emitted(seq=seq, token_ids=[int(tok_j[i])], logprobs=[float(lp_j[i])],
                        **{name: value[i : i + 1] for name, value in extra.items()})
                for i, seq in enumerate(seqs)]


def _table(pages: Sequence[int], width: int) -> np.ndarray:
    table = np.full((width,), NULL_PAGE, np.int32)
    table[: len(pages)] = pages[:width]
    return table


def _prefill_batch(members: Sequence[Sequence[tuple[PrefillItem, int]]], m: int, t: int, j: int,
                   width: int) -> PrefillBatch:
    """`members`: per prompt row, the items (with their start) that share it. Padding rows and
    samples read and write the null page."""
    tokens = np.zeros((m, t), np.int32)
    lengths, starts = np.ones((m,), np.int32), np.zeros((m,), np.int32)
    src_table = np.full((m, width), NULL_PAGE, np.int32)
    adapter = np.zeros((m,), np.int32)
    dst_table = np.full((j, width), NULL_PAGE, np.int32)
    src_row, count = np.zeros((j,), np.int32), np.zeros((j,), np.int32)
    seqs: list[Seq] = []
    for row, same in enumerate(members):
        item, start = same[0]
        chunk = item.tokens[start:]
        tokens[row, : len(chunk)] = chunk
        lengths[row], starts[row], adapter[row] = len(chunk), start, item.adapter
        src_table[row] = _table(item.seqs[0].pages, width)
        for other, _ in same:
            for seq in other.seqs:
                i = len(seqs)
                dst_table[i], src_row[i], count[i] = _table(seq.pages, width), row, other.count
                seqs.append(seq)
    return PrefillBatch(src_table=src_table, tokens=tokens, lengths=lengths, starts=starts, dst_table=dst_table,
                        src_row=src_row, count=count, params=_sample_params(seqs, j), adapter=adapter)


def _sample_params(seqs: Sequence[Seq], rows: int) -> SampleParams:
    temperature, top_p, min_p = (np.ones((rows,), np.float32), np.ones((rows,), np.float32),
                                 np.zeros((rows,), np.float32))
    top_k = np.zeros((rows,), np.int32)
    seed, index = np.zeros((rows, 2), np.uint32), np.zeros((rows,), np.uint32)
    for r, seq in enumerate(seqs):
        p = seq.request.params
        temperature[r], top_k[r], top_p[r], min_p[r] = p.temperature, p.top_k, p.top_p, p.min_p
        seed[r] = (seq.request.seed & 0xFFFFFFFF, seq.request.seed >> 32)
        index[r] = seq.index
    return SampleParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, sample=index)


def _decode_batch(seqs: Sequence[Seq], rows: int, width: int) -> DecodeBatch:
    table = np.full((rows, width), NULL_PAGE, np.int32)
    token, pos, count = (np.zeros((rows,), np.int32) for _ in range(3))
    max_tokens = np.zeros((rows,), np.int32)
    stop_ids = np.full((rows, MAX_STOP_IDS), -1, np.int32)
    live = np.zeros((rows,), np.bool_)
    adapter = np.zeros((rows,), np.int32)
    for r, seq in enumerate(seqs):
        req = seq.request
        table[r], token[r], pos[r], count[r] = _table(seq.pages, width), seq.token_ids[-1], seq.position, len(seq.token_ids)
        adapter[r] = req.params.adapter
        max_tokens[r], live[r] = req.params.max_tokens, True
        stop_ids[r, : len(req.stop_ids)] = req.stop_ids
    return DecodeBatch(table=table, token=token, pos=pos, count=count, max_tokens=max_tokens, stop_ids=stop_ids,
                       live=live, params=_sample_params(seqs, rows), adapter=adapter)
