"""Where each data-parallel rank's flat master-weight shard lies, for the two standard ZeRO splits.

A split (the keyword ``split`` of :func:`split_masters`, :func:`local_shards` and :func:`shard_windows`)
says how the fp32 master weights are divided over the ranks; it is not a tensor layout (``layout``,
``'compact'`` or ``'gemm_ready'``: how a quantized tensor's arrays are arranged):

- ``"per_weight"``: every weight is flattened, zero-padded to a multiple of the ranks and split evenly
  (rank r holds ``[r * L, (r + 1) * L)`` with ``L = ceil(size / ranks)``).
- ``"flat"``: all weights are concatenated, in order, into one flat buffer that is zero-padded and split
  evenly over the ranks (Megatron's and TransformerEngine's distributed optimizer). A weight may then
  start and end anywhere inside a rank's buffer, and a rank may hold none of it.

A shard window is ``(offset, length)``: the rank holds elements ``[offset, offset + length)`` of the
row-major flattened weight. The windows of one weight over all ranks must tile it exactly once; these
helpers compute them for either split so that nobody does it by hand.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import jax.numpy as jnp
from jax import lax

from .. import vma
from ..arrays import cdiv

SPLITS = ("per_weight", "flat")


def check_shapes(shapes, where: str) -> list[tuple[int, ...]]:
    """Validate a sequence of weight shapes (each a sequence of non-negative ints)."""
    if isinstance(shapes, (int, np.integer)) or not isinstance(shapes, Sequence):
        raise TypeError(f"{where}: shapes must be a sequence of weight shapes (tuples of ints), got {shapes!r}")
    out = []
    for i, s in enumerate(shapes):
        if isinstance(s, (int, np.integer)) or not isinstance(s, Sequence) or len(s) == 0:
            raise TypeError(f"{where}: shapes[{i}] must be a non-empty tuple of ints (the weight's full shape), "
                            f"got {s!r}")
        try:
            dims = tuple(int(d) for d in s)
        except (TypeError, ValueError):
            raise TypeError(f"{where}: shapes[{i}] must be a tuple of ints, got {s!r}") from None
        if any(d < 0 for d in dims) or dims != tuple(s):
            raise ValueError(f"{where}: shapes[{i}] must hold non-negative ints, got {s!r}")
        out.append(dims)
    return out


def _check_split(split, where):
    if split not in SPLITS:
        raise ValueError(f"{where}: split must be one of {SPLITS}, got {split!r}")


def _spans(shapes, ranks: int, split: str):
    """Per weight: (first element in the split's buffer, size, elements per rank of that buffer)."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    if split == "per_weight":
        return [(0, n, max(1, cdiv(n, ranks))) for n in sizes]
    per_rank = max(1, cdiv(sum(sizes), ranks))
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    return [(start, n, per_rank) for start, n in zip(starts, sizes)]


def _window(xp, rank, start: int, size: int, per_rank: int):
    """Rank ``rank``'s part of a weight occupying ``[start, start + size)`` of a buffer split evenly in
    pieces of ``per_rank``: (offset in the weight, length, position in the rank's piece)."""
    lo = xp.clip(rank * per_rank, start, start + size)
    hi = xp.clip((rank + 1) * per_rank, start, start + size)
    return lo - start, hi - lo, lo - rank * per_rank


def _check_ranks(ranks, where):
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise ValueError(f"{where}: ranks must be a positive int, got {ranks!r}")
    return int(ranks)


def shard_windows(shapes, ranks: int, split: str = "per_weight") -> np.ndarray:
    """Every rank's window of every weight: int32 ``(ranks, len(shapes), 2)`` of (offset, length)."""
    shapes = check_shapes(shapes, "shard_windows")
    ranks = _check_ranks(ranks, "shard_windows")
    _check_split(split, "shard_windows")
    r = np.arange(ranks, dtype=np.int64)
    out = np.zeros((ranks, len(shapes), 2), np.int64)
    for i, span in enumerate(_spans(shapes, ranks, split)):
        off, n, _ = _window(np, r, *span)
        out[:, i, 0], out[:, i, 1] = off, n
    return out.astype(np.int32)


def split_masters(weights, ranks: int, split: str = "per_weight"):
    """Host side: the sharded master buffers of full weights, ready to place with ``P(axis)``.

    ``"per_weight"``: a list with one ``(ranks, ceil(size / ranks))`` array per weight; ``"flat"``: one
    ``(ranks, ceil(total / ranks))`` array. Padding is zeros. Row r is rank r's buffer.
    """
    ranks = _check_ranks(ranks, "split_masters")
    _check_split(split, "split_masters")
    flats = [np.asarray(w).reshape(-1) for w in weights]
    spans = _spans([f.shape for f in flats], ranks, split)
    if split == "per_weight":
        return [np.pad(f, (0, ranks * L - f.size)).reshape(ranks, L) for f, (_, _, L) in zip(flats, spans)]
    dtype = np.result_type(*flats) if flats else np.float32
    buf = np.concatenate(flats).astype(dtype) if flats else np.zeros(0, dtype)
    L = spans[0][2] if spans else 1
    return np.pad(buf, (0, ranks * L - buf.size)).reshape(ranks, L)


def local_shards(local, shapes, axis_name, split: str = "per_weight"):
    """Inside ``shard_map``: this rank's shard of every weight and its window, ready for
    :func:`jax_fp8.distributed.quantize_master_weights` (``shards, offsets=..., lengths=...``).

    ``local`` is this rank's part of what :func:`split_masters` made: ``"per_weight"``: a list of flat
    (L_i,) buffers (a leading axis of 1, as shard_map hands a ``(ranks, L_i)`` array, is dropped);
    ``"flat"``: the rank's one flat buffer. Returns ``(shards, offsets, lengths)``; a flat-split
    shard is the rank's piece of the weight, zero-padded to the longest piece any rank holds.
    """
    shapes = check_shapes(shapes, "local_shards")
    _check_split(split, "local_shards")
    ranks = vma.axis_size(axis_name, "local_shards")
    rank = lax.axis_index(axis_name)
    spans = _spans(shapes, ranks, split)
    if split == "per_weight":
        if len(local) != len(shapes):
            raise ValueError(f"local_shards: {len(local)} local buffers but {len(shapes)} shapes")
        bufs = [jnp.reshape(b, (-1,)) for b in local]
        for i, (b, (_, _, L)) in enumerate(zip(bufs, spans)):
            if b.shape[0] != L:
                raise ValueError(f"local_shards: local[{i}] holds {b.shape[0]} elements, the per_weight split of "
                                 f"shape {shapes[i]} over {ranks} ranks gives {L}")
        wins = [_window(jnp, rank, *span)[:2] for span in spans]
        return bufs, [o.astype(jnp.int32) for o, _ in wins], [n.astype(jnp.int32) for _, n in wins]
    buf = jnp.reshape(local, (-1,))
    per_rank = spans[0][2] if spans else 1
    if buf.shape[0] != per_rank:
        raise ValueError(f"local_shards: the flat local buffer holds {buf.shape[0]} elements, the flat split of "
                         f"these shapes over {ranks} ranks gives {per_rank}")
    longest = max([min(n, per_rank) for _, n, _ in spans], default=0)
    padded = jnp.pad(buf, (0, longest))
    shards, offsets, lengths = [], [], []
    for span in spans:
        off, n, pos = _window(jnp, rank, *span)
        piece = min(span[1], per_rank)  # the most of this weight that one rank can hold
        shard = lax.dynamic_slice_in_dim(padded, pos, piece)
        shards.append(jnp.where(jnp.arange(piece) < n, shard, jnp.zeros((), shard.dtype)))
        offsets.append(off.astype(jnp.int32))
        lengths.append(n.astype(jnp.int32))
    return shards, offsets, lengths


def tiling_errors(windows: np.ndarray, lengths_held: Sequence[int], shapes) -> list[str]:
    """What is wrong with the windows of every weight over all ranks (empty when each weight is tiled
    exactly once). ``windows``: (ranks, N, 2) (offset, length) as passed; ``lengths_held``: each
    weight's shard buffer length. A window counts for the elements a rank really holds: from a
    non-negative offset, at most the buffer's length, cut at the weight's end (as the kernels read)."""
    errors = []
    for i, shape in enumerate(shapes):
        size = int(np.prod(shape, dtype=np.int64))
        off = windows[:, i, 0].astype(np.int64)
        n = np.clip(np.minimum(np.minimum(windows[:, i, 1].astype(np.int64), lengths_held[i]), size - off), 0, None)
        n = np.where(off < 0, 0, n)
        cover = np.zeros(size + 1, np.int64)
        for o, k in zip(off, n):
            if k > 0:
                cover[o] += 1
                cover[o + k] -= 1
        count = np.cumsum(cover)[:size]
        gaps, overlaps = np.flatnonzero(count == 0), np.flatnonzero(count > 1)
        if gaps.size or overlaps.size:
            what = []
            if gaps.size:
                what.append(f"{gaps.size} element(s) held by no rank (first: flat index {gaps[0]})")
            if overlaps.size:
                what.append(f"{overlaps.size} element(s) held by more than one rank (first: flat index {overlaps[0]})")
            wins = ", ".join(f"r{r}:({o}, {k})" for r, (o, k) in enumerate(zip(off, n)))
            errors.append(f"weight {i} of shape {tuple(shape)} ({size} elements): {'; '.join(what)}; "
                          f"windows held (offset, length) per rank: {wins}")
    return errors
