"""How quantized tensors map onto the kernels' arrays and back: the one place that turns a scheme and
an input into a tensor, and a tensor into high-precision values.

Written once and run over two kernel sets (``Kernels``): the primitives (FFI kernels) for the public
API and the pure-jax.numpy reference for ``jax_fp8.reference``. Kernels see (B, M, K) arrays; tensors
keep the input's N-D shape with 2-D scales of the (prod(shape[:-1]), shape[-1]) view.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
import jax.numpy as jnp

from .arrays import bitcast, cdiv, view_2d, xp_of
from .formats import check_input, high_dtype
from .scheme import Scheme
from .tensors import BlockwiseTensor, MXFP8Tensor


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A kernel set. ``quantize(x3, scheme=...)`` takes a (B, M, K) float array and returns, per kernel
    block of the scheme (``Scheme.kernel_blocks``), the FP8 data as uint8 (B, M, K) and the scale grid
    (B, ceil(M/bm), ceil(K/bk)). ``dequantize(data3, scale3, scheme=..., out_dtype=...)`` takes one
    usage's uint8 data and scales (``scheme`` holds just that usage) and returns (B, M, K) values."""

    quantize: Callable
    dequantize: Callable


def assemble(scheme: Scheme, pairs, shape, dtype):
    """The tensor of ``scheme`` from the kernels' (data, scale) pairs, given in kernel-block order; data
    already has ``shape`` and the FP8 dtype. 128x128 tiles serve both usages."""
    pairs = iter(pairs)
    if scheme.tiles:
        tile = next(pairs)
        row, col = (tile if scheme.rowwise else (None, None)), (tile if scheme.colwise else (None, None))
    else:
        row = next(pairs) if scheme.rowwise else (None, None)
        col = next(pairs) if scheme.colwise else (None, None)
    if scheme.e8m0:
        return MXFP8Tensor(*row, *col, tuple(shape), jnp.dtype(dtype), scheme.dtype)
    return BlockwiseTensor(*row, *col, tuple(shape), jnp.dtype(dtype), scheme.dtype, scheme.block,
                           scheme.pow2_scales, scheme.amax_epsilon)


def quantize(x, scheme: Scheme, kernels: Kernels):
    """Quantize ``x`` (validated here) with ``scheme`` on ``kernels``."""
    x = check_input(x)
    M, K = view_2d(x.shape)
    if x.size == 0:  # empty input: empty data and scales of the documented shapes
        xp = xp_of(x)
        pairs = [(xp.zeros(x.shape, scheme.dtype), xp.zeros((cdiv(M, bm), cdiv(K, bk)), scheme.scale_dtype))
                 for bm, bk in scheme.kernel_blocks]
    else:
        outs = kernels.quantize(x.reshape(1, M, K), scheme=scheme)
        pairs = [(bitcast(outs[2 * i].reshape(x.shape), scheme.dtype), outs[2 * i + 1][0])
                 for i in range(len(scheme.kernel_blocks))]
    return assemble(scheme, pairs, x.shape, x.dtype)


def dequantize(q, dtype, usage: Optional[str], kernels: Kernels):
    """``data * scale`` of one usage of ``q`` (default: rowwise when present), rounded to ``dtype``
    (default: the dtype that was quantized)."""
    if not isinstance(q, (MXFP8Tensor, BlockwiseTensor)):
        raise TypeError(f"dequantize: expected an MXFP8Tensor or BlockwiseTensor, got {type(q).__name__}")
    out_dtype = high_dtype(q.dtype if dtype is None else dtype, "dequantize: dtype")
    if usage is None:
        usage = "rowwise" if q.has_rowwise else "colwise"
    data, scale = q.usage_fields(usage, "dequantize")
    if data.size == 0:
        return xp_of(data).zeros(q.shape, out_dtype)
    M, K = view_2d(q.shape)
    y = kernels.dequantize(bitcast(data, jnp.uint8).reshape(1, M, K), scale[None], scheme=q.scheme.only(usage),
                           out_dtype=np.dtype(out_dtype))
    return y.reshape(q.shape)
