"""The cuDNN backend (Blackwell, sm_100 and later; MXFP8): cuDNN's block-scaled GEMM through
``jax.nn.scaled_matmul`` on the operands as they are (the contract's MXFP8 operands), K zero-padded to a
multiple of 32 (no product changes).

It runs as a jax function (``compute``), not under the ``jf_fp8_gemm`` primitive: the choice between
cuDNN and the reference math (:func:`jax_fp8.gemm.reference.mx_gemm_reference`, a bf16 GEMM of the
dequantized operands with fp32 accumulation) is made per lowering platform (``lax.platform_dependent``),
so exporting for CUDA elsewhere (``jax.export``) holds the cuDNN call too. Where no CUDA GPU is
Blackwell (Hopper, CPU), the reference runs, and ``fp8_dot_general`` says so once per call
(:func:`warn_emulated`).
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ... import vma
from ..._compat import E8M0_DTYPE
from ...arrays import bitcast, cdiv
from ...formats import MX_BLOCK, MXFP8
from ...warn import MXFP8GemmFallbackWarning, warn
from ..contract import MX_BLOCK_1D, GemmBackend, cuda_capabilities, gemm_dtype, refused
from ..reference import mx_gemm_reference


def sizes(M: int, N: int, K: int, a_block, b_block, a_dtype, b_dtype) -> tuple[Optional[tuple], Optional[str]]:
    """cuDNN takes every MXFP8 problem as it is (K is padded to 32 inside :func:`compute`); dims below
    2**31."""
    if (tuple(a_block), tuple(b_block)) != (MX_BLOCK_1D, MX_BLOCK_1D):
        return None, f"{a_block} x {b_block} blocks (cuDNN's block-scaled GEMM takes MXFP8: 1x32 blocks on both)"
    if max(M, N, K) > 2**31 - 1:
        return None, refused(M, N, K, a_dtype, b_dtype)
    return (M, N, K), None


def _blackwell(caps) -> bool:
    return all(c.split(".")[0].isdigit() and int(c.split(".")[0]) >= 10 for c in caps)


def unavailable(platform: str = "cuda", devices: Optional[Sequence] = None) -> Optional[str]:
    """None where cuDNN's block-scaled MXFP8 GEMM runs: ``platform`` CUDA, every GPU of ``devices`` (else
    of this process) Blackwell or later, and a jax with the E8M0 dtype; else why not. Never raises."""
    if platform != "cuda":
        return f"no block-scaled MXFP8 GEMM on {platform} (cuDNN on Blackwell GPUs has one)"
    if E8M0_DTYPE is None:
        return "this jax has no float8_e8m0fnu dtype"
    caps, why = cuda_capabilities(devices)
    if why is not None:
        return why
    if _blackwell(caps):
        return None
    return f"cuDNN's block-scaled MXFP8 GEMM needs Blackwell (sm_100 or later); the CUDA devices are sm {sorted(caps)}"


def lowers_for_cuda() -> Optional[str]:
    """None where a CUDA lowering may take cuDNN's GEMM: every CUDA device Blackwell or later, or no CUDA
    device visible (then only a lowering for CUDA, e.g. an export, takes it); else why not."""
    if E8M0_DTYPE is None:
        return "this jax has no float8_e8m0fnu dtype"
    caps, no_cuda = cuda_capabilities()
    if no_cuda is not None:  # no CUDA device here
        return None
    return None if _blackwell(caps) else unavailable("cuda")


def _scaled_matmul(a, a_scale, b, b_scale, *, out_dtype):
    pad = cdiv(a.shape[1], MX_BLOCK) * MX_BLOCK - a.shape[1]
    a, b = (jnp.pad(x, ((0, 0), (0, pad))) for x in (a, b))
    sa, sb = (bitcast(s, E8M0_DTYPE)[None] for s in (a_scale, b_scale))
    out = jax.nn.scaled_matmul(a[None], b[None], sa, sb, preferred_element_type=out_dtype)[0]
    return vma.match(out, a, b, sa, sb)[0]  # inside shard_map: varying as its operands (scaled_matmul drops it)


def compute(a, a_scale, b, b_scale, c=None, *, a_block, b_block, out_dtype):
    """``a · bᵀ`` as ``out_dtype``: cuDNN's GEMM where the lowering platform is CUDA and
    :func:`lowers_for_cuda`, else the reference (no warning here: callers warn once per call,
    :func:`warn_emulated`). Output dtypes other than float32 and bfloat16 are computed in fp32 and cast."""
    del a_block, b_block  # MXFP8: (1, 32) both (sizes checked it)
    if c is not None:
        raise NotImplementedError("the cuDNN MXFP8 GEMM takes no accumulator")
    dtype = gemm_dtype(out_dtype)
    reference = partial(mx_gemm_reference, out_dtype=dtype)
    if lowers_for_cuda() is not None:
        out = reference(a, a_scale, b, b_scale)
    else:
        out = lax.platform_dependent(a, a_scale, b, b_scale, cuda=partial(_scaled_matmul, out_dtype=dtype),
                                     default=reference)
    return out.astype(out_dtype)


def why_emulated() -> Optional[str]:
    """Why the MXFP8 GEMMs of a call run as the reference on this machine's default backend (None: they
    run on cuDNN)."""
    why = lowers_for_cuda()
    if why is None and jax.default_backend() != "gpu":
        why = unavailable(jax.default_backend())
    return why


def warn_emulated(where: str) -> None:
    """One :class:`MXFP8GemmFallbackWarning` where the MXFP8 GEMMs run as the reference, saying what runs."""
    why = why_emulated()
    if why is not None:
        warn(f"{where}: the MXFP8 GEMMs run as their reference, a bf16 GEMM of the dequantized operands (exact: "
             f"FP8 values times power-of-two scales) with fp32 accumulation, on the same quantized operands: {why}",
             MXFP8GemmFallbackWarning)


CUDNN = GemmBackend("cudnn", sizes, unavailable, compute=compute, formats=(MXFP8,))
