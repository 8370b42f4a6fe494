"""A primitive partitioned under ``jax.jit`` by its :class:`~.partitioning.Rule`: the
``custom_partitioning`` wrapper (:func:`partitioned_primitive`) whose callbacks decode the operands'
shardings, let :func:`~.partitioning.choose_sharding` decide what stays split, write the Shardy rule
(:func:`~.partitioning.sdy_rule`) and run the local twin on each device's shard. Why a dim stays split or
is gathered: :mod:`.partitioning`.
"""
from __future__ import annotations

import itertools
import threading
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch, sharding_impls
from jax._src.custom_partitioning_sharding_rule import sdy_sharding_rule_to_mlir, str_to_sdy_sharding_rule
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from .._compat import Primitive, apply_primitive, mlir
from ..warn import PartitioningRuleWarning, ShardingWarning, warn
from .partitioning import (Rule, ShardingChoice, Whole, choose_sharding, explicit_sharding, named_sharding, sdy_rule,
                           spec_axes)


def _unsplit(x):
    """``x`` typed whole. custom_partitioning traces the unsplit function on the global types, and
    those name mesh axes on an Explicit mesh, where a local reshape of the per-device function would
    not type; that function runs only where nothing is split (one device, inside shard_map)."""
    s = explicit_sharding(x)
    if s is not None and any(e is not None for e in s.spec):
        return jax.sharding.reshard(x, NamedSharding(s.mesh, PartitionSpec()))
    return x


def _own_entries(x, w: Whole, pad_value):
    """This device's entries of an operand dim held whole, padded as a shard's layout."""
    start = lax.axis_index(w.axes) * w.entries
    x = lax.dynamic_slice_in_dim(x, start, w.entries, axis=w.dim)
    return _pad_to(x, w.dim, w.local, pad_value)


def _all_entries(x, w: Whole, pad_value):
    """A result dim held whole: every device's entries, in order, padded as the global layout."""
    x = lax.all_gather(lax.slice_in_dim(x, 0, w.entries, axis=w.dim), w.axes, axis=w.dim, tiled=True)
    return _pad_to(x, w.dim, w.size, pad_value)


def _pad_to(x, dim: int, size: int, value):
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, size - x.shape[dim])
    return jnp.pad(x, widths, constant_values=np.asarray(value, x.dtype))


def _axes_of(sharding, mesh, ndim: int) -> tuple:
    """An operand's sharding as mesh axes per dim. The partitioner hands HloShardings (we decode them:
    ``decode_shardings=False``); one no PartitionSpec can name (Shardy may split a mesh axis between
    a compound factor's parts) is read as replicated: the choice then takes it whole."""
    if isinstance(sharding, NamedSharding):
        return spec_axes(sharding.spec, ndim)
    try:
        return spec_axes(PartitionSpec(*sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0]),
                         ndim)
    except Exception:  # a sub-axis split, or no sharding to read
        return ((),) * ndim


def _specs_and_choice(rule, params, mesh, arg_shapes):
    specs = [_axes_of(a.sharding, mesh, len(a.shape)) for a in arg_shapes]
    return choose_sharding(rule, params, dict(mesh.shape), [tuple(a.shape) for a in arg_shapes], specs)


def partitioned_primitive(name: str, abstract: Callable, rule: Rule, multiple_results: bool = False,
                          local_abstract: Optional[Callable] = None):
    """``(prim, local)``: the primitive ``name`` the API binds, partitioned by ``rule`` under ``jit``,
    and its local twin, on which the caller registers the per-platform lowerings. ``prim`` has
    ``abstract`` (and types its results with the choice under an Explicit mesh); ``local`` has
    ``local_abstract`` (default: ``abstract``; another one when ``rule.local`` binds other params)."""
    prim, local = Primitive(name), Primitive(f"{name}_local")
    for p in (prim, local):
        p.multiple_results = multiple_results
        p.def_impl(partial(apply_primitive, p))
    local.def_abstract_eval(local_abstract or abstract)
    prim.def_abstract_eval(partial(_typed_abstract, abstract, rule))
    dispatch.prim_requires_devices_during_lowering.add(prim)  # the partitioner needs the device mesh

    def on_device(params, reduce_axes):
        """What one device runs on its operands (its shard, or the whole array)."""
        if rule.local is not None:
            return rule.local(local.bind, reduce_axes, params)
        return lambda *args: tuple(local.bind(*args, **params)) if multiple_results else local.bind(*args, **params)

    def run(items, *args):  # unsplit: one device, or inside shard_map
        return on_device(dict(items), ())(*map(_unsplit, args))

    def lower_fn(items, p: ShardingChoice):
        fn = on_device(dict(items), p.reduce_axes)

        def on_shard(*args):
            args = list(args)
            for w in p.whole_in:
                args[w.index] = _own_entries(args[w.index], w, rule.pad_value)
            outs = list(fn(*args)) if multiple_results else [fn(*args)]
            for w in p.whole_out:
                outs[w.index] = _all_entries(outs[w.index], w, rule.pad_value)
            return tuple(outs) if multiple_results else outs[0]

        return on_shard

    def safe_choice(items, mesh, arg_shapes, result_shape) -> ShardingChoice:
        """The choice; whole operands and results (with a warning) if choosing raised: never a compile
        error."""
        try:
            return _specs_and_choice(rule, dict(items), mesh, arg_shapes)
        except Exception as e:  # noqa: BLE001  (any failure here would abort the user's compile)
            _rule_failed(name, "choosing its split", arg_shapes, mesh, e)
            results = result_shape if multiple_results else [result_shape]
            return ShardingChoice([[None] * len(a.shape) for a in arg_shapes], [[None] * len(r.shape) for r in results],
                                  (), (), (), [])

    def partition(items, mesh, arg_shapes, result_shape):
        p = safe_choice(items, mesh, arg_shapes, result_shape)
        for note in p.gathered:
            warn(f"jax_fp8: {name} under jax.jit: {note}", ShardingWarning)
        outs = [named_sharding(mesh, s) for s in p.results]
        return mesh, _traced_without_mesh(lower_fn(items, p)), tuple(outs) if multiple_results else outs[0], \
            tuple(named_sharding(mesh, s) for s in p.operands)

    def infer(items, mesh, arg_shapes, result_shape):  # the GSPMD partitioner (jax_use_shardy_partitioner=False)
        outs = [named_sharding(mesh, s) for s in safe_choice(items, mesh, arg_shapes, result_shape).results]
        return tuple(outs) if multiple_results else outs[0]

    def sharding_rule(items, mesh, value_types, result_types):
        """Shardy's rule, checked here as jax will check it; where it fails, a rule that links no dims
        (the operands' shardings then reach the choice as they are) and a warning."""
        try:
            text, options = sdy_rule(rule, dict(items), [tuple(t.shape) for t in value_types], dict(mesh.shape))
            built = str_to_sdy_sharding_rule(text, **options)
            sdy_sharding_rule_to_mlir(built, value_types, result_types)
            return built
        except Exception as e:  # noqa: BLE001
            _rule_failed(name, "writing its Shardy rule", [tuple(t.shape) for t in value_types], mesh, e)
            fresh = itertools.count()
            side = lambda types: ", ".join(" ".join(f"z{next(fresh)}" for _ in t.shape) for t in types)  # noqa: E731
            return str_to_sdy_sharding_rule(f"{side(value_types)} -> {side(result_types)}")

    split = custom_partitioning(run, static_argnums=(0,))
    split.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule,
                        decode_shardings=False)

    def lowering(ctx, *args, **params):
        items = tuple(sorted(params.items()))
        return mlir.lower_fun(partial(split, items), multiple_results=multiple_results)(ctx, *args)

    mlir.register_lowering(prim, lowering)
    return prim, local


class _MeshContext(threading.local):
    """The abstract mesh context of this thread (jax keeps it per thread), set aside while jax traces a
    per-device function."""

    pending: Optional[jax.sharding.use_abstract_mesh] = None

    def leave(self) -> None:
        self.restore()
        self.pending = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))
        self.pending.__enter__()

    def restore(self) -> None:
        if self.pending is not None:
            cm, self.pending = self.pending, None
            cm.__exit__(None, None, None)


_MESH_CONTEXT = _MeshContext()


def _traced_without_mesh(fn: Callable) -> Callable:
    """``fn``, the per-device function a partition callback returns, traced with no mesh context.

    jax traces it (``make_jaxpr`` of the shards' shapes) right after the callback returns, under the
    caller's context: inside ``jax.set_mesh`` of a mesh with Explicit axes, jax 0.12 types its values
    with that mesh and lowers them with sharding annotations that nothing partitions any more (the
    compile fails: "No registered implementation for untyped custom call to Sharding"). The values
    are one device's: the context is left here, before jax types the arguments, and restored when
    ``fn`` returns (or, should jax not call it, at the next callback)."""
    _MESH_CONTEXT.leave()

    def local(*args):
        try:
            return fn(*args)
        finally:
            _MESH_CONTEXT.restore()

    return local


def _rule_failed(name: str, step: str, shapes, mesh, error: Exception) -> None:
    shapes = [tuple(getattr(a, "shape", a)) for a in shapes]
    warn(f"jax_fp8: {name} under jax.jit: {step} failed for operands {shapes} on mesh {dict(mesh.shape)} "
         f"({type(error).__name__}: {error}); running it on whole operands instead. This is a bug in jax_fp8: "
         f"please report it with this message.", PartitioningRuleWarning)


def _typed_abstract(abstract, rule, *avals, **params):
    """``abstract``'s results, typed with the choice's shardings when an operand's type names mesh axes
    (an Explicit mesh); as they are otherwise (the partitioner decides at compile time)."""
    outs = abstract(*avals, **params)
    shardings = [explicit_sharding(a) for a in avals]
    specs = [spec_axes(s.spec, a.ndim) if s is not None else ((),) * a.ndim for s, a in zip(shardings, avals)]
    if not any(any(axes) for spec in specs for axes in spec):
        return outs
    mesh = next(s.mesh for s, spec in zip(shardings, specs) if any(spec))
    p = choose_sharding(rule, params, dict(mesh.shape), [a.shape for a in avals], specs)
    many = isinstance(outs, (list, tuple))
    typed = [o.update(sharding=named_sharding(mesh, s)) for o, s in zip(outs if many else [outs], p.results)]
    return typed if many else typed[0]
