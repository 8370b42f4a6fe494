"""The cuBLASLt backend (Hopper, sm_90; Float8 blockwise): the shapes its block-scaled FP8 GEMM takes,
and its CUDA lowering under ``jf_fp8_gemm`` to our handler ``jf_cublaslt_gemm`` (csrc/cublaslt_gemm.h),
which calls cuBLASLt loaded at run time (:func:`cublaslt`)."""
from __future__ import annotations

import functools
import glob
import importlib
import os
import re
import warnings
from typing import Optional, Sequence

import jax
import numpy as np

from ... import _ffi
from ...formats import BLOCKWISE
from ..contract import (BLOCK_1D, BLOCK_2D, GemmBackend, cuda_capabilities, lower_with_workspace, padded_sizes,
                        refused)

#: cuBLASLt's FP8 rules (TE's ``CanonicalizeGemmInput``, cuBLAS "tensor core usage"): K (= lda = ldb of
#: FP8 operands, in bytes) a multiple of 16; the output's leading dim N a multiple of 8 (16 bytes of a
#: 2-byte output); M a multiple of 8 when the (M, K) operand has 1x128 blocks.
K_ALIGN, MN_ALIGN = 16, 8


def sizes(M: int, N: int, K: int, a_block, b_block, a_dtype, b_dtype) -> tuple[Optional[tuple], Optional[str]]:
    """cuBLASLt's block-scaled FP8 GEMM rules: the (M, N, K) to run ``a`` (M, K) x ``b`` (N, K)ᵀ at
    (zero-padded, >= the problem's), or why it cannot take it.

    Rules (TE ``cublaslt_gemm.cu``; cuBLAS >= 12.9 on sm_90): pairs 1D x 1D, 1D x 2D, 2D x 1D (not
    2D x 2D); not both operands E5M2; K % 16 == 0 (the FP8 leading dims, in bytes); N % 8 == 0 (the
    output's leading dim); M % 8 == 0 when ``a`` has 1x128 blocks; dims below 2**31. Misaligned dims
    are padded with zeros, which changes no product and no scale grid (16 and 8 divide 128), when the
    padded GEMM does at most :data:`~jax_fp8.gemm.contract.MAX_PAD_GROWTH` times the work. M, N, K >= 1
    (the plan and the primitive refuse empty problems before asking a backend).
    """
    if a_block == b_block == BLOCK_2D:
        return None, "128x128 blocks on both operands (cuBLASLt takes 1D x 1D, 1D x 2D, 2D x 1D)"
    why = refused(M, N, K, a_dtype, b_dtype)
    if why is not None:
        return None, why
    return padded_sizes("cuBLASLt", M, N, K, (MN_ALIGN if a_block == BLOCK_1D else 1, MN_ALIGN, K_ALIGN))


#: The workspace result of every call (the CUDA module's ``cublaslt_workspace_bytes``: the 32 MiB
#: cuBLASLt may use, TE's figure for Hopper, + 256 to align it; :func:`~jax_fp8.gemm.contract.lower_with_workspace`).
WORKSPACE_BYTES = (32 << 20) + 256
#: How many of cuBLASLt's heuristic candidates ``CUBLASLT.with_options(algo=i)`` picks from.
CANDIDATES = 16


def check_options(algo: int = -1) -> None:
    """``algo``: -1 (the heuristic's choice) or a candidate index below :data:`CANDIDATES`."""
    if not -1 <= int(algo) < CANDIDATES:
        raise ValueError(f"cublaslt: algo must be -1 (the heuristic's choice) or in [0, {CANDIDATES}), got {algo}")


def _lower(ctx, a, a_scale, b, b_scale, *c, a_block, b_block, out_dtype, accumulate, algo=-1):
    """``algo``: -1, the heuristic's first choice; i, its i-th candidate (an autotuner's pick)."""
    _prepare_handles()
    return lower_with_workspace("jf_cublaslt_gemm", ctx, WORKSPACE_BYTES, a, a_scale, b, b_scale, *c,
                                a_block_rows=np.int64(a_block[0]), b_block_rows=np.int64(b_block[0]),
                                algo=np.int64(algo))


# ---- loading cuBLASLt -------------------------------------------------------------------------------
_CUBLASLT: Optional[tuple[int, str]] = None
#: cuBLASLt's first version with Hopper block scaling (cublasLtGetVersion's major*10000 + minor*100).
CUBLASLT_MIN_VERSION = 120900  # the handler checks it too (cublaslt.h, kMinVersion)


def _soname_major(path: str) -> int:
    m = re.search(r"\.so\.(\d+)", path)
    return int(m.group(1)) if m else 0


def _cublaslt_candidates() -> list[str]:
    """Where to look for libcublasLt when the process has none loaded yet: the nvidia wheels (where
    JAX's CUDA plugin finds it), highest major version first, then the bare sonames for the system's
    library path."""
    paths: list[str] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for root in nvidia.__path__:
            paths += glob.glob(os.path.join(root, "*", "lib", "libcublasLt.so*"))
    except ImportError:
        pass
    return sorted(paths, key=_soname_major, reverse=True) + ["libcublasLt.so.13", "libcublasLt.so.12",
                                                              "libcublasLt.so"]


def cublaslt() -> tuple[int, str]:
    """Loads cuBLASLt for the FP8 GEMM, once (the copy XLA already loaded is preferred):
    ``(version, path)``, or ``(0, why not)``. Never raises; initialises jax's backends (as
    ``cuda_device_present`` does) when the CUDA module is built."""
    global _CUBLASLT
    if _CUBLASLT is None:
        _CUBLASLT = _load_cublaslt()
    return _CUBLASLT


def _load_cublaslt() -> tuple[int, str]:
    if not _ffi.AVAILABLE["cuda"]:
        return 0, "the jax_fp8 CUDA module is not built"
    load = getattr(importlib.import_module("jax_fp8._jax_fp8_cuda"), "cublaslt_load", None)
    if load is None:
        return 0, "the installed jax_fp8 CUDA module predates the FP8 GEMM: rebuild it (pip install -e .)"
    # start jax's CUDA backend first: it loads XLA's cuBLASLt, which the loader then prefers (by
    # soname) to any other copy on disk, so that the process holds one cuBLASLt
    _ffi.cuda_device_present()
    version, message = load(_cublaslt_candidates())
    return int(version), str(message)


@functools.lru_cache(maxsize=None)
def _prepare_handles() -> None:
    """Makes cuBLASLt's handle for every local CUDA device now, when the first GEMM lowers: a call that
    XLA captures into a CUDA graph then makes none (the handler would otherwise make it on first use)."""
    try:
        devices = [d.local_hardware_id for d in jax.local_devices(backend="cuda")]
    except RuntimeError:  # no CUDA backend: lowered for export only, nothing runs here
        return
    failed = importlib.import_module("jax_fp8._jax_fp8_cuda").cublaslt_prepare(devices)
    if failed:  # the handler makes the handle itself then, and reports the same failure
        warnings.warn(f"jax_fp8: could not make cuBLASLt handles ahead of use: {failed}", stacklevel=2)


def unavailable(platform: str = "cuda", devices: Optional[Sequence] = None) -> Optional[str]:
    """None when ``jf_fp8_gemm`` runs on cuBLASLt (the CUDA module built, cuBLASLt >= 12.9 loaded, every
    GPU of ``devices``, those compiled for, else of this process, a Hopper, sm_90); else why not, in
    words. Never raises."""
    if not _ffi.AVAILABLE["cuda"]:
        return cublaslt()[1]
    caps, why = cuda_capabilities(devices)
    if why is not None:
        return why
    if any(not c.startswith("9.") for c in caps):
        return f"cuBLASLt's FP8 block scaling needs Hopper (sm_90); the CUDA devices are sm {sorted(caps)}"
    version, message = cublaslt()
    if not version:
        return message
    if version < CUBLASLT_MIN_VERSION:
        return f"cuBLASLt {version} at {message} predates block scaling (needs >= {CUBLASLT_MIN_VERSION})"
    return None


CUBLASLT = GemmBackend("cublaslt", sizes, unavailable, lowerings={"cuda": _lower}, formats=(BLOCKWISE,),
                       check_options=check_options)
