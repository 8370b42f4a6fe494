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

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import contracts
from ..arrays import bitcast, cdiv, xp_of
from ..formats import FLOAT8_BLOCK
from ..scheme import Scheme
from .contract import operand_scheme


def _compact_scales(data, scale, block):
    """An operand's GEMM-ready ``scale`` as its compact grid (ceil(rows/bm), ceil(K/128))."""
    rows, k = data.shape
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
