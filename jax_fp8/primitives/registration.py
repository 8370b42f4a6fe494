"""The one way a jax_fp8 primitive is defined: abstract eval, batching, differentiation (none: FP8
data carries no gradient), and its lowering per platform, the reference (the kernel's jax.numpy
contract) wherever our compiled kernel is not available.

With a partitioning ``rule`` the primitive splits under ``jax.jit`` over a mesh (:mod:`.partitioning`):
the lowerings then belong to its local twin, which each device runs on its shard.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi
from .._compat import Primitive, ad, apply_primitive, batching, mlir
from ..warn import warn
from .partitioned import partitioned_primitive
from .partitioning import Rule


def _no_jvp(name: str, hint: str):
    def rule(primals, tangents, **params):
        raise TypeError(f"{name} is not differentiable: FP8 data cannot carry a gradient. {hint}")
    return rule


def _batch_of_none(prim: Primitive, batch: Callable) -> Callable:
    """The batching rule ``batch``, and for a batch of no entries (which its folds and maps cannot take:
    nothing to divide into examples) each result empty along a leading batch dim, of one example's type."""
    def rule(args, dims, **params):
        if next(x.shape[d] for x, d in zip(args, dims) if d is not None):
            return batch(args, dims, **params)
        example = [x if d is None else jax.ShapeDtypeStruct(x.shape[:d] + x.shape[d + 1:], x.dtype)
                   for x, d in zip(args, dims)]
        one = jax.eval_shape(lambda *ops: prim.bind(*ops, **params), *example)
        if prim.multiple_results:
            return [jnp.zeros((0, *o.shape), o.dtype) for o in one], [0] * len(one)
        return jnp.zeros((0, *one.shape), one.dtype), 0
    return rule


def define_primitive(name: str, *, abstract: Callable, reference: Callable, ffi_rules: dict,
                     batch: Optional[Callable] = None, rule: Optional[Rule] = None, multiple_results: bool = False,
                     local_abstract: Optional[Callable] = None, unavailable: Optional[Callable] = None,
                     fallback_warning: type = UserWarning, no_jvp_hint: str = "") -> Primitive:
    """Define the primitive ``name`` and return it.

    - ``abstract(*avals, **params)``: its abstract eval (``local_abstract``: the local twin's, when the
      partitioning rule's per-device function binds it with other params);
    - ``reference(*args, **params)``: its jax.numpy contract, lowered on every platform without ours;
    - ``ffi_rules``: platform -> MLIR lowering rule ``(ctx, *args, **params)`` of our FFI kernel, used
      where ``_ffi.AVAILABLE[platform]`` (the compiled module for it loaded);
    - ``unavailable(platform, params, devices, avals)``: asked at lowering time, why the FFI kernel
      cannot run on ``devices`` (:func:`lowering_devices`) or take operands of ``avals`` after all (None:
      it can); then the reference lowers it, with one ``fallback_warning`` saying why;
    - ``batch``: its batching rule (a batch of no entries is answered here); ``rule``: how it partitions
      under ``jax.jit`` (None: it does not);
    - ``no_jvp_hint``: what the error of a differentiation attempt recommends.
    """
    if rule is None:
        prim = local = Primitive(name)
        prim.multiple_results = multiple_results
        prim.def_impl(partial(apply_primitive, prim))
        prim.def_abstract_eval(abstract)
    else:
        prim, local = partitioned_primitive(name, abstract, rule, multiple_results, local_abstract)
    if batch is not None:
        batching.primitive_batchers[prim] = _batch_of_none(prim, batch)
    ad.primitive_jvps[prim] = _no_jvp(name, no_jvp_hint)

    reference_rule = mlir.lower_fun(reference, multiple_results=multiple_results)
    mlir.register_lowering(local, reference_rule)  # any platform without our kernels
    for platform, ffi_rule in ffi_rules.items():
        if not _ffi.AVAILABLE.get(platform):
            continue
        if unavailable is not None:
            ffi_rule = _checked(name, platform, ffi_rule, reference_rule, unavailable, fallback_warning)
        mlir.register_lowering(local, ffi_rule, platform=platform)
    return prim


def lowering_devices(ctx) -> Optional[tuple]:
    """The devices the module being lowered is compiled for: jit's device assignment (where jax compiles
    ahead of time for devices this machine lacks, a compile-only topology's), or shard_map's mesh; None
    where the lowering names none (``jax.export``)."""
    axis = ctx.module_context.axis_context
    devices = getattr(axis, "device_assignment", None)
    if devices is None:
        mesh_devices = getattr(getattr(axis, "mesh", None), "devices", None)  # a concrete Mesh's array
        devices = None if mesh_devices is None else tuple(np.asarray(mesh_devices).flat)
    return devices


def _checked(name, platform, ffi_rule, reference_rule, unavailable, warning):
    def lower(ctx, *args, **params):
        why = unavailable(platform, params, lowering_devices(ctx), ctx.avals_in)
        if why is not None:  # e.g. an old library or another GPU: the same numbers, from the reference
            warn(f"jax_fp8: {name} runs as its reference (fp32 math) on this {platform} device: {why}", warning)
            return reference_rule(ctx, *args, **params)
        return ffi_rule(ctx, *args, **params)
    return lower
