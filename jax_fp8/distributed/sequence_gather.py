"""Sequence-parallel all-gather along the first dim of quantized activations (inside shard_map).

Fast path: when the local first dim keeps every block that spans it inside one rank (the local rows of
the 2-D view are a multiple of the tallest block asked for: 32 for MXFP8 columnwise, 128 for Float8
128x1 and 128x128; rowwise-only blocks never span rows), quantize locally (or take the already-quantized
input) and all-gather FP8 data and scales. Fallback: dequantize (if quantized), all-gather in high
precision, quantize the gathered tensor. Either way the result equals quantizing the gathered tensor.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from .. import vma
from ..arrays import bitcast, view_2d
from ..quantization import dequantize, quantize, to_layout
from ..scheme import Scheme
from ..tensors import QUANTIZED_TENSORS
from ..warn import GatherWarning, warn


def _gather(a, axis_name, axis: int = 0):
    """Tiled all-gather. 8-bit floats (FP8 data, E8M0 scales) travel as their bytes: XLA's CPU
    collectives widen them to f16, twice the bytes (seen in the compiled shard_map example)."""
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 1:
        return bitcast(lax.all_gather(bitcast(a, jnp.uint8), axis_name, axis=axis, tiled=True), a.dtype)
    return lax.all_gather(a, axis_name, axis=axis, tiled=True)


def _varying(x, axis_name):
    """``x`` typed as varying over ``axis_name``, as ``lax.all_gather`` casts its operand: for a
    replicated ``x`` the cast's transpose sums the reduce-scattered gradient over the ranks."""
    return vma.vary(x, axis_name if isinstance(axis_name, tuple) else (axis_name,))


def _scatter_grad(axis_name, *static_and_g):
    """The VJP of a gather along the first dim: reduce-scatter the gradient (the last argument)."""
    return (lax.psum_scatter(static_and_g[-1], axis_name, scatter_dimension=0, tiled=True),)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_high(x, axis_name):
    return _gather(x, axis_name)


_gather_high.defvjp(lambda x, axis_name: (_gather(x, axis_name), None), _scatter_grad)


def gather_high(x, axis_name):
    """All-gather along the first dim (``lax.all_gather(x, axis_name, tiled=True)``, 8-bit floats as
    bytes); its VJP reduce-scatters the gradient (psum_scatter)."""
    return _gather_high(_varying(x, axis_name), axis_name)


def _gather_quantized(q, axis_name, ranks: int):
    """Every field of ``q`` gathered along the tensor's first dim, in ``q``'s own layout.

    GEMM-ready tensors are gathered as they are, not converted around a compact gather: the FP8 data
    moves the same bytes either way, and converting would add a transpose of the whole gathered
    columnwise data on every rank. Transposed columnwise data (K, M) gathers along its second axis;
    GEMM-ready scales (small) travel without their padding, in compact order, and are laid out again.
    """
    scheme = q.scheme
    M, K = view_2d(q.shape)
    shape = (q.shape[0] * ranks, *q.shape[1:])
    gemm_scales = scheme.gemm_ready_scales
    fields = {}
    for usage in q.usage_blocks():
        if scheme.shared_tiles and fields:  # compact 128x128 tiles: the colwise fields are the rowwise ones
            fields.update(colwise_data=fields["rowwise_data"], colwise_scale_inv=fields["rowwise_scale_inv"])
            break
        data, scale = getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv")
        fields[f"{usage}_data"] = _gather(data, axis_name, 1 if scheme.transposed_data(usage) else 0)
        if gemm_scales:
            scale = scheme.scales_to_layout(jnp, scale, M, K, usage, "compact")
        scale = _gather(scale, axis_name)
        if gemm_scales:
            scale = scheme.scales_to_layout(jnp, scale, M * ranks, K, usage, "gemm_ready")
        fields[f"{usage}_scale_inv"] = scale
    return dataclasses.replace(q, **fields, shape=shape)


def _keep(q, scheme: Scheme):
    """Drop the usages ``scheme`` does not ask for."""
    dropped = {f"{u}_{f}": None for u in ("rowwise", "colwise") if not getattr(scheme, u)
               for f in ("data", "scale_inv")}
    kept = dataclasses.replace(q.scheme, rowwise=scheme.rowwise, colwise=scheme.colwise)
    return q.with_scheme(kept, **dropped)


def all_gather_first_dim(x, axis_name, scheme: Optional[Scheme] = None):
    """All-gather ``x`` along its first dim over ``axis_name`` (inside shard_map), quantized.

    Args:
      x: a high-precision array (rank >= 2 for quantized gathers) or an MXFP8Tensor / BlockwiseTensor.
      scheme: what to produce. None: a high-precision ``x`` is gathered as is (differentiable: the
        backward is a reduce-scatter); a quantized ``x`` is gathered in its own format.

    The path is chosen first, at trace time, from static shapes: FP8 travels when the local rows keep
    every block inside one rank; otherwise (one warning) the input is dequantized if quantized,
    gathered in high precision and quantized after the gather. A quantized ``x`` that lacks a usage
    the scheme asks for, or is in another format, is converted from its dequantized values (a
    second rounding: it warns); on the fallback path that is the gathered tensor, never a local
    requantization. Either way the result equals quantizing the gathered (dequantized) tensor.
    """
    ranks = vma.axis_size(axis_name, "all_gather_first_dim")
    quantized = isinstance(x, QUANTIZED_TENSORS)
    if scheme is None:
        if not quantized:
            return gather_high(x, axis_name)
        scheme = x.scheme
    if not isinstance(scheme, Scheme):
        raise TypeError("all_gather_first_dim: scheme must be a jax_fp8.Scheme or None, got "
                        f"{scheme!r}; e.g. jf.Scheme('mxfp8', rowwise=True, colwise=True)")
    shape = x.shape
    if len(shape) < 2:
        raise ValueError(f"all_gather_first_dim: a quantized gather needs rank >= 2, got shape {shape}")
    if quantized and scheme.satisfied_by(dataclasses.replace(x.scheme, layout=scheme.layout)):
        x = to_layout(x, scheme.layout)  # the same bits, rearranged if the layouts differ: exact
    convert = quantized and not scheme.satisfied_by(x.scheme)
    if convert:
        warn(f"all_gather_first_dim: the input is {x.scheme} but {scheme} was asked for: "
             "requantizing its dequantized values (a second rounding)", GatherWarning)
    rows = view_2d(shape)[0]
    if rows % scheme.block_rows == 0:
        if quantized and not convert:
            q = _keep(x, scheme)
        else:
            q = quantize(dequantize(x) if quantized else x, scheme)
        return _gather_quantized(q, axis_name, ranks)
    warn(f"all_gather_first_dim: local shape {tuple(shape)} has {rows} rows, not a multiple of the "
         f"{scheme.block_rows}-row blocks of {scheme.fmt}; gathering in high precision and "
         "quantizing after the gather", GatherWarning)
    hp = dequantize(x) if quantized else x
    return quantize(_gather(hp, axis_name), scheme)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather_dequantized(x, axis_name, scheme: Scheme, usage: str):
    return dequantize(all_gather_first_dim(x, axis_name, scheme), x.dtype, usage)


_all_gather_dequantized.defvjp(
    lambda x, axis_name, scheme, usage: (_all_gather_dequantized(x, axis_name, scheme, usage), None),
    _scatter_grad)


def all_gather_dequantized(x, axis_name, scheme: Scheme, usage: str = "rowwise"):
    """``dequantize(all_gather_first_dim(x, axis_name, scheme), usage=usage)`` in ``x.dtype`` with a
    straight-through backward: the gradient is reduce-scattered as for a plain all-gather.

    ``x`` is a high-precision array; ``scheme`` (required) says what the forward quantizes to. The
    result is typed as ``lax.all_gather``'s (varying over ``axis_name`` inside ``shard_map``), and so
    is the gradient: a replicated ``x`` gets the sum over the ranks, as with ``lax.all_gather``."""
    if not isinstance(scheme, Scheme):
        raise TypeError("all_gather_dequantized: scheme must be a jax_fp8.Scheme (the format "
                        f"of the forward), got {scheme!r}; for an unquantized gather use all_gather_first_dim")
    if usage not in ("rowwise", "colwise") or not getattr(scheme, usage):
        raise ValueError(f"all_gather_dequantized: usage must be a usage the scheme produces "
                         f"({[u for u in ('rowwise', 'colwise') if getattr(scheme, u)]}), got {usage!r}")
    vma.axis_size(axis_name, "all_gather_dequantized")
    return _all_gather_dequantized(_varying(x, axis_name), axis_name, scheme, usage)
