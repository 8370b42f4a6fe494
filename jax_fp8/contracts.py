"""The kernels' contracts in pure ``jax.numpy``: every number jax_fp8 produces is defined here.

The FFI kernels (CPU and CUDA) must equal these bit for bit: ``quantize_usages`` and
``dequantize_blocks`` are the contracts of ``jf_quantize`` / ``jf_dequantize`` (the fallback lowering
of those primitives), ``partial_amax_group`` / ``partial_cast_group`` those of the master-weight
primitives; above them, the per-block math they share with ``csrc/fp8_math.h`` (each format's scale
rule is its :class:`~jax_fp8.formats.Format`'s, in :mod:`jax_fp8.formats`).

They run on NumPy arrays too (see :mod:`jax_fp8.reference` for why that matters). ``jax_fp8.reference``
runs the public API on them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import groups
from .arrays import bitcast, cdiv, xp_of
from .formats import (FP8_MAX, block_scale_from_amax, e8m0_from_amax, e8m0_reciprocal, e8m0_to_float,
                      quiet as _quiet)
from .scheme import GEMM_SCALE_PAD, Scheme, unpack_grids

_F32 = jnp.float32
_CANONICAL_FP8_NAN = 0x7F

# the formats' scale math (defined in jax_fp8.formats) is part of this contract, so it is named here too
__all__ = ["block_amax", "block_scale_from_amax", "cast_to_fp8", "dequantize_blocks", "e8m0_from_amax",
           "e8m0_reciprocal", "e8m0_to_float", "expand_blocks", "partial_amax", "partial_amax_group",
           "partial_cast", "partial_cast_group", "quantize_blocks", "quantize_grouped_usages", "quantize_usages",
           "unshard"]


# ---- per-block math (mirrors jax_fp8/csrc/fp8_math.h) ---------------------------------------

def block_amax(x, bm: int, bk: int):
    """Amax of |x| over (bm, bk) blocks of the last two dims; NaN ignored, inf counts (as TE's fmaxf)."""
    xp = xp_of(x)
    a = xp.abs(x.astype(_F32))
    a = xp.where(xp.isnan(a), np.float32(0), a)
    *lead, M, K = a.shape
    sm, sk = cdiv(M, bm), cdiv(K, bk)
    pad = [(0, 0)] * len(lead) + [(0, sm * bm - M), (0, sk * bk - K)]
    a = xp.pad(a, pad).reshape(*lead, sm, bm, sk, bk)
    return a.max(axis=(-3, -1))


def cast_to_fp8(v, dtype):
    """Saturating round-to-nearest-even cast of fp32 ``v``; NaN becomes the canonical byte 0x7F."""
    xp = xp_of(v)
    m = np.float32(FP8_MAX[jnp.dtype(dtype)])
    data = bitcast(xp.clip(v, -m, m).astype(dtype), np.uint8)
    return xp.where(xp.isnan(v), np.uint8(_CANONICAL_FP8_NAN), data)


def expand_blocks(s, bm: int, bk: int, M: int, K: int):
    """Broadcast per-block values (..., ceil(M/bm), ceil(K/bk)) to elements (..., M, K)."""
    xp = xp_of(s)
    s = xp.repeat(s, bm, axis=-2)[..., :M, :]
    return xp.repeat(s, bk, axis=-1)[..., :K]


def _canonical_nan(y):
    xp = xp_of(y)
    return xp.where(xp.isnan(y), xp.asarray(np.nan, y.dtype), y)


# ---- kernel contract: same inputs and outputs as the primitives -------------------------------
def quantize_blocks(x, bm, bk, scheme: Scheme):
    """Quantize (..., M, K) with (bm, bk) blocks: (data as uint8 bytes, the format's stored scales)."""
    M, K = x.shape[-2:]
    stored, mult = scheme.format.scale_rule(scheme, x.dtype)(block_amax(x, bm, bk))
    with _quiet():
        scaled = x.astype(_F32) * expand_blocks(mult, bm, bk, M, K)
    return cast_to_fp8(scaled, scheme.dtype), stored


def quantize_usages(x, *, scheme: Scheme):
    """Every kernel output of (B, M, K) ``x``, in ``scheme.kernel_usages`` order: [data, scale, ...]
    (the primitive's contract). GEMM-ready outputs are the compact ones rearranged: columnwise data
    transposed to (B, K, M), scales as ``Scheme.scales_to_layout`` places them."""
    xp = xp_of(x)
    M, K = x.shape[-2:]
    outs = []
    for usage, (bm, bk) in zip(scheme.output_usages, scheme.kernel_blocks):
        data, scale = quantize_blocks(x, bm, bk, scheme)
        if scheme.gemm_ready:
            data = xp.swapaxes(data, -1, -2) if scheme.transposed_data(usage) else data
            scale = scheme.scales_to_layout(xp, scale, M, K, usage, "gemm_ready")
        outs += [data, scale]
    return outs


def dequantize_blocks(data, scale, *, scheme: Scheme, out_dtype):
    """data (..., M, K) uint8 FP8 bytes times the per-block scales of the scheme's one usage, rounded to
    ``out_dtype``."""
    (bm, bk), = scheme.kernel_blocks
    M, K = data.shape[-2:]
    values = bitcast(data, scheme.dtype).astype(_F32)
    s = scheme.format.dequantize_scale(scale)
    with _quiet():
        return _canonical_nan((values * expand_blocks(s, bm, bk, M, K)).astype(out_dtype))


# ---- rows in groups (jax_fp8.groups: lax.ragged_dot's groups) ------------------------------------
def _slot_amax(a, slot, n: int):
    """Max of the (M, K) |values| ``a`` over the rows of each of ``n`` slots (``slot``: each row's), (n, K);
    0 for a slot without rows."""
    if xp_of(a, slot) is np:
        out = np.zeros((n, a.shape[1]), np.float32)
        np.maximum.at(out, slot, a)
        return out
    return jnp.maximum(jax.ops.segment_max(a, slot, num_segments=n), np.float32(0))


def quantize_grouped_usages(x, group_sizes, *, scheme: Scheme):
    """``jf_quantize_grouped``: the (M, K) ``x``, its rows in the groups of ``group_sizes`` (G,) int32,
    quantized with GEMM-ready Float8 blockwise 1x128 ``scheme`` (in ``scheme.kernel_usages`` order):

    - rowwise (blocks along K, which never mix groups): :func:`quantize_usages`'s output, data (M, K)
      and scales (ceil(K/128), roundup(M, 4)), but rows in no group get data 0 and ``GEMM_SCALE_PAD``;
    - columnwise: blocks of 128 rows restarting at every group start (:mod:`jax_fp8.groups`), data
      (K, Mc) transposed, group g's rows in the columns from ``groups.col_starts``, 0 in every other
      column (Mc = ``groups.col_count(M, G)``); scales (S, roundup(K, 4)), one row per block slot
      (S = ``groups.block_slots(M, G, 128)``), ``GEMM_SCALE_PAD`` in unused slots and in the padding.
    """
    xp = xp_of(x, group_sizes)
    M, K = x.shape
    outs = []
    for usage in scheme.output_usages:
        if usage == "rowwise":
            data, scale = (o[0] for o in quantize_usages(x[None], scheme=scheme.only("rowwise")))
            grouped = groups.row_groups(group_sizes, M) < group_sizes.shape[0]
            in_group = xp.pad(grouped, [(0, scale.shape[1] - M)])  # scales (ceil(K/128), roundup(M, 4))
            outs += [xp.where(grouped[:, None], data, np.uint8(0)),
                     xp.where(in_group[None, :], scale, np.float32(GEMM_SCALE_PAD))]
            continue
        bm = scheme.usage_block(usage)[0]
        S = groups.block_slots(M, group_sizes.shape[0], bm)
        slot = groups.row_blocks(group_sizes, M, bm)  # S for a row in no group
        a = xp.abs(x.astype(_F32))
        amax = _slot_amax(xp.where(xp.isnan(a), np.float32(0), a), slot, S + 1)
        stored, mult = scheme.format.scale_rule(scheme, x.dtype)(amax)
        with _quiet():
            data = cast_to_fp8(x.astype(_F32) * mult[slot], scheme.dtype)
        cols = groups.row_cols(group_sizes, M)  # col_count for a row in no group: dropped
        Mc = groups.col_count(M, group_sizes.shape[0])
        if xp is np:
            placed = np.zeros((Mc + 1, K), np.uint8)
            placed[cols] = data
            data = placed[:Mc]
        else:
            data = jnp.zeros((Mc, K), np.uint8).at[cols].set(data, mode="drop")
        used = groups.slot_blocks(group_sizes, M, bm)[2] > 0
        scale = xp.where(used[:, None], stored[:S], np.float32(GEMM_SCALE_PAD))
        width = cdiv(K, scheme.scale_row_align) * scheme.scale_row_align
        scale = xp.pad(scale, [(0, 0), (0, width - K)], constant_values=np.float32(GEMM_SCALE_PAD))
        outs += [xp.swapaxes(data, 0, 1), scale]
    return outs


# ---- master-weight shards (jax_fp8.distributed) ----------------------------------------------
def unshard(shard, offset, length, M: int, K: int):
    """Place a flat shard's valid elements [offset, offset + length) into a zero (M, K) weight."""
    xp = xp_of(shard, offset, length)
    L = shard.shape[0]
    j = xp.arange(L)
    pos = offset + j
    valid = (j < length) & (pos < M * K)
    if xp is np:
        flat = np.zeros(M * K, shard.dtype)
        flat[pos[valid]] = shard[valid]
    else:
        flat = jnp.zeros(M * K, shard.dtype).at[jnp.where(valid, pos, M * K)].set(shard, mode="drop")
    return flat.reshape(M, K), pos, valid


def partial_amax(shard, offset, length, *, M, K, scheme: Scheme):
    """Per-block amax over the elements this shard holds (0 elsewhere), as the format's partial values
    (``Format.partial_value``: E8M0 bytes for MXFP8, fp32 amaxes for Float8 blockwise)."""
    full, _, _ = unshard(shard, offset, length, M, K)
    return [scheme.format.partial_value(block_amax(full, bm, bk), scheme) for bm, bk in scheme.kernel_blocks]


def partial_cast(shard, offset, length, *grids, M, K, scheme: Scheme):
    """Cast the shard's elements with the global (reduced partial) values: flat FP8 bytes per kernel
    block (0 past the valid elements), then, unless the reduced values are the scales
    (``Format.partials_are_scales``), each block's scale_inv grid."""
    xp = xp_of(shard, offset, length, *grids)
    full, pos, valid = unshard(shard, offset, length, M, K)
    datas, sinvs = [], []
    for (bm, bk), grid in zip(scheme.kernel_blocks, grids):
        sinv, mult = scheme.format.cast_from_global(grid, scheme, shard.dtype)
        if sinv is not None:
            sinvs.append(sinv)
        with _quiet():
            data = cast_to_fp8(full.astype(_F32) * expand_blocks(mult, bm, bk, M, K), scheme.dtype).reshape(-1)
        data = xp.concatenate([data, xp.zeros((1,), data.dtype)])  # index M*K: padding (and empty weights)
        datas.append(xp.where(valid, data[xp.where(valid, pos, M * K)], np.uint8(0)))
    return datas + sinvs


def _concat(xp, pieces, dtype):
    return xp.concatenate([p.reshape(-1) for p in pieces]) if pieces else xp.zeros((0,), dtype)


def partial_amax_group(windows, *shards, shapes, scheme: Scheme):
    """:func:`partial_amax` of every weight of a group (windows: (N, 2) int32 offset, length), packed
    into one buffer in the layout of ``Scheme.packed_grids``."""
    xp = xp_of(windows, *shards)
    grids = [g for (M, K), s, w in zip(shapes, shards, windows)
             for g in partial_amax(s, w[0], w[1], M=M, K=K, scheme=scheme)]
    return [_concat(xp, grids, scheme.format.partial_dtype)]


def partial_cast_group(windows, packed, *shards, shapes, scheme: Scheme):
    """:func:`partial_cast` of every weight of a group with the packed global values: every weight's
    data per kernel block, then, unless the reduced values are the scales, the packed scale_inv."""
    xp = xp_of(windows, packed, *shards)
    datas, sinvs = [], []
    for (M, K), s, w, grids in zip(shapes, shards, windows, scheme.packed_grids(shapes)):
        glob = unpack_grids(packed, grids)
        res = partial_cast(s, w[0], w[1], *glob, M=M, K=K, scheme=scheme)
        datas += res[:len(glob)]
        sinvs += res[len(glob):]
    return datas + ([] if scheme.format.partials_are_scales else [_concat(xp, sinvs, np.float32)])
