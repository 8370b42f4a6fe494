"""``jf_quantize`` and ``jf_dequantize`` primitives over (B, M, K) arrays, parameterised by a Scheme.

Lowering: our FFI kernels on ``cpu`` and ``cuda`` when their module is built, else (and on every
other platform) the jax.numpy reference, which defines the same numbers. The scheme reaches the FFI
handlers as one dictionary attribute, ``scheme`` (ffi_common.h's ``Scheme``).
"""
from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np

from .. import _ffi, reference
from .._compat import Primitive, ShapedArray, ad, apply_primitive, batching, ffi, mlir
from ..arrays import cdiv
from ..layout import Kernels
from ..vma import out_aval

# ---- quantize ----------------------------------------------------------------------------------
quantize_p = Primitive("jf_quantize")
quantize_p.multiple_results = True
quantize_p.def_impl(partial(apply_primitive, quantize_p))

_FFI_RESULTS = 4  # the FFI target always has two (data, scale) result slots; unused ones are empty


def _quantize_abstract(x, *, scheme):
    if x.ndim != 3:
        raise ValueError(f"jf_quantize takes a (batch, rows, cols) array, got shape {x.shape}")
    B, M, K = x.shape
    outs = []
    for data, scale in scheme.kernel_outputs((M, K)):
        outs += [out_aval((B, *data), np.uint8, x), out_aval((B, *scale), scheme.scale_dtype, x)]
    return outs


quantize_p.def_abstract_eval(_quantize_abstract)


def _quantize_ffi_lowering(ctx, x, *, scheme):
    n = len(ctx.avals_out)
    padded = list(ctx.avals_out) + [ShapedArray((0,), np.uint8)] * (_FFI_RESULTS - n)
    outs = ffi.ffi_lowering("jf_quantize")(ctx.replace(avals_out=padded), x, scheme=scheme.ffi_attrs())
    return outs[:n]


def _quantize_batch(args, dims, *, scheme):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    b, B = x.shape[:2]
    outs = quantize_p.bind(x.reshape(b * B, *x.shape[2:]), scheme=scheme)
    return [o.reshape(b, B, *o.shape[1:]) for o in outs], [0] * len(outs)


batching.primitive_batchers[quantize_p] = _quantize_batch

# ---- dequantize --------------------------------------------------------------------------------
dequantize_p = Primitive("jf_dequantize")
dequantize_p.def_impl(partial(apply_primitive, dequantize_p))


def _dequantize_abstract(data, scale, *, scheme, out_dtype):
    if data.ndim != 3 or scale.ndim != 3 or data.dtype != np.uint8:
        raise ValueError("jf_dequantize takes (batch, rows, cols) uint8 data and rank-3 scales")
    (bm, bk), = scheme.kernel_blocks
    B, M, K = data.shape
    if scale.shape != (B, cdiv(M, bm), cdiv(K, bk)) or scale.dtype != scheme.scale_dtype:
        raise ValueError(f"jf_dequantize: scales {scale.dtype}{scale.shape} do not match data {data.shape} with "
                         f"{bm}x{bk} blocks of {scheme.scale_dtype}")
    return out_aval(data.shape, out_dtype, data, scale)


dequantize_p.def_abstract_eval(_dequantize_abstract)


def _dequantize_ffi_lowering(ctx, data, scale, *, scheme, out_dtype):
    return ffi.ffi_lowering("jf_dequantize")(ctx, data, scale, scheme=scheme.ffi_attrs())


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
                        "estimator use jax_fp8.quantize_dequantize (dequantize(quantize(x)) with an identity "
                        "derivative).")
    return rule


ad.primitive_jvps[quantize_p] = _no_jvp("quantize")
ad.primitive_jvps[dequantize_p] = _no_jvp("dequantize")

# ---- lowering registration ---------------------------------------------------------------------
for _prim, _ffi_rule, _ref in ((quantize_p, _quantize_ffi_lowering, reference.quantize_usages),
                               (dequantize_p, _dequantize_ffi_lowering, reference.dequantize_blocks)):
    _ref_rule = mlir.lower_fun(_ref, multiple_results=_prim.multiple_results)
    mlir.register_lowering(_prim, _ref_rule)  # any platform without our kernels
    for _platform, _ok in _ffi.AVAILABLE.items():
        mlir.register_lowering(_prim, _ffi_rule if _ok else _ref_rule, platform=_platform)

#: The kernel set the public API runs on.
KERNELS = Kernels(quantize=quantize_p.bind, dequantize=dequantize_p.bind)
