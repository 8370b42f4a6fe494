"""jax_fp8: MXFP8 and Float8 blockwise quantization for JAX, on XLA FFI kernels (CPU and CUDA)."""
from . import _ffi  # registers the FFI targets before any primitive lowers
from . import distributed, reference
from .api import (QuantizedTensor, dequantize, e8m0_from_amax, quantize_blockwise, quantize_dequantize,
                  quantize_mxfp8)
from .tensors import BlockwiseTensor, MXFP8Tensor


def kernels_available() -> dict:
    """Which platforms run our FFI kernels (others lower through the jax.numpy reference)."""
    return dict(_ffi.AVAILABLE)


__all__ = ["distributed", "quantize_mxfp8", "quantize_blockwise", "dequantize", "e8m0_from_amax", "quantize_dequantize",
           "MXFP8Tensor", "BlockwiseTensor", "QuantizedTensor", "reference", "kernels_available"]
__version__ = "0.1.0"
