"""Loads the compiled FFI modules and registers their targets with XLA.

The CPU module is always built; the CUDA module only where nvcc was found (and the build was not told
to skip it). A missing module is not an import error: the primitives then lower through the jax.numpy
reference on that platform. Nothing here initialises a jax backend.
"""
from __future__ import annotations

import glob
import importlib
import os
import re
import warnings
from typing import Optional

from ._compat import ffi

#: platform name for lowering -> True when our compiled module for it loaded and registered its FFI
#: targets (says nothing about whether such a device exists; see ``cuda_device_present``)
AVAILABLE: dict[str, bool] = {"cpu": False, "cuda": False}
LOAD_ERRORS: dict[str, str] = {}


def _register(module_name: str, platform: str, xla_platform: str) -> None:
    try:
        mod = importlib.import_module(f"jax_fp8.{module_name}")
    except ImportError as e:
        LOAD_ERRORS[platform] = str(e)
        return
    for name, capsule in mod.registrations().items():
        ffi.register_ffi_target(name, capsule, platform=xla_platform)
    AVAILABLE[platform] = True


_register("_jax_fp8_cpu", "cpu", "cpu")
_register("_jax_fp8_cuda", "cuda", "CUDA")  # XLA wants "CUDA" exactly; lowercase registers nothing

if not AVAILABLE["cpu"]:
    warnings.warn("jax_fp8: the CPU FFI module is not built (" + LOAD_ERRORS.get("cpu", "?") + "); "
                  "CPU runs use the jax.numpy reference. Reinstall with `pip install -e .`.", stacklevel=2)


def cuda_device_present() -> bool:
    """True when jax has a CUDA GPU backend with at least one device. Never raises: on a machine
    without a GPU (or a jax without CUDA support, or JAX_PLATFORMS=cpu) this is False. Calling it
    initialises jax's backends, so it is only called on request, never at import."""
    try:
        import jax

        return len(jax.devices("cuda")) > 0
    except Exception:  # RuntimeError "Unknown backend cuda" and its relatives
        return False


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
    if not AVAILABLE["cuda"]:
        return 0, "the jax_fp8 CUDA module is not built"
    load = getattr(importlib.import_module("jax_fp8._jax_fp8_cuda"), "cublaslt_load", None)
    if load is None:
        return 0, "the installed jax_fp8 CUDA module predates the FP8 GEMM: rebuild it (pip install -e .)"
    # start jax's CUDA backend first: it loads XLA's cuBLASLt, which the loader then prefers (by
    # soname) to any other copy on disk, so that the process holds one cuBLASLt
    cuda_device_present()
    version, message = load(_cublaslt_candidates())
    return int(version), str(message)


def gemm_cuda_unavailable() -> Optional[str]:
    """None when ``jf_fp8_gemm`` runs on cuBLASLt here (the CUDA module built, cuBLASLt >= 12.9 loaded,
    every CUDA device a Hopper, sm_90); else why not, in words. Never raises."""
    if not AVAILABLE["cuda"]:
        return cublaslt()[1]
    try:
        import jax

        caps = {str(getattr(d, "compute_capability", "?")) for d in jax.devices("cuda")}
    except Exception as e:  # no CUDA backend
        return f"no CUDA device ({e})"
    if not caps or any(not c.startswith("9.") for c in caps):
        return f"cuBLASLt's FP8 block scaling needs Hopper (sm_90); the CUDA devices are sm {sorted(caps)}"
    version, message = cublaslt()
    if not version:
        return message
    if version < CUBLASLT_MIN_VERSION:
        return f"cuBLASLt {version} at {message} predates block scaling (needs >= {CUBLASLT_MIN_VERSION})"
    return None
