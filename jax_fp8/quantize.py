"""Shape, layout and argument logic of the public quantize/dequantize functions.

Written once and run over two kernel sets: the primitives (FFI kernels) for the public API and the
pure-jax.numpy reference for ``jax_fp8.reference``. Kernels see (B, M, K) arrays; tensors keep the
input's N-D shape with 2-D scales of the (prod(shape[:-1]), shape[-1]) view.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np
import jax.numpy as jnp

from .reference import bitcast, xp_of
from .formats import (FLOAT8_BLOCK, MX_BLOCK, cdiv, check_input, fp8_dtype, fp8_index, high_dtype,
                      usage_blocks, view_2d)
from .tensors import BlockwiseTensor, MXFP8Tensor

SCALE_E8M0, SCALE_FP32 = 0, 1
BLOCKWISE_BLOCKS = ((1, FLOAT8_BLOCK), (FLOAT8_BLOCK, FLOAT8_BLOCK))


@dataclasses.dataclass(frozen=True)
class Kernels:
    """quantize(x3, **params) -> [data, scale, ...]; dequantize(data3, scale3, **params) -> y3."""

    quantize: Callable
    dequantize: Callable


def _quantize(x, kernels: Kernels, fp8, **params):
    """Run the kernel over the 2-D view of ``x``; returns [(fp8 data of x.shape, 2-D scale), ...]."""
    M, K = view_2d(x.shape)
    blocks = usage_blocks(params["row_block"], params["col_block"], params["tile_block"])
    sdt = jnp.uint8 if params["scale_kind"] == SCALE_E8M0 else jnp.float32
    if x.size == 0:  # empty input: empty data and scales of the documented shapes
        xp = xp_of(x)
        return [(xp.zeros(x.shape, fp8), xp.zeros((cdiv(M, bm), cdiv(K, bk)), sdt)) for bm, bk in blocks]
    outs = kernels.quantize(x.reshape(1, M, K), fp8=fp8_index(fp8), **params)
    return [(bitcast(outs[2 * i].reshape(x.shape), fp8), outs[2 * i + 1][0])
            for i in range(len(blocks))]


def usage_params(fmt: str, rowwise: bool, colwise: bool, block=(1, FLOAT8_BLOCK)) -> dict:
    """The kernels' scale kind and per-usage blocks for a format and the usages asked for."""
    if fmt == "mxfp8":
        return dict(scale_kind=SCALE_E8M0, row_block=MX_BLOCK if rowwise else 0,
                    col_block=MX_BLOCK if colwise else 0, tile_block=0)
    if tuple(block) == (FLOAT8_BLOCK, FLOAT8_BLOCK):  # one set of tiles serves both usages
        return dict(scale_kind=SCALE_FP32, row_block=0, col_block=0, tile_block=FLOAT8_BLOCK)
    return dict(scale_kind=SCALE_FP32, row_block=FLOAT8_BLOCK if rowwise else 0,
                col_block=FLOAT8_BLOCK if colwise else 0, tile_block=0)


def assemble(fmt: str, pairs, rowwise: bool, colwise: bool, shape, dtype, fp8, block=(1, FLOAT8_BLOCK),
             pow2_scales: bool = True, amax_epsilon: float = 0.0):
    """Build the tensor from the kernels' (data, scale) pairs, given in usage_params' order."""
    pairs = iter(pairs)
    if tuple(block) == (FLOAT8_BLOCK, FLOAT8_BLOCK) and fmt == "blockwise":
        tile = next(pairs)
        row, col = (tile if rowwise else (None, None)), (tile if colwise else (None, None))
    else:
        row = next(pairs) if rowwise else (None, None)
        col = next(pairs) if colwise else (None, None)
    if fmt == "mxfp8":
        return MXFP8Tensor(*row, *col, tuple(shape), jnp.dtype(dtype), fp8)
    return BlockwiseTensor(*row, *col, tuple(shape), jnp.dtype(dtype), fp8, tuple(block), bool(pow2_scales),
                           float(amax_epsilon))


def check_block(block, where: str) -> tuple:
    """Validate a Float8 blockwise block shape."""
    try:
        block = tuple(int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: block must be (1, 128) or (128, 128), got {block!r}") from None
    if block not in BLOCKWISE_BLOCKS:
        raise ValueError(f"{where}: block must be (1, 128) or (128, 128), got {block}")
    return block


def check_amax_epsilon(amax_epsilon, where: str) -> float:
    """Validate a Float8 blockwise amax epsilon (a finite float >= 0)."""
    try:
        eps = float(amax_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: amax_epsilon must be a finite float >= 0, got {amax_epsilon!r}") from None
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"{where}: amax_epsilon must be finite and >= 0, got {amax_epsilon}")
    return eps


def build_mxfp8(x, dtype, rowwise: bool, colwise: bool, kernels: Kernels) -> MXFP8Tensor:
    x = check_input(x)
    fp8 = fp8_dtype(dtype)
    if not (rowwise or colwise):
        raise ValueError("quantize_mxfp8: at least one of rowwise, colwise must be True")
    pairs = _quantize(x, kernels, fp8, **usage_params("mxfp8", rowwise, colwise), pow2=False, eps=0.0)
    return assemble("mxfp8", pairs, rowwise, colwise, x.shape, x.dtype, fp8)


def build_blockwise(x, block, dtype, pow2_scales: bool, amax_epsilon: float, colwise: bool, rowwise: bool,
                    kernels: Kernels) -> BlockwiseTensor:
    x = check_input(x)
    fp8 = fp8_dtype(dtype)
    block = check_block(block, "quantize_blockwise")
    eps = check_amax_epsilon(amax_epsilon, "quantize_blockwise")
    if not (rowwise or colwise):
        raise ValueError("quantize_blockwise: at least one of rowwise, colwise must be True")
    pairs = _quantize(x, kernels, fp8, **usage_params("blockwise", rowwise, colwise, block),
                      pow2=bool(pow2_scales), eps=eps)
    return assemble("blockwise", pairs, rowwise, colwise, x.shape, x.dtype, fp8, block, pow2_scales, eps)


def dequantize_tensor(q, dtype, usage: Optional[str], kernels: Kernels):
    if not isinstance(q, (MXFP8Tensor, BlockwiseTensor)):
        raise TypeError(f"dequantize: expected an MXFP8Tensor or BlockwiseTensor, got {type(q).__name__}")
    out_dtype = high_dtype(q.dtype if dtype is None else dtype, "dequantize: dtype")
    if usage is None:
        usage = "rowwise" if q.has_rowwise else "colwise"
    data, scale = q.usage_fields(usage, "dequantize")
    bm, bk = q.usage_blocks()[usage]
    if data.size == 0:
        return xp_of(data).zeros(q.shape, out_dtype)
    M, K = view_2d(q.shape)
    y = kernels.dequantize(bitcast(data, jnp.uint8).reshape(1, M, K), scale[None],
                           fp8=fp8_index(q.fp8_dtype), block_m=bm, block_k=bk, out_dtype=np.dtype(out_dtype))
    return y.reshape(q.shape)
