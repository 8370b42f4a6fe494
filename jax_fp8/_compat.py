"""Imports that moved between jax releases (0.10 through 0.12+)."""
from __future__ import annotations

import jax.numpy as jnp

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover
    from jax.core import Primitive  # type: ignore[attr-defined,no-redef]

from jax.interpreters import ad, batching, mlir

try:
    from jax.extend.core import ShapedArray  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    from jax.core import ShapedArray  # type: ignore[attr-defined,no-redef]

# Eager evaluation of a primitive (its impl rule): jax has no public name for it.
from jax._src.dispatch import apply_primitive  # noqa: E402

try:  # jax >= 0.4.38
    from jax import ffi
except ImportError:  # pragma: no cover
    from jax.extend import ffi  # type: ignore[no-redef]

#: ``jnp.float8_e8m0fnu`` where this jax has it, else None.
E8M0_DTYPE = getattr(jnp, "float8_e8m0fnu", None)


__all__ = ["Primitive", "ShapedArray", "ad", "apply_primitive", "batching", "ffi", "mlir", "E8M0_DTYPE"]
