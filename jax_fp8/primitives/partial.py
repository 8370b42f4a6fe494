"""Primitives for master-weight shards: ``jf_partial_amax`` and ``jf_partial_cast``, each over a
group of weights in one call (one kernel launch per up to 24 weights on GPU).

Weight i's shard is a flat buffer (L_i,) holding elements [offset, offset + length) of its row-major
(M_i, K_i) weight; ``windows`` is an int32 (N, 2) array of (offset, length) (traced: it comes from
``lax.axis_index``). Every weight's scale grids are packed one after another in one 1-D buffer
(``Scheme.packed_grids``): the partial values that ``jf_partial_amax`` returns, the reduced global
values that ``jf_partial_cast`` takes, and the fp32 scale_inv that it returns for Float8 blockwise.
"""
from __future__ import annotations

import numpy as np

from .._compat import ShapedArray, ffi
from .. import contracts
from ..scheme import packed_size
from ..vma import out_aval
from .registration import define_primitive


def _packed(shapes, scheme, *inputs, dtype=None):
    """The packed buffer of every weight's grids: partial values (the format's ``partial_dtype``) or
    scale_inv (``dtype``), varying over the axes of ``inputs`` (what it is computed from)."""
    n = packed_size(scheme.packed_grids(shapes))
    return out_aval((n,), dtype or scheme.format.partial_dtype, *inputs)


def _check_group(windows, shards, shapes, scheme):
    if not scheme.saturate_inf:
        raise ValueError("master-weight casts take TransformerEngine's rule for infinities (saturate_inf=True)")
    if len(shards) != len(shapes):
        raise ValueError(f"{len(shards)} master-weight shards but {len(shapes)} shapes")
    if windows.shape != (len(shards), 2) or windows.dtype != np.int32:
        raise ValueError(f"shard windows must be int32 of shape ({len(shards)}, 2), got {windows.dtype}{windows.shape}")
    for s in shards:
        if s.ndim != 1:
            raise ValueError(f"a master-weight shard must be flat (rank 1), got shape {s.shape}")
        if s.dtype != shards[0].dtype:
            raise ValueError(f"the shards of one call must share a dtype, got {shards[0].dtype} and {s.dtype}")


def _amax_abstract(windows, *shards, shapes, scheme):
    _check_group(windows, shards, shapes, scheme)
    return [_packed(shapes, scheme, windows, *shards)]


def _cast_abstract(windows, glob, *shards, shapes, scheme):
    _check_group(windows, shards, shapes, scheme)
    want = _packed(shapes, scheme)
    if (glob.shape, glob.dtype) != (want.shape, want.dtype):
        raise ValueError(f"partial cast: global scales {glob.dtype}{glob.shape} do not match the weights "
                         f"({want.dtype}{want.shape})")
    datas = [out_aval(s.shape, np.uint8, windows, glob, *shards) for s in shards for _ in scheme.kernel_blocks]
    # the fp32 scale_inv depends on the global scales alone: replicated wherever they are
    return datas + ([] if scheme.format.partials_are_scales else [_packed(shapes, scheme, glob, dtype=np.float32)])


def _attrs(shapes, scheme):
    return dict(Ms=np.array([m for m, _ in shapes], np.int64), Ks=np.array([k for _, k in shapes], np.int64),
                scheme=scheme.ffi_attrs())


def _amax_ffi(ctx, windows, *shards, shapes, scheme):
    return ffi.ffi_lowering("jf_partial_amax")(ctx, windows, *shards, **_attrs(shapes, scheme))


def _cast_ffi(ctx, windows, glob, *shards, shapes, scheme):
    # the FFI target returns scale_inv first (an empty placeholder where the reduced values are the
    # scales: E8M0), then the data
    fp32 = not scheme.format.partials_are_scales
    datas = ctx.avals_out[:len(ctx.avals_out) - fp32]
    sinv = ctx.avals_out[-1] if fp32 else ShapedArray((0,), np.float32)
    outs = ffi.ffi_lowering("jf_partial_cast")(ctx.replace(avals_out=[sinv, *datas]), windows, glob, *shards,
                                               **_attrs(shapes, scheme))
    return list(outs[1:]) + ([outs[0]] if fp32 else [])


_HINT = "The master-weight cast is not differentiable; gradients go to the fp32 master weights."
partial_amax_p = define_primitive("jf_partial_amax", abstract=_amax_abstract, reference=contracts.partial_amax_group,
                                  ffi_rules=dict(cpu=_amax_ffi, cuda=_amax_ffi), multiple_results=True,
                                  no_jvp_hint=_HINT)
partial_cast_p = define_primitive("jf_partial_cast", abstract=_cast_abstract, reference=contracts.partial_cast_group,
                                  ffi_rules=dict(cpu=_cast_ffi, cuda=_cast_ffi), multiple_results=True,
                                  no_jvp_hint=_HINT)
