"""Array helpers shared by every layer: the namespace to compute in, bit casts, the 2-D view."""
from __future__ import annotations

import numpy as np
from jax import lax
import jax.numpy as jnp


def xp_of(*arrays):
    """The array namespace to compute in: NumPy when every input is a NumPy array, else jax.numpy."""
    return np if all(isinstance(a, (np.ndarray, np.generic)) for a in arrays) else jnp


def bitcast(a, dtype):
    """Reinterpret the bits of ``a`` as ``dtype`` (same item size), in ``a``'s namespace."""
    if isinstance(a, (np.ndarray, np.generic)):  # ascontiguousarray makes a 0-d array 1-d: keep the shape
        return np.ascontiguousarray(a).view(dtype).reshape(np.shape(a))
    return lax.bitcast_convert_type(a, dtype)


def view_2d(shape) -> tuple[int, int]:
    """The (rows, cols) 2-D view of an N-D shape: (prod(shape[:-1]), shape[-1])."""
    return int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
