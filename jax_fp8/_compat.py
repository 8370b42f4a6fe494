"""Imports that moved between jax releases (0.5 through 0.11+)."""
from __future__ import annotations

import jax.numpy as jnp

try:  # jax >= 0.6
    from jax import shard_map as _shard_map
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

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


def shard_map(f, *, mesh, in_specs, out_specs, check=False):
    """``shard_map`` with replication checking named the same on every jax line."""
    import inspect

    params = inspect.signature(_shard_map).parameters
    kw = {"check_vma": check} if "check_vma" in params else {"check_rep": check}
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


__all__ = ["Primitive", "ShapedArray", "ad", "apply_primitive", "batching", "ffi", "mlir", "shard_map",
           "E8M0_DTYPE"]
