"""Varying manual axes ("vma"): how ``jax.shard_map`` types a per-device value, carried through our ops.

Inside ``shard_map`` (default ``check_vma=True``) every value's type names the mesh axes it varies
over: ``jax.typeof(x)`` prints ``float32[64,256]{V:data}``. JAX's transpose rules read that type to
decide where a gradient needs a ``psum`` (a replicated value used per device) and ``out_specs=P()``
reads it to reject a per-device result. So every primitive types its outputs with the axes its inputs
vary over (:func:`out_aval`), and every custom derivative sees operands cast to one common type first
(:func:`match`), as ``lax`` ops do: the cast's transpose is the ``psum`` a replicated operand needs.
Outside ``shard_map``, or with its checks off, values vary over nothing and all of this is a no-op.

JAX has no public constructor for a typed abstract value, so this module is the one place that builds
one (``ShapedArray`` with ``manual_axis_type``, jax >= 0.10).
"""
from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax._src import core as _core
from jax.sharding import NamedSharding, PartitionSpec


def axes_of(x) -> frozenset:
    """The mesh axes a value (or an abstract value) varies over; empty outside ``shard_map``."""
    aval = x if isinstance(x, _core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # None for tokens and other non-arrays
    return frozenset(mat.varying) if mat is not None else frozenset()


def out_aval(shape, dtype, *inputs) -> _core.ShapedArray:
    """A primitive's output aval: ``shape`` and ``dtype``, varying over every axis any input varies
    over (the output of a per-device kernel is per-device wherever one of its operands is)."""
    avals = [a for a in inputs if isinstance(a, _core.ShapedArray)]
    axes = frozenset().union(*(axes_of(a) for a in avals))
    if not axes:
        return _core.ShapedArray(shape, dtype)
    mesh = next(a.sharding.mesh for a in avals if axes_of(a))
    sharding = NamedSharding(mesh, PartitionSpec())
    return _core.ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=_core.ManualAxisType(varying=axes))


def vary(tree: Any, axes) -> Any:
    """Every array leaf of ``tree`` cast to vary over ``axes`` too (``lax.pcast(..., to='varying')``,
    whose transpose is a ``psum``); leaves already varying over them are returned as they are."""
    axes = frozenset(axes)

    def cast(leaf):
        missing = tuple(sorted(axes - axes_of(leaf), key=str))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, tree) if axes else tree


def axis_size(axis_name, where: str) -> int:
    """How many ranks ``axis_name`` (a mesh axis name, or a tuple of them) has here, inside
    ``jax.shard_map``; a ValueError naming ``where`` when nothing binds the axis (plain ``jax.jit``)."""
    try:
        return int(lax.psum(1, axis_name))
    except NameError:
        axes = jax.sharding.get_abstract_mesh().axis_names
        if axes:  # inside a shard_map whose mesh lacks the name
            raise ValueError(f"{where}: axis_name {axis_name!r} is not an axis of the shard_map's mesh, whose axes "
                             f"are {axes}") from None
        raise ValueError(f"{where}: mesh axis {axis_name!r} is not bound here: call it inside jax.shard_map (it is "
                         "a collective over that axis's ranks). Under plain jax.jit with sharded arrays, use "
                         "quantize_*, dequantize and fp8_dot_general, which need no axis name.") from None


def match(*trees):
    """The trees with every array leaf varying over the union of all their leaves' axes."""
    axes = frozenset().union(*(axes_of(leaf) for leaf in jax.tree.leaves(trees)))
    return tuple(vary(t, axes) for t in trees)
