"""The GEMM backends, one module each, and their registry.

Each module defines one :class:`~jax_fp8.gemm.contract.GemmBackend`: the formats and shapes it takes
(its padding), whether it runs here and why not, its lowering under the ``jf_fp8_gemm`` primitive or its
computation as a jax function, and its options. :data:`BACKENDS` lists them in order of preference:
the plan (:func:`jax_fp8.gemm.plan.plan_gemm`) runs a GEMM on the one the measured table
(:mod:`jax_fp8.gemm.table`) names for this GPU, else on the first that takes it and runs here.

Adding a backend is one module here plus its line in :data:`BACKENDS`; it is then a choice of
``fp8_dot_general(..., implementation=<its name>)`` and ``fp8_gemm(..., backend=...)`` too.
"""
from __future__ import annotations

from ..contract import GemmBackend
from .cublaslt import CUBLASLT
from .cudnn import CUDNN
from .cutlass import CUTLASS
from .reference import REFERENCE

#: The backends in order of preference where the GEMM table has no row for this GPU: the first that
#: takes a GEMM (and runs here) runs it. cuBLASLt first: it takes every Float8 blockwise pair and dtype
#: and needs no extra build; CUTLASS (built on request) runs where the table measured it faster; cuDNN
#: takes MXFP8.
BACKENDS: tuple[GemmBackend, ...] = (
    CUBLASLT,
    CUTLASS,
    CUDNN,
)


def implementations() -> dict[str, GemmBackend]:
    """Name -> backend of every choice ``implementation=`` takes: :data:`BACKENDS` and the reference."""
    return {b.name: b for b in (*BACKENDS, REFERENCE)}


__all__ = ["BACKENDS", "CUBLASLT", "CUDNN", "CUTLASS", "REFERENCE", "implementations"]
