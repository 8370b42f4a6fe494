"""Pure ``jax.numpy`` definitions of every number jax_fp8 produces.

The FFI kernels (CPU and CUDA) must equal these bit for bit. The functions at the bottom
(``quantize_mxfp8``, ``quantize_blockwise``, ``dequantize``, ``e8m0_from_amax``) mirror the public API.

Every function here also runs on NumPy arrays (it then computes with NumPy, same code). That matters
for subnormals: XLA's CPU runtime flushes subnormal operands and results to zero (FTZ/DAZ), whatever
``--xla_cpu_ftz`` says, while the definition is IEEE (as XLA on GPU and our kernels compute). Evaluate
the reference on NumPy inputs (or on a GPU) when subnormal intermediates must be exact.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax import lax

from .formats import FP8_DTYPES, FP8_MAX, cdiv, packed_grids, unpack_grids, usage_blocks

_F32 = jnp.float32
_CANONICAL_FP8_NAN = 0x7F


def xp_of(*arrays):
    """The array namespace to compute in: NumPy when every input is a NumPy array, else jax.numpy."""
    return np if all(isinstance(a, (np.ndarray, np.generic)) for a in arrays) else jnp


def bitcast(a, dtype):
    """Reinterpret the bits of ``a`` as ``dtype`` (same item size), in ``a``'s namespace."""
    if isinstance(a, (np.ndarray, np.generic)):
        return np.asarray(a).view(dtype)
    return lax.bitcast_convert_type(a, dtype)


def _bits(v):
    return bitcast(v.astype(_F32), jnp.uint32)


def _from_bits(u):
    return bitcast(u.astype(jnp.uint32), _F32)


# ---- per-block math (mirrors jax_fp8/cuda/fp8_math.h) ---------------------------------------
def _quiet():
    """NumPy path: inf and NaN are expected values here, not errors."""
    return np.errstate(divide="ignore", over="ignore", invalid="ignore")


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


def e8m0_from_amax(amax, dtype=jnp.float8_e4m3fn):
    """E8M0 scale (uint8, biased 127) of a block amax, TE's float_to_e8m0(amax * (1/fp8_max))."""
    xp = xp_of(amax)
    rcp = np.float32(1.0) / np.float32(FP8_MAX[jnp.dtype(dtype)])
    with _quiet():
        v = xp.asarray(amax).astype(_F32) * rcp
    bits = _bits(v)
    exp = (bits >> 23) & np.uint32(0xFF)
    mant = bits & np.uint32(0x7FFFFF)
    bump = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    e = exp + bump.astype(np.uint32)
    e = xp.where(v == 0, np.uint32(0), e)
    e = xp.where(xp.isinf(v), np.uint32(0xFE), e)
    e = xp.where(xp.isnan(v), np.uint32(0xFF), e)
    return e.astype(np.uint8)


def e8m0_reciprocal(e):
    """Multiplier 2**(127 - e) applied before the cast (1.0 for e == 0), as fp32."""
    e = e.astype(np.int32)
    return xp_of(e).where(e == 0, np.float32(1.0), _from_bits(((254 - e) << 23).astype(np.uint32)))


def e8m0_to_float(e):
    """Dequantization scale 2**(e - 127): 2**-127 for e == 0, NaN for 0xFF."""
    xp = xp_of(e)
    e32 = e.astype(np.uint32)
    v = xp.where(e32 == 0, np.float32(2.0**-127), _from_bits(e32 << 23))
    return xp.where(e32 == 0xFF, np.float32(np.nan), v)


def block_scale_from_amax(amax, dtype, pow2: bool, eps: float, inf_value):
    """Float8 blockwise scale, TE's compute_scale_from_amax (returns the multiplier ``scale``)."""
    xp = xp_of(amax)
    amax = amax.astype(_F32)
    amax = xp.where(amax < np.float32(eps), np.float32(eps), amax)
    with _quiet():
        scale = np.float32(FP8_MAX[jnp.dtype(dtype)]) / amax
    scale = xp.where(xp.isinf(scale), np.float32(inf_value), scale)
    if pow2:
        scale = _from_bits(_bits(scale) & np.uint32(0xFF800000))
    trivial = xp.isinf(amax) | (amax == 0) | xp.isnan(amax)
    return xp.where(trivial, np.float32(1.0), scale)


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
def quantize_blocks(x, bm, bk, *, fp8, scale_kind, pow2=True, eps=0.0):
    """Quantize (..., M, K) with (bm, bk) blocks: (data as uint8 bytes, scales uint8 or fp32)."""
    dtype = FP8_DTYPES[fp8]
    M, K = x.shape[-2:]
    amax = block_amax(x, bm, bk)
    if scale_kind == 0:
        stored = e8m0_from_amax(amax, dtype)
        mult = e8m0_reciprocal(stored)
    else:
        mult = block_scale_from_amax(amax, dtype, pow2, eps, np.float32(jnp.finfo(x.dtype).max))
        stored = np.float32(1.0) / mult
    with _quiet():
        scaled = x.astype(_F32) * expand_blocks(mult, bm, bk, M, K)
    return cast_to_fp8(scaled, dtype), stored


def quantize_usages(x, *, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps):
    """All requested usages of (B, M, K) ``x``, in the order row, col, tile (the primitive's contract)."""
    outs = []
    for bm, bk in ((1, row_block), (col_block, 1), (tile_block, tile_block)):
        if bm and bk:
            outs += quantize_blocks(x, bm, bk, fp8=fp8, scale_kind=scale_kind, pow2=pow2, eps=eps)
    return outs


def dequantize_blocks(data, scale, *, fp8, block_m, block_k, out_dtype):
    """data (..., M, K) uint8 FP8 bytes times per-block scales, rounded to ``out_dtype``."""
    M, K = data.shape[-2:]
    values = bitcast(data, FP8_DTYPES[fp8]).astype(_F32)
    s = e8m0_to_float(scale) if scale.dtype == np.uint8 else scale.astype(_F32)
    with _quiet():
        return _canonical_nan((values * expand_blocks(s, block_m, block_k, M, K)).astype(out_dtype))


# ---- public API mirror ----------------------------------------------------------------------
def _kernels():
    from .quantize import Kernels

    return Kernels(quantize_usages, dequantize_blocks)


def quantize_mxfp8(x, dtype=jnp.float8_e4m3fn, rowwise=True, colwise=False):
    """Reference of :func:`jax_fp8.quantize_mxfp8`."""
    from .quantize import build_mxfp8

    return build_mxfp8(x, dtype, rowwise, colwise, _kernels())


def quantize_blockwise(x, block=(1, 128), dtype=jnp.float8_e4m3fn, pow2_scales=True, amax_epsilon=0.0,
                       colwise=False, rowwise=True):
    """Reference of :func:`jax_fp8.quantize_blockwise`."""
    from .quantize import build_blockwise

    return build_blockwise(x, block, dtype, pow2_scales, amax_epsilon, colwise, rowwise, _kernels())


def dequantize(q, dtype=None, usage=None):
    """Reference of :func:`jax_fp8.dequantize`."""
    from .quantize import dequantize_tensor

    return dequantize_tensor(q, dtype, usage, _kernels())


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


def partial_amax(shard, offset, length, *, M, K, fp8, scale_kind, row_block, col_block, tile_block):
    """Per-block amax over the elements this shard holds (0 elsewhere): E8M0 bytes, or fp32 amaxes."""
    full, _, _ = unshard(shard, offset, length, M, K)
    outs = []
    for bm, bk in usage_blocks(row_block, col_block, tile_block):
        amax = block_amax(full, bm, bk)
        outs.append(e8m0_from_amax(amax, FP8_DTYPES[fp8]) if scale_kind == 0 else amax)
    return outs


def partial_cast(shard, offset, length, *grids, M, K, fp8, scale_kind, row_block, col_block, tile_block, pow2, eps):
    """Cast the shard's elements with the global scales (E8M0 bytes or fp32 amaxes): flat FP8 bytes per
    usage (0 past the valid elements), then, for fp32 scales, each usage's scale_inv grid."""
    xp = xp_of(shard, offset, length, *grids)
    dtype = FP8_DTYPES[fp8]
    full, pos, valid = unshard(shard, offset, length, M, K)
    datas, sinvs = [], []
    for (bm, bk), grid in zip(usage_blocks(row_block, col_block, tile_block), grids):
        if scale_kind == 0:
            mult = e8m0_reciprocal(grid)
        else:
            mult = block_scale_from_amax(grid, dtype, pow2, eps, np.float32(jnp.finfo(shard.dtype).max))
            sinvs.append(np.float32(1.0) / mult)
        with _quiet():
            data = cast_to_fp8(full.astype(_F32) * expand_blocks(mult, bm, bk, M, K), dtype).reshape(-1)
        data = xp.concatenate([data, xp.zeros((1,), data.dtype)])  # index M*K: padding (and empty weights)
        datas.append(xp.where(valid, data[xp.where(valid, pos, M * K)], np.uint8(0)))
    return datas + sinvs


def _concat(xp, pieces, dtype):
    return xp.concatenate([p.reshape(-1) for p in pieces]) if pieces else xp.zeros((0,), dtype)


def partial_amax_group(windows, *shards, shapes, fp8, scale_kind, row_block, col_block, tile_block):
    """:func:`partial_amax` of every weight of a group (windows: (N, 2) int32 offset, length), packed
    into one buffer in the layout of ``formats.packed_grids``."""
    xp = xp_of(windows, *shards)
    grids = [g for (M, K), s, w in zip(shapes, shards, windows)
             for g in partial_amax(s, w[0], w[1], M=M, K=K, fp8=fp8, scale_kind=scale_kind, row_block=row_block,
                                   col_block=col_block, tile_block=tile_block)]
    return [_concat(xp, grids, np.uint8 if scale_kind == 0 else np.float32)]


def partial_cast_group(windows, packed, *shards, shapes, fp8, scale_kind, row_block, col_block, tile_block, pow2,
                       eps):
    """:func:`partial_cast` of every weight of a group with the packed global values: every weight's
    data per usage, then, for fp32 scales, the packed scale_inv."""
    xp = xp_of(windows, packed, *shards)
    datas, sinvs = [], []
    for (M, K), s, w, grids in zip(shapes, shards, windows, packed_grids(shapes, row_block, col_block, tile_block)):
        glob = unpack_grids(packed, grids)
        res = partial_cast(s, w[0], w[1], *glob, M=M, K=K, fp8=fp8, scale_kind=scale_kind, row_block=row_block,
                           col_block=col_block, tile_block=tile_block, pow2=pow2, eps=eps)
        datas += res[:len(glob)]
        sinvs += res[len(glob):]
    return datas + ([_concat(xp, sinvs, np.float32)] if scale_kind == 1 else [])
