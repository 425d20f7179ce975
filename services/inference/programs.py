"""The engine's program shapes: how each dimension is bucketed, and the finite set a config allows.

Every jitted call of the runner is keyed by a bucketed shape, one compiled program each:

- `("prefill", m, t, w, j)`: m prompt rows of t tokens read and written through a window of w
  cache positions, j sampled rows (a prompt's samples, several requests' when they share it);
  j is one size per engine (`Buckets.samples`): a call never carries more samples, the runner
  splits the admitted prompts over calls instead;
- `("decode", b, w)`: b rows over a window of w positions.

Buckets are powers of two (windows also at 1.5x), with floors: below a `MIN_PREFILL_TOKENS`
prefill or a `MIN_WINDOW` window a device does the same work for less (a short prefill or
attention span costs its fixed overhead), so smaller buckets would only add programs and compile
stalls. The row floor (`row_floor`) is the same argument for decode: an accelerator reads every
weight once a step whatever the batch, far past 16 rows, and so does any device when the model
is small enough that a step is all fixed cost. A CPU running a large model is compute-bound
from the first row (a 16-row step of a 0.5B model costs ~4x a 1-row step there), so its floor is 1.

`program_set` enumerates every key the runner can produce under the engine's limits (prompt
and completion lengths, slots, prefill rows), so the warm-up compiles exactly that set before
the service takes traffic and a run compiles nothing afterwards. Its size is what the limits
cost at start (reported at start-up; tight limits are a small set).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MIN_TOKEN_BUCKET = 16
MIN_WINDOW = 64
MIN_ROWS = 16
MIN_PREFILL_TOKENS = 128
CPU_COMPUTE_BOUND_PARAMS = 1 << 24
"""From this many parameters a CPU decode step costs in proportion to its rows. Measured here
(bench.real_model.weight_matmul_floor_s, 16 rows over 1): 1.5M params 1.8x (+0.4 ms, below a
step's fixed cost), 6M 4.8x (+4.7 ms), 40M 3.4x (+18 ms), 411M 5.9x (+309 ms)."""

Key = tuple[str | int, ...]


def row_floor(setting: int, *, platform: str, params: int) -> int:
    """Fewest rows of a decode call: `setting` when set (inference.min_rows), else MIN_ROWS,
    except 1 on a CPU with a model of at least CPU_COMPUTE_BOUND_PARAMS parameters."""
    if setting:
        return setting
    return 1 if platform == "cpu" and params >= CPU_COMPUTE_BOUND_PARAMS else MIN_ROWS


def pow2(size: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(size, minimum)."""
    return 1 << (max(size, minimum) - 1).bit_length()


def window_buckets(cache_len: int) -> tuple[int, ...]:
    """64, 96, 128, 192, ... (at most 1.5x waste instead of 2x), then cache_len itself."""
    sizes = {cache_len}
    size = MIN_WINDOW
    while size < cache_len:
        sizes.update(s for s in (size, size * 3 // 2) if s < cache_len)
        size *= 2
    return tuple(sorted(sizes))


@dataclass(frozen=True, kw_only=True, slots=True)
class Buckets:
    """The runner's bucketing rules for one engine (its slots, cache length and prefill rows)."""

    num_slots: int
    cache_len: int
    max_prefill_rows: int
    max_n: int = 1
    min_rows: int = MIN_ROWS
    """Fewest rows of a decode or sampling call (`row_floor`)."""
    page_size: int = 1
    """KV page size: a reused prefix ends on a page boundary."""
    in_place_decode: bool = False
    """Decode attends the pages in place (inference.attention_kernel: pallas): no window to bucket."""

    @property
    def samples(self) -> int:
        """Sampled rows of every prefill call: room for one request's n, at least MIN_ROWS (or a
        higher min_rows), within the slots. Not the decode floor: a prefill call carries at most
        this many prompt rows (each row samples), and its samples cost no matmul (the lm_head
        runs per prompt row). Tied to a decode floor of 1 (a CPU with a large model), it cut
        prefill to one prompt per call: 64 prompts of 32 tokens took 21.2 s at 0.5B against a
        6.1 s matmul floor."""
        return min(pow2(self.max_n, max(self.min_rows, MIN_ROWS)), pow2(self.num_slots))  # slots >= max_n

    @property
    def windows(self) -> tuple[int, ...]:
        return window_buckets(self.cache_len)

    def window(self, length: int) -> int:
        return next(w for w in self.windows if w >= length)

    def decode_window(self, length: int) -> int:
        """The window a decode chunk whose furthest row is at `length` gathers (0: none, in place)."""
        return 0 if self.in_place_decode else self.window(length)

    def decode_rows(self, n: int) -> int:
        """Rows of a decode chunk over n running sequences (never above the slots)."""
        return min(pow2(n, self.min_rows), max(self.num_slots, n))

    def prefill_rows(self, prompts: int, t: int) -> int:
        """Rows of a prefill call over `prompts` distinct prompts of bucket t."""
        floor = min(pow2(-(-MIN_PREFILL_TOKENS // t)), pow2(self.prefill_rows_cap()))
        return pow2(prompts, floor)

    def prefill_rows_cap(self) -> int:
        """Prompt rows one prefill call takes at most (each carries a sample at least)."""
        return min(self.max_prefill_rows, self.samples)

    def prefill_shape(self, length: int, start: int) -> tuple[int, int]:
        """(start, token bucket) of a prompt of `length` whose first `start` tokens' KV is reused.
        When the bucket would overrun the slot, less is reused: the prefill begins at the first page
        boundary from which bucket t still covers the prompt (the prefix's last pages are prefilled
        again), so it ends by `length`. A long episode's later turn (14,976 cached tokens, 2,324
        new, a 4,096 bucket, an 18,824-token slot) used to give the reuse up and prefill the whole
        prompt in one 18,824-token chunk, whose attention scores (11 GB a layer for the `small`
        preset) took the engine out of memory. Only a prompt within a page of the slot's end
        still falls back to a prefill from 0."""
        t = pow2(length - start, MIN_TOKEN_BUCKET)
        if start + t <= self.cache_len:
            return start, t
        page = self.page_size
        back = max(-(-(length - t) // page) * page, 0)  # <= start: start is on a page and >= length - t
        if 0 < back <= start and back + t <= self.cache_len:
            return back, pow2(length - back, MIN_TOKEN_BUCKET)
        return 0, min(pow2(length, MIN_TOKEN_BUCKET), self.cache_len)


def program_set(b: Buckets, *, max_prompt: int, max_tokens: int, max_seq_len: int,
                recompute: bool = False) -> set[Key]:
    """Every key the runner can produce for prompts of 1..max_prompt tokens (with or without a
    reused prefix) and completions of 1..max_tokens, prompt + completion <= max_seq_len.
    `recompute`: samples may be preempted (a KV budget below every sequence at full length, or
    partial rollouts): a resumed sample prefills its prompt and the tokens it has, so its row may
    be as long as prompt + max_tokens - 1."""
    keys: set[Key] = set()
    longest_row = max(max_prompt, min(max_prompt + max_tokens - 1, max_seq_len - 1)) if recompute else max_prompt
    # A chunk feeds from the prompt's length up to prompt + max_tokens - 2.
    furthest = max(min(max_prompt + max_tokens - 2, max_seq_len - 2, b.cache_len), 1)
    decode_windows = {b.decode_window(p) for p in range(1, furthest + 1)}
    rows = {b.decode_rows(n) for n in range(1, b.num_slots + 1)}
    keys |= {("decode", r, w) for r in rows for w in decode_windows}
    shapes: set[tuple[int, int]] = set()  # (t, w) over every (length, start)
    for length in range(1, longest_row + 1):
        start, t = b.prefill_shape(length, 0)
        shapes.add((t, b.window(start + t)))
        shapes |= _reused_prefix_shapes(b, length)
    for t, w in shapes:
        keys |= {("prefill", b.prefill_rows(prompts, t), t, w, b.samples)
                 for prompts in range(1, b.prefill_rows_cap() + 1)}
    return keys


def _reused_prefix_shapes(b: Buckets, length: int) -> set[tuple[int, int]]:
    """(t, w) of a prompt of `length` over every reused prefix 1..length-1, a token bucket at a
    time: its starts form an interval, so start + t does, and so do the windows over it."""
    out: set[tuple[int, int]] = set()
    t = MIN_TOKEN_BUCKET
    while True:
        low, high = (1 if t == MIN_TOKEN_BUCKET else t // 2 + 1), min(t, length - 1)
        if low <= high:  # the remainders (length - start) that land in bucket t
            first, last = length - high + t, length - low + t  # start + t over those starts
            if first <= b.cache_len:
                lo, hi = b.window(first), b.window(min(last, b.cache_len))
                out.update((t, w) for w in b.windows if lo <= w <= hi)
            if last > b.cache_len:  # starts whose bucket overruns the slot (prefill_shape)
                first_over, last_over = max(length - high, b.cache_len - t + 1), length - low
                back = max(-(-(length - t) // b.page_size) * b.page_size, 0)
                fits = 0 < back and back + t <= b.cache_len
                if fits and last_over >= back:  # less reused: from the page boundary `back`
                    t2 = pow2(length - back, MIN_TOKEN_BUCKET)
                    out.add((t2, b.window(back + t2)))
                if not fits or first_over < back:  # reuse given up: the whole prompt from 0
                    fallback = min(pow2(length, MIN_TOKEN_BUCKET), b.cache_len)
                    out.add((fallback, b.window(fallback)))
        if t >= length - 1:
            break
        t *= 2
    return out


def pack_calls(prompts: list[list[tuple[object, int]]], *, rows: int, samples: int,
               size: Callable[[object], int]) -> list[list[list[tuple[object, int]]]]:
    """Splits prompt rows (each a list of (request, start) sharing the prompt) into prefill calls
    of at most `rows` rows and `samples` samples (`size(request)`: its n). A row whose requests
    hold more samples than a call is split into rows of the same prompt (prefilled once each)."""
    pieces: list[list[tuple[object, int]]] = []
    for members in prompts:
        piece: list[tuple[object, int]] = []
        for member in members:
            if piece and sum(size(r) for r, _ in piece) + size(member[0]) > samples:
                pieces.append(piece)
                piece = []
            piece.append(member)
        pieces.append(piece)
    calls: list[list[list[tuple[object, int]]]] = []
    used = samples + 1
    for piece in pieces:
        n = sum(size(r) for r, _ in piece)
        if not calls or len(calls[-1]) >= rows or used + n > samples:
            calls.append([])
            used = 0
        calls[-1].append(piece)
        used += n
    return calls
