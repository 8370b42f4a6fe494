"""JAX primitives backed by the FFI kernels: abstract eval, batching and per-platform lowering."""
from .quantize import dequantize_p, quantize_p, quantize_kernels

__all__ = ["quantize_p", "dequantize_p", "quantize_kernels"]
