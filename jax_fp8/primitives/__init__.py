"""JAX primitives backed by the FFI kernels: abstract eval, batching, partitioning and per-platform
lowering, each defined through :func:`.registration.define_primitive`."""
from .norm_grad import norm_grad_p
from .partial import partial_amax_p, partial_cast_p
from .produce import produce_p, produce_quantize_p
from .quantize import dequantize_p, quantize_p
from .quantize_grouped import quantize_grouped_p

__all__ = ["quantize_p", "dequantize_p", "partial_amax_p", "partial_cast_p", "produce_p", "produce_quantize_p",
           "norm_grad_p", "quantize_grouped_p"]
