"""The reference math: the one definition of the FP8 GEMM's numbers, which every backend's kernel
matches up to accumulation order and precision, and which computes a GEMM wherever no kernel runs
(the contract: :mod:`jax_fp8.gemm.contract`).

- Float8 blockwise (:func:`blocked_gemm`): per 128-wide K block, the fp32 product of the FP8 data
  (``Precision.HIGHEST``), scaled by the two blocks' scales after it, summed in fp32: it overflows only
  where a scaled partial product, a scale product or the sum does, as the tensor cores.
- MXFP8 (:func:`mx_gemm_reference`): a bf16 GEMM of the dequantized operands with fp32 accumulation.
  An FP8 value times a power-of-two E8M0 scale is exact in bf16 (fp32's exponent range, 8 significant
  bits >= E4M3's 4 and E5M2's 3) unless it lies below bf16's normal range (2**-126), and the product
  of two bf16 values is exact in fp32 (16 significant bits), so this computes the same products as an
  fp32 GEMM of the dequantized operands, at bf16's speed (a bf16 GEMM on a GPU's tensor cores).
- Operands that exist only as fp32 values (:func:`dense_gemm`): an fp32 dot at ``Precision.HIGHEST``.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import contracts, groups, vma
from ..arrays import bitcast, cdiv, xp_of
from ..formats import FLOAT8_BLOCK
from ..scheme import Scheme
from .contract import BLOCK_1D, BLOCK_2D, operand_scheme


def _compact_scales(data, scale, block):
    """An operand's GEMM-ready ``scale`` as its compact grid (ceil(rows/bm), ceil(K/128)) (a stack of
    operands (..., rows, K): each one's)."""
    rows, k = data.shape[-2:]
    return operand_scheme(block, data.dtype).scales_to_layout(xp_of(data, scale), scale, rows, k, "rowwise",
                                                               "compact")


def operand_values(data, scale, block):
    """fp32 values (rows, K) of a GEMM operand: FP8 ``data`` times its GEMM-ready block ``scale``."""
    scheme = operand_scheme(block, data.dtype)
    return contracts.dequantize_blocks(bitcast(data, np.uint8), _compact_scales(data, scale, block),
                                       scheme=scheme.only("rowwise"), out_dtype=np.float32)


def dense_gemm(a_values, b_values, c=None, *, out_dtype):
    """``a_values · b_valuesᵀ (+ c)`` in fp32 (``Precision.HIGHEST``), rounded to ``out_dtype``: for
    operands that exist only as fp32 values (FP8 operands: :func:`blocked_gemm`)."""
    out = lax.dot_general(a_values, b_values, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    if c is not None:
        out = out + c.astype(jnp.float32)
    return out.astype(out_dtype)


def blocked_gemm(a, a_scale, b, b_scale, c=None, *, a_block, b_block, out_dtype):
    """``a · bᵀ (+ c)`` of FP8 operands (``jf_fp8_gemm``'s contract, any shape) as the tensor-core GEMM
    forms it: per 128-wide K block kb, ``acc += (a_kb · b_kbᵀ) * (sa[:, kb] ⊗ sb[:, kb])``, the product
    of the unscaled FP8 data in fp32 at ``Precision.HIGHEST`` (at most 448² · 128 in size), scaled
    after it, accumulated in fp32; ``+ c`` in fp32; rounded to ``out_dtype``. A scan over the K
    blocks: memory O(M·N + (M + N)·K), not one (M, N) partial per block."""
    K = a.shape[1]
    nk = cdiv(K, FLOAT8_BLOCK)
    if nk == 0:  # nothing to contract: zeros (+ c)
        return dense_gemm(a.astype(jnp.float32), b.astype(jnp.float32), c, out_dtype=out_dtype)

    def k_blocks(data, scale, block):
        """(nk, rows, 128) FP8 data (K zero-padded: zeros add nothing) and (nk, rows) fp32 row scales."""
        rows = data.shape[0]
        s = jnp.repeat(jnp.asarray(_compact_scales(data, scale, block), jnp.float32), block[0], axis=0)[:rows]
        if K != nk * FLOAT8_BLOCK:
            data = jnp.pad(data, ((0, 0), (0, nk * FLOAT8_BLOCK - K)))
        return jnp.swapaxes(jnp.reshape(data, (rows, nk, FLOAT8_BLOCK)), 0, 1), s.T

    def scaled_partial(ak, sa, bk, sb):
        part = lax.dot_general(ak.astype(jnp.float32), bk.astype(jnp.float32), (((1,), (1,)), ((), ())),
                               precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return part * (sa[:, None] * sb[None, :])

    xs = (*k_blocks(a, a_scale, a_block), *k_blocks(b, b_scale, b_block))
    # block 0 starts the sum: the carry then has the operands' type (shard_map's varying axes)
    acc, _ = lax.scan(lambda acc, blk: (acc + scaled_partial(*blk), None), scaled_partial(*(x[0] for x in xs)),
                      tuple(x[1:] for x in xs))
    if c is not None:
        acc = acc + c.astype(jnp.float32)
    return acc.astype(out_dtype)


# ---- grouped (lax.ragged_dot's groups, jax_fp8.groups) --------------------------------------------------
def ragged_blocked_gemm(a, a_scale, b, b_scale, group_sizes, group_offset=0, *, out_dtype):
    """The M-grouped GEMM ``out[r] = a[r] · b[g - group_offset]ᵀ`` for each row r of a group g among the
    Gl from ``group_offset`` (every other row: 0), of FP8 ``a`` (M, K) with GEMM-ready 1x128 scales and
    ``b`` (Gl, N, K) with each group's GEMM-ready 128x128 tile scales (Gl, ceil(N/128),
    roundup(ceil(K/128), 4)): per 128-wide K block, the fp32 product of the unscaled data
    (``lax.ragged_dot`` at ``Precision.HIGHEST``) times the two blocks' scales, summed in fp32 in K-block
    order, as :func:`blocked_gemm` for each group's rows."""
    M, K = a.shape
    Gl, N = b.shape[:2]
    G = group_sizes.shape[0]
    nk = cdiv(K, FLOAT8_BLOCK)
    if nk == 0 or Gl == 0 or G == 0:
        return vma.match(jnp.zeros((M, N), out_dtype), a, a_scale, b, b_scale, group_sizes)[0]
    starts, ends = groups.group_bounds(group_sizes, M)
    offset = jnp.asarray(group_offset, jnp.int32)
    idx = offset + jnp.arange(Gl, dtype=jnp.int32)
    valid = (idx >= 0) & (idx < G)
    local = jnp.where(valid, (ends - starts)[jnp.clip(idx, 0, G - 1)], 0)  # clamped: what lax.ragged_dot is given
    lo = jnp.concatenate([starts, ends[-1:]])[jnp.clip(offset, 0, G)]  # the local groups' first row
    # the rows before and after the local groups: two groups of zero weights (and masked below)
    sizes = jnp.concatenate([lo[None], local, (M - lo - local.sum())[None]]).astype(jnp.int32)
    g = groups.row_groups(group_sizes, M)
    j = g - offset  # each row's local group
    inside = ((g < G) & (j >= 0) & (j < Gl))[:, None]
    sa = jnp.asarray(_compact_scales(a, a_scale, BLOCK_1D), jnp.float32)  # (M, nk)
    # each row's group's tile scales
    sb = jnp.asarray(_compact_scales(b, b_scale, BLOCK_2D), jnp.float32)[jnp.clip(j, 0, Gl - 1)]  # (M, ceil(N/128), nk)
    pad = nk * FLOAT8_BLOCK - K
    a_k = jnp.swapaxes(jnp.pad(a, ((0, 0), (0, pad))).reshape(M, nk, FLOAT8_BLOCK), 0, 1)  # (nk, M, 128)
    b_k = jnp.moveaxis(jnp.pad(b, ((1, 1), (0, 0), (0, pad))).reshape(Gl + 2, N, nk, FLOAT8_BLOCK), 2, 0)  # (nk, Gl + 2, N, 128)

    def scaled_partial(ak, bk, sak, sbk):
        part = lax.ragged_dot(ak.astype(jnp.float32), jnp.swapaxes(bk, 1, 2).astype(jnp.float32), sizes,
                              precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        scale = sak[:, None] * jnp.repeat(sbk, FLOAT8_BLOCK, axis=1)[:, :N]
        return jnp.where(inside, part * scale, np.float32(0))

    xs = (a_k, b_k, sa.T, jnp.moveaxis(sb, 2, 0))
    acc, _ = lax.scan(lambda acc, blk: (acc + scaled_partial(*blk), None), scaled_partial(*(x[0] for x in xs)),
                      tuple(x[1:] for x in xs))
    return acc.astype(out_dtype)


def ragged_wgrad_gemm(a, a_scale, b, b_scale, group_sizes, group_offset=0, *, rows: int, groups_out: Optional[int] = None,
                      out_dtype):
    """The K-grouped GEMM ``out[j] = a[:, cols of g] · b[:, cols of g]ᵀ`` (Gl, R, N), g = ``group_offset``
    + j, of FP8 ``a`` (R, Mc) and ``b`` (N, Mc), contracted over each group's rows (of M = ``rows``; a
    weight gradient: xᵀ · dy per expert), both in blocks of 128 rows restarting at every group start with
    one scale row per block slot (S, roundup(R or N, 4)), group g's rows in the columns from
    ``groups.col_starts`` (:func:`jax_fp8.quantization.quantize_grouped`'s columnwise usage): per block,
    the fp32 product of the unscaled data at ``Precision.HIGHEST`` times the two blocks' scales, summed
    in fp32 in block order from 0 (an empty or absent group: 0). Gl = ``groups_out`` (default: G)."""
    R = a.shape[0]
    N = b.shape[0]
    G = group_sizes.shape[0]
    Gl = G if groups_out is None else groups_out
    slot_group, row0, n_rows = groups.slot_blocks(group_sizes, rows, FLOAT8_BLOCK)
    S = slot_group.shape[0]
    acc = vma.match(jnp.zeros((Gl, R, N), jnp.float32), a, a_scale, b, b_scale, group_sizes)[0]
    if S == 0 or Gl == 0:
        return acc.astype(out_dtype)
    starts, _ = groups.group_bounds(group_sizes, rows)
    col0 = jnp.where(n_rows > 0, groups.col_starts(group_sizes, rows)[slot_group] + row0 - starts[slot_group], 0)
    j = slot_group - jnp.asarray(group_offset, jnp.int32)
    n_rows = jnp.where((j >= 0) & (j < Gl), n_rows, 0)  # another shard's group: none of this one's rows
    a_p, b_p = (jnp.pad(v, ((0, 0), (0, FLOAT8_BLOCK))) for v in (a, b))  # a block's slice never clamps
    lane = jnp.arange(FLOAT8_BLOCK)

    def block(acc, s):
        jl, c0, n, sa, sb = s
        ak, bk = (jnp.where(lane < n, lax.dynamic_slice_in_dim(v, c0, FLOAT8_BLOCK, axis=1).astype(jnp.float32),
                            np.float32(0)) for v in (a_p, b_p))
        part = lax.dot_general(ak, bk, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
        scaled = jnp.where(n > 0, part * (sa[:, None] * sb[None, :]), np.float32(0))
        jl = jnp.clip(jl, 0, Gl - 1)
        return lax.dynamic_update_index_in_dim(acc, acc[jl] + scaled, jl, axis=0), None

    scales = (jnp.asarray(a_scale, jnp.float32)[:, :R], jnp.asarray(b_scale, jnp.float32)[:, :N])
    acc, _ = lax.scan(block, acc, (j, col0, n_rows, *scales))
    return acc.astype(out_dtype)


# ---- MXFP8 -------------------------------------------------------------------------------------------
def mx_values(data, scale, dtype=np.float32):
    """Values (rows, K) of an MXFP8 operand as ``dtype``: ``data`` times its per-32 E8M0 ``scale``
    (exact in fp32; in bf16 exact above 2**-126, see :func:`mx_gemm_reference`)."""
    scheme = Scheme("mxfp8", data.dtype, rowwise=True, colwise=False)
    values = contracts.dequantize_blocks(bitcast(data, np.uint8), scale, scheme=scheme, out_dtype=np.float32)
    return values if np.dtype(dtype) == np.float32 else values.astype(dtype)


def mx_gemm_reference(a, a_scale, b, b_scale, c=None, *, out_dtype):
    """``a · bᵀ (+ c)`` of MXFP8 operands: a bf16 GEMM of the dequantized operands with fp32
    accumulation (``preferred_element_type=float32``), ``+ c`` in fp32, rounded to ``out_dtype``.

    Error bound against the exact product of the dequantized operands ã, b̃ (fp64): every ã, b̃ with
    |v| >= 2**-126 is exact in bf16 (an FP8 significand of <= 4 bits times a power of two inside
    bf16's exponent range; overflow to inf is fp32's too); a smaller one rounds to bf16's subnormal
    grid (spacing 2**-133), or flushes to zero where the runtime flushes subnormals (XLA on CPU does,
    for the fp32 values too), an error below 2**-126 per element. Products of bf16 values are exact in
    fp32, so the result is within ``sum_k (|ã_k| + |b̃_k|) * 2**-126 + 2**-252`` per element plus the
    fp32 accumulation bound of the contraction (the same as an fp32 GEMM's), then one rounding to
    ``out_dtype``. NaN and inf propagate as in any dot."""
    out = lax.dot_general(mx_values(a, a_scale, jnp.bfloat16), mx_values(b, b_scale, jnp.bfloat16),
                          (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if c is not None:
        out = out + c.astype(jnp.float32)
    return out.astype(out_dtype)
