"""The GEMM of the MXFP8 recipe: ``out = A · Bᵀ`` on MXFP8 operands.

Operands: ``a`` (M, K) and ``b`` (N, K) FP8 (``float8_e4m3fn`` / ``float8_e5m2``), contracted over
their last dim, with ``a_scale`` (M, ceil(K/32)) and ``b_scale`` (N, ceil(K/32)) uint8 E8M0 biased
exponents, one per 32 elements along K (value 2**(e - 127); 255 is NaN): the compact rowwise scales of
:class:`~jax_fp8.MXFP8Tensor`.

Where it runs: on CUDA GPUs that are all Blackwell or later (compute capability >= 10),
``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM) on the operands as they are, K zero-padded to a
multiple of 32 (no product changes); the choice is made per lowering platform
(``lax.platform_dependent``), so exporting for CUDA elsewhere (``jax.export``) holds that call too.
Everywhere else (Hopper, CPU) the reference: the operands dequantized (exactly: the scales are powers
of two) and an fp32 dot (``Precision.HIGHEST``), with one :class:`MXFP8GemmFallbackWarning` saying why.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import contracts, vma
from ._compat import E8M0_DTYPE
from .arrays import bitcast, cdiv
from .formats import MX_BLOCK
from .primitives.gemm import OUT_DTYPES
from .scheme import Scheme
from .warn import MXFP8GemmFallbackWarning, warn


def mx_values(data, scale):
    """fp32 values (rows, K) of an MXFP8 operand: ``data`` times its per-32 E8M0 ``scale``."""
    scheme = Scheme("mxfp8", data.dtype, rowwise=True, colwise=False)
    return contracts.dequantize_blocks(bitcast(data, np.uint8), scale, scheme=scheme, out_dtype=np.float32)


def mx_reference(a, a_scale, b, b_scale, *, out_dtype):
    """``a · bᵀ`` of the dequantized operands in fp32, rounded to ``out_dtype``."""
    out = lax.dot_general(mx_values(a, a_scale), mx_values(b, b_scale), (((1,), (1,)), ((), ())),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _scaled_matmul(a, a_scale, b, b_scale, *, out_dtype):
    pad = cdiv(a.shape[1], MX_BLOCK) * MX_BLOCK - a.shape[1]
    a, b = (jnp.pad(x, ((0, 0), (0, pad))) for x in (a, b))
    sa, sb = (bitcast(s, E8M0_DTYPE)[None] for s in (a_scale, b_scale))
    out = jax.nn.scaled_matmul(a[None], b[None], sa, sb, preferred_element_type=out_dtype)[0]
    return vma.match(out, a, b, sa, sb)[0]  # inside shard_map: varying as its operands (scaled_matmul drops it)


def cudnn_unavailable() -> Optional[str]:
    """None where cuDNN's block-scaled MXFP8 GEMM may run: every CUDA device Blackwell or later, or no
    CUDA device visible (then only a lowering for CUDA, e.g. an export, takes it); else why not."""
    if E8M0_DTYPE is None:
        return "this jax has no float8_e8m0fnu dtype"
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend here
        return None
    caps = sorted({str(getattr(d, "compute_capability", "?")) for d in devices})
    if all(c.split(".")[0].isdigit() and int(c.split(".")[0]) >= 10 for c in caps):
        return None
    return f"cuDNN's block-scaled MXFP8 GEMM needs Blackwell (sm_100 or later); the CUDA devices are sm {caps}"


def why_reference() -> Optional[str]:
    """Why the MXFP8 GEMMs of a call run as the reference on this machine's default backend (None:
    they run on cuDNN)."""
    why = cudnn_unavailable()
    if why is None and jax.default_backend() != "gpu":
        why = f"no block-scaled MXFP8 GEMM on {jax.default_backend()} (cuDNN on Blackwell GPUs has one)"
    return why


def mx_gemm(a, a_scale, b, b_scale, out_dtype):
    """``a · bᵀ`` as ``out_dtype`` on MXFP8 operands (the module docstring; no warning here: callers
    warn once per call, :func:`why_reference`). Output dtypes other than float32 and bfloat16 are
    computed in fp32 and cast."""
    dtype = jnp.dtype(out_dtype)
    gemm_dtype = dtype if dtype in OUT_DTYPES else jnp.dtype(jnp.float32)
    reference = partial(mx_reference, out_dtype=gemm_dtype)
    if cudnn_unavailable() is not None:
        out = reference(a, a_scale, b, b_scale)
    else:
        out = lax.platform_dependent(a, a_scale, b, b_scale, cuda=partial(_scaled_matmul, out_dtype=gemm_dtype),
                                     default=reference)
    return out.astype(dtype)


def warn_reference(where: str) -> None:
    why = why_reference()
    if why is not None:
        warn(f"{where}: the MXFP8 GEMMs run as their reference (dequantize + fp32 dot, the same quantized "
             f"operands): {why}", MXFP8GemmFallbackWarning)
