"""JAX primitives backed by the FFI kernels: abstract eval, batching and per-platform lowering."""
from .quantize import KERNELS, dequantize_p, quantize_p

__all__ = ["quantize_p", "dequantize_p", "KERNELS"]
