"""The recipes of ``fp8_dot_general``: how each operand of a linear layer's three GEMMs is quantized.

- :class:`Float8BlockScaling` (TransformerEngine's / DeepSeek-V3's): activations and gradients in 1x128
  blocks, weights in 128x128 tiles, fp32 scales; the GEMMs run on Hopper's block-scaled FP8 kernels
  (cuBLASLt, CUTLASS).
- :class:`MXFP8BlockScaling` (OCP microscaling): every operand in blocks of 32 along each GEMM's
  contraction, E8M0 scales; the GEMMs run on cuDNN's block-scaled GEMM on Blackwell.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..formats import check_amax_epsilon, fp8_dtype
from ..scheme import Scheme
from .contract import BLOCK_1D, BLOCK_2D


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling:
    """The Float8 blockwise recipe (TE's ``Float8BlockScaling``, DeepSeek-V3): lhs and gradients in 1x128
    blocks, rhs (weights) in 128x128 tiles, E4M3; ``grad_dtype`` E4M3 (default) or E5M2 for the output
    gradient; ``pow2_scales`` and ``amax_epsilon`` as in :func:`jax_fp8.quantize_blockwise`. Hashable.

    Its schemes have ``saturate_inf=False``: a block holding an infinity gets an infinite scale_inv, so
    the GEMMs return non-finite values wherever an infinity of an operand reaches, as lax.dot_general
    does (TE's rule, saturation, would return finite numbers there)."""

    grad_dtype: Any = jnp.float8_e4m3fn
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "grad_dtype", fp8_dtype(self.grad_dtype, "Float8BlockScaling: grad_dtype"))
        object.__setattr__(self, "amax_epsilon", check_amax_epsilon(self.amax_epsilon, "Float8BlockScaling"))
        if not isinstance(self.pow2_scales, (bool, np.bool_)):
            raise TypeError(f"Float8BlockScaling: pow2_scales must be a bool, got {self.pow2_scales!r}")

    def scheme(self, role: str, rowwise: bool = True, colwise: bool = True) -> Scheme:
        """The GEMM-ready scheme of a role: 'lhs' (activations), 'rhs' (weights) or 'grad'."""
        block = BLOCK_2D if role == "rhs" else BLOCK_1D
        dtype = self.grad_dtype if role == "grad" else jnp.float8_e4m3fn
        return Scheme("blockwise", dtype, rowwise=rowwise, colwise=colwise, block=block,
                      pow2_scales=bool(self.pow2_scales), amax_epsilon=self.amax_epsilon, layout="gemm_ready",
                      saturate_inf=False)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling:
    """The MXFP8 recipe (TE's ``MXFP8BlockScaling``, OCP microscaling): every operand in blocks of 32
    along the contraction with an E8M0 scale (TE's rule), E4M3; ``grad_dtype`` E4M3 (default) or E5M2
    for the output gradient. Each GEMM contracts its operands along their blocks: fprop x and W over K
    (rowwise, 1x32), dgrad dy and W over N, wgrad dy and x over M (the columnwise usages, 32x1), so x,
    W and dy are each quantized once with both usages. The GEMMs run on cuDNN's block-scaled GEMM where
    the GPUs are Blackwell (:mod:`jax_fp8.gemm.backends.cudnn`), else as their reference, a bf16 GEMM of
    the dequantized operands with fp32 accumulation (one warning). Hashable."""

    grad_dtype: Any = jnp.float8_e4m3fn

    def __post_init__(self):
        object.__setattr__(self, "grad_dtype", fp8_dtype(self.grad_dtype, "MXFP8BlockScaling: grad_dtype"))

    def scheme(self, role: str, rowwise: bool = True, colwise: bool = True) -> Scheme:
        """The scheme of a role: 'lhs' (activations), 'rhs' (weights) or 'grad'."""
        dtype = self.grad_dtype if role == "grad" else jnp.float8_e4m3fn
        return Scheme("mxfp8", dtype, rowwise=rowwise, colwise=colwise)


#: The recipes ``fp8_dot_general`` takes.
RECIPES = (Float8BlockScaling, MXFP8BlockScaling)
