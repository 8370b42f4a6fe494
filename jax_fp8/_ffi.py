"""Loads the compiled FFI modules and registers their targets with XLA.

The CPU module is always built; the CUDA module only where nvcc was found (and the build was not told
to skip it). A missing module is not an import error: the primitives then lower through the jax.numpy
reference on that platform. Nothing here initialises a jax backend.
"""
from __future__ import annotations

import importlib
import warnings

from ._compat import ffi

#: platform name for lowering -> True when our compiled module for it loaded and registered its FFI
#: targets (says nothing about whether such a device exists; see ``cuda_device_present``)
AVAILABLE: dict[str, bool] = {"cpu": False, "cuda": False, "cutlass": False}
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
_register("_jax_fp8_cutlass", "cutlass", "CUDA")  # optional (JAX_FP8_CUTLASS=1): jf_cutlass_gemm

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
