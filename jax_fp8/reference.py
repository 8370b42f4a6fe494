"""``jax_fp8.reference``: the public quantize API computed by the kernels' jax.numpy contracts
(:mod:`jax_fp8.contracts`), which define every number jax_fp8 produces. The FFI kernels (CPU
and CUDA) equal these bit for bit.

Every function also runs on NumPy arrays (it then computes with NumPy, same code). That matters for
subnormals: XLA's CPU runtime flushes subnormal operands and results to zero (FTZ/DAZ), whatever
``--xla_cpu_ftz`` says, while the definition is IEEE (as XLA on GPU and our kernels compute). Evaluate
the reference on NumPy inputs (or on a GPU) when subnormal intermediates must be exact.
"""
from __future__ import annotations

import jax.numpy as jnp

from . import quantization
from .contracts import (block_amax, block_scale_from_amax, cast_to_fp8, dequantize_blocks, e8m0_from_amax,
                      e8m0_reciprocal, e8m0_to_float, expand_blocks, partial_amax, partial_amax_group, partial_cast,
                      partial_cast_group, quantize_blocks, quantize_usages)
from .scheme import Scheme, build_scheme


def quantize(x, scheme: Scheme):
    """Reference of :func:`jax_fp8.quantize`."""
    return quantization.quantize(x, scheme, quantization.CONTRACTS)


def quantize_mxfp8(x, dtype=jnp.float8_e4m3fn, rowwise=True, colwise=False, layout="compact"):
    """Reference of :func:`jax_fp8.quantize_mxfp8`."""
    return quantize(x, build_scheme("reference.quantize_mxfp8", "mxfp8", dtype, rowwise=rowwise, colwise=colwise,
                                    layout=layout))


def quantize_blockwise(x, block=(1, 128), dtype=jnp.float8_e4m3fn, pow2_scales=True, amax_epsilon=0.0,
                       rowwise=True, colwise=False, layout="compact"):
    """Reference of :func:`jax_fp8.quantize_blockwise`."""
    return quantize(x, build_scheme("reference.quantize_blockwise", "blockwise", dtype, rowwise=rowwise,
                                    colwise=colwise, block=block, pow2_scales=pow2_scales, amax_epsilon=amax_epsilon,
                                    layout=layout))


def dequantize(q, dtype=None, usage=None):
    """Reference of :func:`jax_fp8.dequantize`."""
    return quantization.dequantize(q, dtype, usage, quantization.CONTRACTS)


__all__ = ["quantize", "quantize_mxfp8", "quantize_blockwise", "dequantize", "e8m0_from_amax",
           "block_amax", "block_scale_from_amax", "cast_to_fp8", "dequantize_blocks", "e8m0_reciprocal",
           "e8m0_to_float", "expand_blocks", "partial_amax", "partial_amax_group", "partial_cast",
           "partial_cast_group", "quantize_blocks", "quantize_usages"]
