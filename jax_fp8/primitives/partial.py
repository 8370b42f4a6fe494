"""Primitives for master-weight shards: ``jf_partial_amax`` and ``jf_partial_cast``.

A shard is a flat buffer (L,) holding elements [offset, offset + length) of a row-major (M, K)
weight; offset and length are traced int32 scalars (they come from ``lax.axis_index``).
"""
from __future__ import annotations

from functools import partial

import numpy as np
from jax.core import ShapedArray
from jax._src import dispatch as _dispatch

from .. import _ffi, reference
from .._compat import Primitive, ffi, mlir
from ..formats import cdiv, usage_blocks

partial_amax_p = Primitive("jf_partial_amax")
partial_amax_p.multiple_results = True
partial_amax_p.def_impl(partial(_dispatch.apply_primitive, partial_amax_p))
partial_cast_p = Primitive("jf_partial_cast")
partial_cast_p.multiple_results = True
partial_cast_p.def_impl(partial(_dispatch.apply_primitive, partial_cast_p))

_INT_ATTRS = ("M", "K", "fp8", "scale_kind", "row_block", "col_block", "tile_block")


def _grids(M, K, scale_kind, row_block, col_block, tile_block, dtype=None):
    sdt = dtype or (np.uint8 if scale_kind == 0 else np.float32)
    return [ShapedArray((cdiv(M, bm), cdiv(K, bk)), sdt) for bm, bk in usage_blocks(row_block, col_block, tile_block)]


def _check_shard(shard, offset, length):
    if shard.ndim != 1:
        raise ValueError(f"a master-weight shard must be flat (rank 1), got shape {shard.shape}")
    if offset.shape != () or length.shape != () or offset.dtype != np.int32 or length.dtype != np.int32:
        raise ValueError("shard offset and length must be int32 scalars")


def _amax_abstract(shard, offset, length, *, M, K, fp8, scale_kind, row_block, col_block, tile_block):
    _check_shard(shard, offset, length)
    return _grids(M, K, scale_kind, row_block, col_block, tile_block)


def _cast_abstract(shard, offset, length, *grids, M, K, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps):
    _check_shard(shard, offset, length)
    want = _grids(M, K, scale_kind, row_block, col_block, tile_block)
    if [(g.shape, g.dtype) for g in grids] != [(w.shape, w.dtype) for w in want]:
        raise ValueError(f"partial cast: scale grids {[g.shape for g in grids]} do not match the weight ({M}, {K})")
    datas = [ShapedArray(shard.shape, np.uint8)] * len(want)
    sinvs = _grids(M, K, scale_kind, row_block, col_block, tile_block, np.float32) if scale_kind == 1 else []
    return datas + sinvs


partial_amax_p.def_abstract_eval(_amax_abstract)
partial_cast_p.def_abstract_eval(_cast_abstract)

_EMPTY = ShapedArray((0,), np.uint8)


def _pad(avals, n):
    return list(avals) + [_EMPTY] * (n - len(avals))


def _amax_ffi(ctx, shard, offset, length, **p):
    n = len(ctx.avals_out)
    outs = ffi.ffi_lowering("jf_partial_amax")(
        ctx.replace(avals_out=_pad(ctx.avals_out, 2)), shard, offset, length, **{k: np.int64(p[k]) for k in _INT_ATTRS})
    return outs[:n]


def _cast_ffi(ctx, shard, offset, length, *grids, pow2, eps, **p):
    nu = len(grids)
    grids = list(grids) + [mlir.ir_constant(np.zeros((0,), np.uint8))] * (2 - nu)
    datas, sinvs = ctx.avals_out[:nu], ctx.avals_out[nu:]
    avals_out = _pad(datas, 2) + _pad(sinvs, 2)
    outs = ffi.ffi_lowering("jf_partial_cast")(
        ctx.replace(avals_in=_pad(ctx.avals_in, 5), avals_out=avals_out), shard, offset, length, *grids,
        pow2=np.bool_(pow2), eps=np.float32(eps), **{k: np.int64(p[k]) for k in _INT_ATTRS})
    return list(outs[:nu]) + list(outs[2:2 + len(sinvs)])


for _prim, _ffi_rule, _ref in ((partial_amax_p, _amax_ffi, reference.partial_amax),
                               (partial_cast_p, _cast_ffi, reference.partial_cast)):
    _ref_rule = mlir.lower_fun(_ref, multiple_results=True)
    mlir.register_lowering(_prim, _ref_rule)
    for _platform, _ok in _ffi.AVAILABLE.items():
        mlir.register_lowering(_prim, _ffi_rule if _ok else _ref_rule, platform=_platform)
