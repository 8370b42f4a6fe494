"""``jf_quantize_grouped``: (B, M, K) rows in groups (:mod:`jax_fp8.groups`, the groups of
``lax.ragged_dot``) quantized into GEMM-ready Float8 blockwise 1x128 operands, both usages in one call:
rowwise blocks as ``jf_quantize``'s, columnwise blocks of 128 rows that restart at every group start,
so that no block's scale mixes two groups (a mixture-of-experts weight gradient contracts each
expert's rows alone), each group's columns from a 16-aligned start (``groups.col_starts``: where the
grouped GEMM's TMA loads can start). The contract: :func:`jax_fp8.contracts.quantize_grouped_usages`, per matrix.

The group sizes (B, G) int32 are read on the device: one compiled call serves every routing. Under
``jax.jit`` on a mesh the batch and the last dim split; the rows and the groups are gathered, with a
warning (a group's blocks may span any rows). Under ``vmap`` the mapped dim joins the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._compat import ShapedArray, ffi
from .. import contracts, groups
from ..arrays import cdiv
from ..formats import BLOCKWISE, FLOAT8_BLOCK
from ..scheme import GEMM_SCALE_PAD, Scheme
from ..vma import out_aval
from .partitioning import Dim, Rule
from .quantize import scale_dims
from .registration import define_primitive

_FFI_RESULTS = 4  # as jf_quantize: two (data, scale) result slots, unused ones empty


def check_scheme(scheme: Scheme, where: str) -> None:
    """The schemes a grouped quantize takes: Float8 blockwise, 1x128 blocks, GEMM-ready."""
    if not (scheme.format is BLOCKWISE and scheme.block == (1, FLOAT8_BLOCK) and scheme.gemm_ready):
        raise ValueError(f"{where} takes GEMM-ready Float8 blockwise 1x{FLOAT8_BLOCK} blocks, got {scheme}")


def _check(x_shape, sizes_shape, sizes_dtype) -> tuple:
    """(B, M, K, G) of a call, its shapes checked."""
    if len(x_shape) != 3:
        raise ValueError(f"jf_quantize_grouped takes a (batch, rows, cols) array, got shape {x_shape}")
    if len(sizes_shape) != 2 or sizes_shape[0] != x_shape[0] or np.dtype(sizes_dtype) != np.int32:
        raise ValueError(f"jf_quantize_grouped: the group sizes must be int32 (batch, groups) with the batch of x "
                         f"{x_shape}, got {np.dtype(sizes_dtype).name}{tuple(sizes_shape)}")
    return (*x_shape, sizes_shape[1])


def output_shapes(scheme: Scheme, M: int, K: int, G: int) -> list:
    """(data shape, scale shape) of each output of one (M, K) matrix in G groups, in
    ``scheme.kernel_usages`` order."""
    outs = []
    for usage, (data, scale) in zip(scheme.output_usages, scheme.kernel_outputs((M, K))):
        if usage == "colwise":
            data = (K, groups.col_count(M, G))
            scale = (groups.block_slots(M, G, FLOAT8_BLOCK), scale[1])
        outs.append((data, scale))
    return outs


def _abstract(x, group_sizes, *, scheme):
    check_scheme(scheme, "jf_quantize_grouped")
    B, M, K, G = _check(x.shape, group_sizes.shape, group_sizes.dtype)
    outs = []
    for data, scale in output_shapes(scheme, M, K, G):
        outs += [out_aval((B, *data), np.uint8, x, group_sizes), out_aval((B, *scale), np.float32, x, group_sizes)]
    return outs


def _reference(x, group_sizes, *, scheme):
    return jax.vmap(lambda x, s: contracts.quantize_grouped_usages(x, s, scheme=scheme))(x, group_sizes)


def _ffi_lowering(ctx, x, group_sizes, *, scheme):
    n = len(ctx.avals_out)
    padded = list(ctx.avals_out) + [ShapedArray((0,), np.uint8)] * (_FFI_RESULTS - n)
    outs = ffi.ffi_lowering("jf_quantize_grouped")(ctx.replace(avals_out=padded), x, group_sizes,
                                                   scheme=scheme.ffi_attrs())
    return outs[:n]


def _batch(args, dims, *, scheme):
    """vmap: the mapped dim joins the batch (group sizes broadcast where only x is mapped, and back)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x, sizes = (jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
                for a, d in zip(args, dims))
    b, B = x.shape[:2]
    outs = quantize_grouped_p.bind(x.reshape(b * B, *x.shape[2:]), sizes.reshape(b * B, *sizes.shape[2:]),
                                   scheme=scheme)
    return [o.reshape(b, B, *o.shape[1:]) for o in outs], [0] * len(outs)


# ---- partitioning: the batch and the last dim split; the rows and the groups stay whole -----------------
_NAMES = dict(b="the batch dim", k="the last dim", m="the rows (leading dims)", g="the groups")


def _sizes(shapes, params):
    B, M, K, G = _check(shapes[0], shapes[1], np.int32)
    return dict(b=B, k=K, m=M, g=G)


def _arrays(sizes, params):
    scheme = params["scheme"]
    b, k, m, g = (Dim(label, sizes[label]) for label in ("b", "k", "m", "g"))
    outs = []
    for usage in scheme.output_usages:
        if usage == "rowwise":
            outs += [(b, m, k), (b, *scale_dims(scheme, m.size, k.size, usage))]
        else:
            slots = Dim(None, groups.block_slots(m.size, g.size, FLOAT8_BLOCK))
            outs += [(b, k, Dim(None, groups.col_count(m.size, g.size))), (b, slots, Dim("k", cdiv(k.size, 4) * 4, 1, 4))]
    return [(b, m, k), (b, g)], outs


def _why_not(label, local, sizes, params):
    if label == "m":
        return "a group's 128-row blocks may start at any row"
    if label == "g":
        return "each group's rows start where the groups before it end"
    return None


quantize_grouped_p = define_primitive(
    "jf_quantize_grouped", abstract=_abstract, reference=_reference,
    ffi_rules=dict(cpu=_ffi_lowering, cuda=_ffi_lowering), batch=_batch,
    rule=Rule(tuple(_NAMES), _NAMES, _sizes, _arrays, why_not=_why_not, pad_value=GEMM_SCALE_PAD),
    multiple_results=True,
    no_jvp_hint="fp8_ragged_dot's VJP uses it on the forward's operands; use jax_fp8.fp8_ragged_dot to differentiate.")
