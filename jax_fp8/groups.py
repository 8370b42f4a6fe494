"""Groups of rows, as ``lax.ragged_dot`` takes them: the one definition of which rows belong to which
group and of the row blocks that restart at every group start (what a mixture-of-experts layer's
weight gradient quantizes its operands in: a block of 128 rows along the contraction must not mix two
experts' rows).

``group_sizes`` (G,) int32 lives on the device and changes every step, so every shape here is static
(a bound) and every position is computed from the sizes by array ops, on NumPy or ``jax.numpy``.

- Group g holds rows ``[start_g, end_g)``: ``end_g = min(size_0 + ... + size_g, M)``, a negative size
  counting as 0 (``lax.ragged_dot`` leaves negative sizes undefined). Rows past the last end belong to
  no group.
- Group g's rows split into ``cdiv(end_g - start_g, bm)`` blocks of ``bm`` rows from ``start_g`` (the
  last one partial); the blocks of all groups are numbered in order, group by group, and a tensor
  stores each block's scales in its slot. There are at most :func:`block_slots` of them: slots past
  the last block are unused (they hold the scale of an all-zero block).
- A columnwise (transposed) operand holds group g's rows as the columns from ``col_starts[g]``, a
  multiple of :data:`COL_ALIGN` (the grouped GEMM's TMA loads start each group on a 16-byte address),
  the columns between groups and past the last one 0: :func:`col_count` columns in all.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .arrays import xp_of

#: Each group's first column in a columnwise operand is a multiple of this (16 FP8 bytes: TMA's rule).
COL_ALIGN = 16


def block_slots(M: int, G: int, bm: int) -> int:
    """The number of block slots of M rows in G groups, ``bm`` rows a block: the most blocks any group
    sizes give. With n = min(G, M) non-empty groups, at most ``n + (M - n) // bm``: each group's last
    block takes at least one row, its other blocks ``bm`` each (reached by n - 1 groups of one row and one
    group of the rest); 0 for no rows or no groups."""
    n = min(G, M)
    return n + (M - n) // bm if n > 0 else 0


def col_count(M: int, G: int) -> int:
    """The columns of a columnwise operand of M rows in G groups: the most any sizes take, each group
    rounded up to :data:`COL_ALIGN` columns: :func:`block_slots` of blocks of :data:`COL_ALIGN` rows."""
    return COL_ALIGN * block_slots(M, G, COL_ALIGN)


def col_starts(group_sizes, M: int):
    """Each group's first column, (G,) int32: the groups before it, each rounded up to :data:`COL_ALIGN`."""
    xp = xp_of(group_sizes)
    starts, ends = group_bounds(group_sizes, M)
    cols = (ends - starts + COL_ALIGN - 1) // COL_ALIGN * COL_ALIGN
    return (xp.cumsum(cols) - cols).astype(np.int32)


def row_cols(group_sizes, M: int):
    """The column of each of the M rows in a columnwise operand, (M,) int32; :func:`col_count` for a row
    in no group."""
    xp = xp_of(group_sizes)
    G = group_sizes.shape[0]
    if G == 0:
        return xp.zeros((M,), np.int32)
    starts, _ = group_bounds(group_sizes, M)
    g = row_groups(group_sizes, M)
    gc = xp.minimum(g, G - 1)
    col = col_starts(group_sizes, M)[gc] + xp.arange(M, dtype=np.int32) - starts[gc]
    return xp.where(g < G, col, col_count(M, G)).astype(np.int32)


def group_bounds(group_sizes, M: int):
    """``(starts, ends)`` (G,) of the groups' rows, clamped to ``[0, M]`` (module doc)."""
    xp = xp_of(group_sizes)
    sizes = xp.clip(group_sizes.astype(np.int32), 0, M)
    ends = xp.minimum(xp.cumsum(sizes), M).astype(np.int32)  # clipped sizes: the sum stays below G * M
    starts = xp.concatenate([xp.zeros((1,), np.int32), ends[:-1]])
    return starts, ends


def _block_counts(group_sizes, M: int, bm: int):
    """``(starts, ends, counts, first)`` (G,): the groups' rows, their blocks of ``bm`` rows and each
    group's first slot."""
    xp = xp_of(group_sizes)
    starts, ends = group_bounds(group_sizes, M)
    counts = (ends - starts + bm - 1) // bm
    return starts, ends, counts, xp.cumsum(counts) - counts


def row_groups(group_sizes, M: int):
    """The group of each of the M rows, (M,) int32; G for a row past the last group's end."""
    xp = xp_of(group_sizes)
    _, ends = group_bounds(group_sizes, M)
    return xp.searchsorted(ends, xp.arange(M, dtype=np.int32), side="right").astype(np.int32)


def row_blocks(group_sizes, M: int, bm: int):
    """The block slot of each of the M rows, (M,) int32, ``bm`` rows a block restarting at every group
    start; :func:`block_slots` for a row in no group."""
    xp = xp_of(group_sizes)
    G = group_sizes.shape[0]
    if G == 0:
        return xp.zeros((M,), np.int32)
    starts, _, _, first = _block_counts(group_sizes, M, bm)
    g = row_groups(group_sizes, M)
    inside = g < G
    gc = xp.minimum(g, G - 1)
    rows = xp.arange(M, dtype=np.int32)
    slot = first[gc] + (rows - starts[gc]) // bm
    return xp.where(inside, slot, block_slots(M, G, bm)).astype(np.int32)


def slot_blocks(group_sizes, M: int, bm: int):
    """Each block slot's ``(group, first row, rows)``, (S,) int32 each (S = :func:`block_slots`); an
    unused slot has 0 rows (and group G - 1, first row M)."""
    xp = xp_of(group_sizes)
    G = group_sizes.shape[0]
    S = block_slots(M, G, bm)
    starts, ends, counts, first = _block_counts(group_sizes, M, bm)
    last = first + counts  # one past each group's last slot
    slots = xp.arange(S, dtype=np.int32)
    g = xp.minimum(xp.searchsorted(last, slots, side="right"), G - 1).astype(np.int32)
    used = slots < last[-1] if G else slots < 0
    row0 = starts[g] + (slots - first[g]) * bm
    rows = xp.where(used, xp.minimum(ends[g] - row0, bm), 0).astype(np.int32)
    return g, xp.where(used, row0, M).astype(np.int32), rows


# ---- the grouped layout from a router's choices --------------------------------------------------------
@partial(jax.tree_util.register_dataclass, data_fields=["rows", "dest", "group_sizes"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where a mixture-of-experts layer's token copies go in the grouped layout (:func:`route`).

    - ``rows`` (R,) int32: for each row of the grouped layout, the assignment it holds (an index into
      the flattened (T * k) choices; token ``rows // k``), or -1 for a padding row or a row past the groups;
    - ``dest`` (T * k,) int32: each assignment's row in the layout (``rows[dest] == arange(T * k)``);
    - ``group_sizes`` (G,) int32: the groups' sizes, padding rows included (what ``ragged_dot`` takes).
    """

    rows: Any
    dest: Any
    group_sizes: Any

    def permute(self, x, k: int):
        """The (R, ...) grouped rows of the tokens ``x`` (T, ...) (each token's k copies in its experts'
        groups; padding rows 0)."""
        src = jnp.maximum(self.rows, 0) // k
        return jnp.where((self.rows >= 0).reshape(-1, *([1] * (x.ndim - 1))), x[src], 0).astype(x.dtype)

    def unpermute(self, y, weights):
        """The tokens' outputs (T, ...): each token's k rows of the grouped ``y`` (R, ...) summed with the
        router ``weights`` (T, k)."""
        T, k = weights.shape
        picked = y[self.dest].reshape(T, k, *y.shape[1:])
        w = weights.reshape(T, k, *([1] * (y.ndim - 1))).astype(y.dtype)
        return (picked * w).sum(axis=1)


def layout_rows(T: int, k: int, G: int, pad_to: int) -> int:
    """Rows of the grouped layout of T tokens, k experts each, G experts, groups padded to ``pad_to``: the
    T * k copies and, per group, fewer than ``pad_to`` padding rows (a static bound)."""
    return T * k + G * (pad_to - 1)


def route(expert_ids, num_groups: int, pad_to: int = 1) -> Routing:
    """The grouped layout of a router's top-k choices ``expert_ids`` (T, k) int (each token's experts):
    the token copies sorted by expert, in token order within an expert, each expert's rows padded with
    rows of zeros to a multiple of ``pad_to``. ``pad_to=128`` is the layout the blockwise FP8 grouped
    GEMMs prefer: every group starts on a 128-row block, so the weight gradient's blocks, which
    restart at each group start, are the dense tensor's (DeepGEMM's "contiguous" layout). Static shapes:
    :func:`layout_rows` rows, read from ``group_sizes`` on the device (no host sync)."""
    T, k = expert_ids.shape
    G = int(num_groups)
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    A = T * k
    counts = jnp.zeros((G,), jnp.int32).at[ids].add(1, mode="drop")
    sizes = (counts + pad_to - 1) // pad_to * pad_to
    first = jnp.cumsum(sizes) - sizes  # each group's first row
    order = jnp.argsort(ids, stable=True)  # assignments by expert, in token order within one
    seen = jnp.cumsum(counts) - counts  # assignments of the experts before
    rank = jnp.arange(A, dtype=jnp.int32) - seen[ids[order]]
    dest = jnp.zeros((A,), jnp.int32).at[order].set(first[ids[order]] + rank)
    rows = jnp.full((layout_rows(T, k, G, pad_to),), -1, jnp.int32).at[dest].set(jnp.arange(A, dtype=jnp.int32))
    return Routing(rows, dest, sizes.astype(jnp.int32))
