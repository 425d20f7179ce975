"""Sequence packing (`trainer.pack`): several trajectories per row of the forward pass.

A right-padded batch pays for rows x its longest trajectory: one 16k episode and fifteen 1k
ones cost sixteen 16k rows. Packed, the same micro-batch runs as two 16k rows. Only the model's
forward runs packed: the loss reads its per-token outputs gathered back into the batch's own
right-padded [rows, length - 1] layout (`unpack`), so every per-sequence quantity (sequence
means, advantages, group statistics, KL, entropy) is computed by the same code on the same
arrays as without packing.

Pure NumPy here (the host builds the layout once per batch) plus the one gather the step does.
Layout of a packed micro-batch (`pack_rows`), rows of the batch's own length L:
- tokens, segment ids (0 = padding, 1.. the episodes of a row in order) and positions
  (restarting at 0 for each episode: RoPE sees each episode as it would alone);
- `count` [P, L - 1]: the batch's target mask moved to where the packed forward predicts each
  target (what the routers' load-balancing loss counts);
- `index` [B, L - 1]: for target j of episode row b, its place in the packed outputs flattened.
  The packed column at an episode's last token predicts the next episode's first token across
  the boundary; no index points there, so that prediction never enters the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

PACKED_KEYS = ("packed_tokens_bt", "packed_segment_ids_bt", "packed_positions_bt", "packed_count_bt",
               "packed_index_bt")
"""The micro-batch keys of a packed layout (`packed_micro_batches`); `packed_index_bt` has the
batch's own rows, the others the packed rows."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where first-fit-decreasing put each length: `slots[i]` = (row, offset) of length i, (-1, 0)
    for an empty one (nothing to place); `rows` the rows used."""

    slots: tuple[tuple[int, int], ...]
    rows: int


def first_fit_decreasing(lengths: Sequence[int], row_length: int) -> Placement:
    """Longest first, each into the first row with room (a new row when none has): at most
    11/9 of the optimal row count plus one, in O(items x rows)."""
    if any(n > row_length for n in lengths):
        raise ValueError(f"a length of {max(lengths)} does not fit rows of {row_length}")
    slots: list[tuple[int, int]] = [(-1, 0)] * len(lengths)
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n <= 0:
            continue
        row = next((r for r, u in enumerate(used) if u + n <= row_length), len(used))
        if row == len(used):
            used.append(0)
        slots[i] = (row, used[row])
        used[row] += n
    return Placement(slots=tuple(slots), rows=len(used))


def trained_lengths(mask_bt: np.ndarray) -> np.ndarray:
    """Tokens of each row up to and including its last loss token (0 without any): the later
    tokens are only ever attended by later positions, so the loss never depends on them."""
    has = mask_bt > 0
    last = mask_bt.shape[1] - np.argmax(has[:, ::-1], axis=1)
    return np.where(has.any(axis=1), last, 0).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedRows:
    """One micro-batch packed (see the module docstring for each array)."""

    tokens_pl: np.ndarray  # int32 [P, L]
    segment_ids_pl: np.ndarray  # int32 [P, L]
    positions_pl: np.ndarray  # int32 [P, L]
    count_pl: np.ndarray  # float32 [P, L - 1]
    index_bt: np.ndarray  # int32 [B, L - 1]


def pack_rows(tokens_bt: np.ndarray, mask_bt: np.ndarray, *, rows: int | None = None) -> PackedRows:
    """Packs a right-padded micro-batch [B, L] into rows of length L (at least `rows` of them,
    the extra ones all padding, so micro-batches of one step share a shape)."""
    b, length = tokens_bt.shape
    lengths = trained_lengths(mask_bt)
    placement = first_fit_decreasing([int(n) for n in lengths], length)
    p = max(placement.rows, rows or 1)
    tokens = np.zeros((p, length), np.int32)
    segments = np.zeros((p, length), np.int32)
    positions = np.zeros((p, length), np.int32)
    count = np.zeros((p, length - 1), np.float32)
    index = np.zeros((b, length - 1), np.int32)
    # In (row, offset) order, so a row's segments are numbered 1, 2, ... left to right.
    for e in sorted(range(b), key=lambda e: placement.slots[e]):
        (r, o), n = placement.slots[e], int(lengths[e])
        if n == 0:
            continue
        tokens[r, o:o + n] = tokens_bt[e, :n]
        segments[r, o:o + n] = segments[r, o - 1] + 1 if o else 1
        positions[r, o:o + n] = np.arange(n)
        count[r, o:o + n - 1] = mask_bt[e, 1:n]
        index[e, :n - 1] = r * (length - 1) + o + np.arange(n - 1)
    return PackedRows(tokens_pl=tokens, segment_ids_pl=segments, positions_pl=positions, count_pl=count,
                      index_bt=index)


def packed_micro_batches(tokens_mbt: np.ndarray, mask_mbt: np.ndarray) -> dict[str, np.ndarray]:
    """The PACKED_KEYS arrays of micro-batches [M, B, L], each packed on its own into as many rows
    as the fullest one needs: [M, P, L] ([M, B, L - 1] for the index)."""
    rows = max(first_fit_decreasing([int(n) for n in trained_lengths(m)], m.shape[1]).rows for m in mask_mbt)
    packed = [pack_rows(t, m, rows=rows) for t, m in zip(tokens_mbt, mask_mbt, strict=True)]
    fields = ("tokens_pl", "segment_ids_pl", "positions_pl", "count_pl", "index_bt")
    return {key: np.stack([getattr(p, f) for p in packed]) for key, f in zip(PACKED_KEYS, fields, strict=True)}


def unpack(packed_out: jax.Array, index_bt: jax.Array) -> jax.Array:
    """Per-target outputs of the packed forward [P, L - 1, ...] in the batch's layout [B, L - 1, ...]
    (a target without a place, padding, reads the packed output at 0: finite, and masked)."""
    flat = packed_out.reshape(-1, *packed_out.shape[2:])
    return flat[index_bt]


def padding_fraction(lengths: Sequence[int], rows: int, row_length: int) -> float:
    """Padded tokens over real tokens of `rows` rows of `row_length` holding `lengths`."""
    real = sum(lengths)
    return (rows * row_length - real) / max(real, 1)
