"""``jf_quantize`` and ``jf_dequantize`` primitives over (B, M, K) arrays.

Lowering: our FFI kernels on ``cpu`` and ``cuda`` when their module is built, else (and on every
other platform) the jax.numpy reference, which defines the same numbers.
"""
from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np

from .. import _ffi, reference
from .._compat import Primitive, ffi, ad, batching, mlir
from ..formats import cdiv, usage_blocks
from ..quantize import SCALE_E8M0, Kernels

from jax._src import dispatch as _dispatch  # apply_primitive: eager evaluation of a primitive
from jax.core import ShapedArray

# ---- quantize ----------------------------------------------------------------------------------
quantize_p = Primitive("jf_quantize")
quantize_p.multiple_results = True
quantize_p.def_impl(partial(_dispatch.apply_primitive, quantize_p))

_MAX_RESULTS = 4  # the FFI target always has row, col (or tile) data+scale slots


def _quantize_abstract(x, *, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps):
    if x.ndim != 3:
        raise ValueError(f"jf_quantize takes a (batch, rows, cols) array, got shape {x.shape}")
    B, M, K = x.shape
    sdt = np.uint8 if scale_kind == SCALE_E8M0 else np.float32
    outs = []
    for bm, bk in usage_blocks(row_block, col_block, tile_block):
        outs += [ShapedArray((B, M, K), np.uint8), ShapedArray((B, cdiv(M, bm), cdiv(K, bk)), sdt)]
    return outs


quantize_p.def_abstract_eval(_quantize_abstract)


def _quantize_ffi_lowering(ctx, x, **params):
    n = len(ctx.avals_out)
    padded = list(ctx.avals_out) + [ShapedArray((0,), np.uint8)] * (_MAX_RESULTS - n)
    attrs = {k: np.int64(params[k]) for k in ("fp8", "scale_kind", "row_block", "col_block", "tile_block")}
    outs = ffi.ffi_lowering("jf_quantize")(ctx.replace(avals_out=padded), x, pow2=np.bool_(params["pow2"]),
                                               eps=np.float32(params["eps"]), **attrs)
    return outs[:n]


def _quantize_reference(x, **params):
    return reference.quantize_usages(x, **params)


def _quantize_batch(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    b, B = x.shape[:2]
    outs = quantize_p.bind(x.reshape(b * B, *x.shape[2:]), **params)
    return [o.reshape(b, B, *o.shape[1:]) for o in outs], [0] * len(outs)


batching.primitive_batchers[quantize_p] = _quantize_batch

# ---- dequantize --------------------------------------------------------------------------------
dequantize_p = Primitive("jf_dequantize")
dequantize_p.def_impl(partial(_dispatch.apply_primitive, dequantize_p))


def _dequantize_abstract(data, scale, *, fp8, block_m, block_k, out_dtype):
    if data.ndim != 3 or scale.ndim != 3 or data.dtype != np.uint8:
        raise ValueError("jf_dequantize takes (batch, rows, cols) uint8 data and rank-3 scales")
    B, M, K = data.shape
    if scale.shape != (B, cdiv(M, block_m), cdiv(K, block_k)):
        raise ValueError(f"jf_dequantize: scales of shape {scale.shape} do not match data {data.shape} "
                         f"with {block_m}x{block_k} blocks")
    return ShapedArray(data.shape, out_dtype)


dequantize_p.def_abstract_eval(_dequantize_abstract)


def _dequantize_ffi_lowering(ctx, data, scale, *, fp8, block_m, block_k, out_dtype):
    return ffi.ffi_lowering("jf_dequantize")(ctx, data, scale, fp8=np.int64(fp8), block_m=np.int64(block_m),
                                                 block_k=np.int64(block_k))


def _dequantize_reference(data, scale, **params):
    return reference.dequantize_blocks(data, scale, **params)


def _dequantize_batch(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    data, scale = (jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
                   for a, d in zip(args, dims))
    b, B = data.shape[:2]
    y = dequantize_p.bind(data.reshape(b * B, *data.shape[2:]), scale.reshape(b * B, *scale.shape[2:]), **params)
    return y.reshape(b, B, *y.shape[1:]), 0


batching.primitive_batchers[dequantize_p] = _dequantize_batch


# ---- differentiation: not defined on the quantized representation -------------------------------
def _no_jvp(name):
    def rule(primals, tangents, **params):
        raise TypeError(f"{name} is not differentiable: FP8 data cannot carry a gradient. For a straight-through "
                        "estimator use jax_fp8.quantize_dequantize (dequantize(quantize(x)) with an identity VJP).")
    return rule


ad.primitive_jvps[quantize_p] = _no_jvp("quantize")
ad.primitive_jvps[dequantize_p] = _no_jvp("dequantize")

# ---- lowering registration ---------------------------------------------------------------------
for _prim, _ffi_rule, _ref in ((quantize_p, _quantize_ffi_lowering, _quantize_reference),
                               (dequantize_p, _dequantize_ffi_lowering, _dequantize_reference)):
    _ref_rule = mlir.lower_fun(_ref, multiple_results=_prim.multiple_results)
    mlir.register_lowering(_prim, _ref_rule)  # any platform without our kernels
    for _platform, _ok in _ffi.AVAILABLE.items():
        mlir.register_lowering(_prim, _ffi_rule if _ok else _ref_rule, platform=_platform)


def _quantize(x, **params):
    return quantize_p.bind(x, **params)


def _dequantize(data, scale, **params):
    return dequantize_p.bind(data, scale, **params)


#: The kernel set the public API runs on.
quantize_kernels = Kernels(_quantize, _dequantize)
