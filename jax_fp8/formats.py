"""FP8 element formats, the input dtypes, and the validation of dtype-like arguments."""
from __future__ import annotations

import math

import numpy as np
import jax.numpy as jnp

#: FP8 element dtypes, in the kernels' numbering (0 = E4M3, 1 = E5M2; ffi_common.h's Fp8Kind).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: Largest finite value of each FP8 format.
FP8_MAX = {FP8_DTYPES[0]: 448.0, FP8_DTYPES[1]: 57344.0}
#: High-precision dtypes accepted as input and produced by dequantize.
HIGH_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

MX_BLOCK = 32
FLOAT8_BLOCK = 128


def fp8_dtype(dtype, name: str = "dtype") -> jnp.dtype:
    """Validate an FP8 element dtype argument."""
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype!r}") from e
    if d not in FP8_DTYPES:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {d}")
    return d


def high_dtype(dtype, name: str) -> jnp.dtype:
    """Validate a high-precision dtype (float32, bfloat16, float16)."""
    d = jnp.dtype(dtype)
    if d not in HIGH_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {d}")
    return d


def check_input(x, name: str = "x"):
    """Validate a tensor to quantize; return it as a jax array."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    high_dtype(x.dtype, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have rank >= 1 (it is viewed as 2-D: (prod(shape[:-1]), shape[-1])), got a scalar")
    return x


def check_amax_epsilon(amax_epsilon, where: str) -> float:
    """Validate a Float8 blockwise amax epsilon (a finite float >= 0)."""
    try:
        eps = float(amax_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: amax_epsilon must be a finite float >= 0, got {amax_epsilon!r}") from None
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"{where}: amax_epsilon must be finite and >= 0, got {amax_epsilon}")
    return eps


def max_finite(dtype) -> np.float32:
    """Largest finite value of a high-precision dtype, as fp32 (TE's value for an infinite scale)."""
    return np.float32(jnp.finfo(dtype).max)
