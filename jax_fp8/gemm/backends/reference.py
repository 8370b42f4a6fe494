"""The reference backend: the reference math (:mod:`jax_fp8.gemm.reference`) as a backend, for every
format and shape on every platform. It is what ``fp8_dot_general(..., implementation="reference")``
runs, and what a GEMM that no other backend takes is computed by."""
from __future__ import annotations

from typing import Optional, Sequence

from ...formats import FORMATS, MXFP8, format_of_block
from ..contract import GemmBackend, gemm_dtype
from ..reference import blocked_gemm, mx_gemm_reference


def sizes(M: int, N: int, K: int, a_block, b_block, a_dtype, b_dtype) -> tuple[Optional[tuple], Optional[str]]:
    """Every problem, as it is (no padding)."""
    return (M, N, K), None


def unavailable(platform: str = "cuda", devices: Optional[Sequence] = None) -> Optional[str]:
    """Never: jax.numpy runs everywhere."""
    return None


def compute(a, a_scale, b, b_scale, c=None, *, a_block, b_block, out_dtype):
    """``a · bᵀ (+ c)`` by the reference math of the operands' format."""
    if format_of_block(a_block) is MXFP8:
        return mx_gemm_reference(a, a_scale, b, b_scale, c, out_dtype=gemm_dtype(out_dtype)).astype(out_dtype)
    return blocked_gemm(a, a_scale, b, b_scale, c, a_block=a_block, b_block=b_block, out_dtype=out_dtype)


REFERENCE = GemmBackend("reference", sizes, unavailable, compute=compute, formats=tuple(FORMATS.values()),
                        platforms=("cpu", "cuda", "rocm", "tpu"))
