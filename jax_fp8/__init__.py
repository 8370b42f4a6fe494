"""jax_fp8: MXFP8 and Float8 blockwise quantization for JAX, on XLA FFI kernels (CPU and CUDA)."""
import importlib as _importlib
import warnings as _warnings

from . import _ffi  # registers the FFI targets before any primitive lowers
from . import distributed, flax_utils, formats, fused, gemm, groups, reference  # flax_utils imports flax only when called
from .api import (QuantizedTensor, dequantize, quantize, quantize_blockwise, quantize_dequantize, quantize_mxfp8,
                  to_layout)
from .fused import gelu, layer_norm, norm_dense, norm_mlp, rms_norm, swiglu
from .scheme import Scheme
from .tensors import BlockwiseTensor, MXFP8Tensor
from .gemm import Float8BlockScaling, MXFP8BlockScaling, fp8_dot_general, fp8_ragged_dot, mxfp8_scaled_matmul_operands
from .warn import (CrossoverWarning, Fp8GemmFallbackWarning, Fp8Warning, GatherWarning, MXFP8GemmFallbackWarning,
                   PartitioningRuleWarning, ShardingWarning)


def kernels_available() -> dict:
    """Which of our compiled FFI kernels are loaded and can run here.

    Returns a dict of bools:

    - ``'cpu'``: the CPU module loaded (CPU runs use our C++ kernels, else the jax.numpy reference);
    - ``'cuda_module'``: the CUDA module loaded (it was built, found nvcc at install time);
    - ``'cuda_device'``: jax sees a CUDA GPU (False, never an error, on a machine without one);
    - ``'cuda'``: both of the above, i.e. our CUDA kernels run on this machine's GPU.

    A platform whose kernels are not available lowers through the jax.numpy reference (same bits).
    This call initialises jax's backends (to look for a GPU); ``import jax_fp8`` does not.
    """
    cuda_module = bool(_ffi.AVAILABLE["cuda"])
    cuda_device = _ffi.cuda_device_present()
    return {"cpu": bool(_ffi.AVAILABLE["cpu"]), "cuda_module": cuda_module, "cuda_device": cuda_device,
            "cuda": cuda_module and cuda_device}


#: Names once at the top level, still reachable there with a DeprecationWarning: name -> its home now.
_MOVED = {"e8m0_from_amax": "jax_fp8.reference.e8m0_from_amax", "crossover": "jax_fp8.gemm.crossover",
          "gemm_table": "jax_fp8.gemm.table"}


def __getattr__(name: str):
    if name in _MOVED:
        _warnings.warn(f"jax_fp8.{name} moved to {_MOVED[name]}", DeprecationWarning, stacklevel=2)
        if name == "e8m0_from_amax":
            from . import api  # the validating form it was
            return api.e8m0_from_amax
        return _importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'jax_fp8' has no attribute {name!r}")


__all__ = ["distributed", "formats", "gemm", "groups", "reference", "quantize", "quantize_mxfp8", "quantize_blockwise",
           "dequantize", "quantize_dequantize", "to_layout", "Scheme", "MXFP8Tensor", "BlockwiseTensor",
           "QuantizedTensor", "kernels_available"]
__all__ += ["fused", "gelu", "layer_norm", "norm_dense", "norm_mlp", "rms_norm", "swiglu"]
__all__ += ["fp8_dot_general", "fp8_ragged_dot", "Float8BlockScaling", "MXFP8BlockScaling", "mxfp8_scaled_matmul_operands"]
__all__ += ["Fp8Warning", "ShardingWarning", "PartitioningRuleWarning", "Fp8GemmFallbackWarning",
            "MXFP8GemmFallbackWarning", "CrossoverWarning", "GatherWarning"]
__version__ = "0.1.0"
