"""FP8 element formats and argument validation shared by the API, the reference and the primitives."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

#: FP8 element dtypes, in the kernels' numbering (0 = E4M3, 1 = E5M2).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: Largest finite value of each FP8 format.
FP8_MAX = {FP8_DTYPES[0]: 448.0, FP8_DTYPES[1]: 57344.0}
#: High-precision dtypes accepted as input and produced by dequantize.
HIGH_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

MX_BLOCK = 32
FLOAT8_BLOCK = 128


def fp8_dtype(dtype, name: str = "dtype") -> jnp.dtype:
    """Validate an FP8 element dtype argument."""
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype!r}") from e
    if d not in FP8_DTYPES:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {d}")
    return d


def fp8_index(dtype) -> int:
    return FP8_DTYPES.index(jnp.dtype(dtype))


def high_dtype(dtype, name: str) -> jnp.dtype:
    """Validate a high-precision dtype (float32, bfloat16, float16)."""
    d = jnp.dtype(dtype)
    if d not in HIGH_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {d}")
    return d


def check_input(x, name: str = "x"):
    """Validate a tensor to quantize; return it as a jax array."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    high_dtype(x.dtype, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have rank >= 1 (it is viewed as 2-D: (prod(shape[:-1]), shape[-1])), got a scalar")
    return x


def view_2d(shape) -> tuple[int, int]:
    """The (rows, cols) 2-D view of an N-D shape."""
    return int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_finite(dtype) -> np.float32:
    """Largest finite value of a high-precision dtype, as fp32 (TE's value for an infinite scale)."""
    return np.float32(jnp.finfo(dtype).max)


def usage_blocks(row_block: int, col_block: int, tile_block: int) -> list[tuple[int, int]]:
    """The (bm, bk) block of each requested usage, in the kernels' output order: row, col, tile."""
    blocks = [(1, row_block), (col_block, 1), (tile_block, tile_block)]
    return [(bm, bk) for bm, bk in blocks if bm and bk]


def packed_grids(shapes, row_block: int, col_block: int, tile_block: int) -> list[list[tuple[int, tuple[int, int]]]]:
    """Where each weight's scale grids lie in a packed buffer: per weight (2-D shape (M, K)), per usage
    (row, col, tile order), the grid's first element and its shape. Weights follow one another."""
    at, out = 0, []
    for M, K in shapes:
        grids = []
        for bm, bk in usage_blocks(row_block, col_block, tile_block):
            shape = (cdiv(M, bm), cdiv(K, bk))
            grids.append((at, shape))
            at += shape[0] * shape[1]
        out.append(grids)
    return out


def unpack_grids(packed, grids) -> list:
    """One weight's scale grids, as 2-D arrays, out of a packed buffer (``grids``: that weight's entry
    of :func:`packed_grids`)."""
    return [packed[at:at + r * c].reshape(r, c) for at, (r, c) in grids]


def packed_size(layout) -> int:
    """Elements of a packed buffer laid out by :func:`packed_grids`."""
    return sum(r * c for grids in layout for _, (r, c) in grids)
