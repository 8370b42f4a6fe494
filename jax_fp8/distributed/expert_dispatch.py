"""Expert-parallel token dispatch (inside ``shard_map``): an all-to-all of activations with FP8 on the wire.

A mixture-of-experts layer split over devices by expert sends each token copy to the device that holds
its expert, and the experts' outputs back (``lax.all_to_all``). :func:`all_to_all_dequantized` sends the
first trip as FP8: the rows quantized in 1xK-block rowwise blocks (the blocks lie along the last dim,
so a row never splits), the FP8 data and the scales exchanged, and the received rows dequantized: the
same values as quantizing the exchanged rows, at a quarter (bf16: half) of the bytes. Its backward is
the gradient's all-to-all in high precision (straight-through: the quantization's derivative taken as 1).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from .. import vma
from ..arrays import bitcast
from ..quantization import dequantize, quantize
from ..scheme import Scheme


def _all_to_all(a, axis_name):
    """``lax.all_to_all`` along the first dim (chunk i to rank i, tiled); 8-bit floats travel as their
    bytes (XLA's CPU collectives widen them to f16)."""
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 1:
        return bitcast(lax.all_to_all(bitcast(a, jnp.uint8), axis_name, 0, 0, tiled=True), a.dtype)
    return lax.all_to_all(a, axis_name, 0, 0, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _exchange(x, axis_name, scheme: Scheme):
    q = quantize(x, scheme)
    lead = x.shape[:-1]
    scale = q.rowwise_scale_inv.reshape(*lead, -1)  # one row of block scales per row of x
    data, scale = _all_to_all(q.rowwise_data, axis_name), _all_to_all(scale, axis_name)
    q = dataclasses.replace(q, rowwise_data=data, rowwise_scale_inv=scale.reshape(q.rowwise_scale_inv.shape))
    return dequantize(q, x.dtype)


_exchange.defvjp(lambda x, axis_name, scheme: (_exchange(x, axis_name, scheme), None),
                 lambda axis_name, scheme, _, g: (_all_to_all(g, axis_name),))


def all_to_all_dequantized(x, axis_name, scheme: Scheme):
    """``lax.all_to_all(x, axis_name, 0, 0, tiled=True)`` (chunk i of the first dim to rank i) with FP8
    on the wire, dequantized on arrival in ``x.dtype``; straight-through backward (the gradient's
    all-to-all, in high precision).

    ``x``: a high-precision array of rank >= 2 whose first dim splits evenly over the ranks of
    ``axis_name``; ``scheme``: a rowwise-only :class:`~jax_fp8.Scheme` (compact layout), its blocks
    along the last dim. The result equals dequantizing ``quantize(lax.all_to_all(x, ...), scheme)``
    bit for bit, and is typed as ``lax.all_to_all``'s (varying over ``axis_name``)."""
    if not isinstance(scheme, Scheme):
        raise TypeError(f"all_to_all_dequantized: scheme must be a jax_fp8.Scheme, got {scheme!r}")
    if not scheme.rowwise or scheme.colwise or scheme.layout != "compact" or scheme.block[0] != 1:
        raise ValueError("all_to_all_dequantized: scheme must be rowwise only, compact, in 1xK blocks (a row's "
                         f"blocks travel with it), got {scheme}")
    if x.ndim < 2:
        raise ValueError(f"all_to_all_dequantized: x must have rank >= 2 (rows, ..., features), got shape {x.shape}")
    ranks = vma.axis_size(axis_name, "all_to_all_dequantized")
    if x.shape[0] % ranks:
        raise ValueError(f"all_to_all_dequantized: the first dim ({x.shape[0]}) must split evenly over the "
                         f"{ranks} ranks of {axis_name!r}")
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return _exchange(vma.vary(x, axes), axis_name, scheme)
