"""Sequence-parallel all-gather along the first dim of quantized activations (inside shard_map).

Fast path: when the local first dim keeps every block that spans it inside one rank (the local rows of
the 2-D view are a multiple of the tallest block asked for: 32 for MXFP8 columnwise, 128 for Float8
128x1 and 128x128; rowwise-only blocks never span rows), quantize locally (or take the already-quantized
input) and all-gather FP8 data and scales. Fallback: dequantize (if quantized), all-gather in high
precision, quantize the gathered tensor. Either way the result equals quantizing the gathered tensor.
"""
from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .api import dequantize, quantize_blockwise, quantize_mxfp8
from .formats import FLOAT8_BLOCK, MX_BLOCK, fp8_dtype, view_2d
from .quantize import check_amax_epsilon, check_block
from .tensors import BlockwiseTensor, MXFP8Tensor


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """What to quantize to: ``fmt`` 'mxfp8' or 'blockwise' (with ``block`` (1, 128) or (128, 128)),
    the FP8 ``dtype``, which usages (``rowwise``, ``colwise``), and the blockwise scale options."""

    fmt: str = "mxfp8"
    dtype: object = jnp.float8_e4m3fn
    rowwise: bool = True
    colwise: bool = False
    block: tuple = (1, FLOAT8_BLOCK)
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if self.fmt not in ("mxfp8", "blockwise"):
            raise ValueError(f"Quantizer: fmt must be 'mxfp8' or 'blockwise', got {self.fmt!r}")
        for name in ("rowwise", "colwise", "pow2_scales"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"Quantizer: {name} must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if not (self.rowwise or self.colwise):
            raise ValueError("Quantizer: at least one of rowwise, colwise must be True")
        object.__setattr__(self, "dtype", fp8_dtype(self.dtype, "Quantizer: dtype"))
        block = check_block(self.block, "Quantizer") if self.fmt == "blockwise" else (1, FLOAT8_BLOCK)
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "amax_epsilon", check_amax_epsilon(self.amax_epsilon, "Quantizer"))

    def __str__(self) -> str:
        usages = "+".join(u for u in ("rowwise", "colwise") if getattr(self, u))
        if self.fmt == "mxfp8":
            return f"mxfp8 {self.dtype.name} {usages}"
        bm, bk = self.block
        return (f"blockwise {bm}x{bk} {self.dtype.name} {usages} (pow2_scales={self.pow2_scales}, "
                f"amax_epsilon={self.amax_epsilon})")

    @classmethod
    def of(cls, q: Union[MXFP8Tensor, BlockwiseTensor]) -> "Quantizer":
        """The quantizer that produced ``q``."""
        if isinstance(q, MXFP8Tensor):
            return cls("mxfp8", q.fp8_dtype, q.has_rowwise, q.has_colwise)
        return cls("blockwise", q.fp8_dtype, q.has_rowwise, q.has_colwise, q.block, q.pow2_scales, q.amax_epsilon)

    def quantize(self, x):
        if self.fmt == "mxfp8":
            return quantize_mxfp8(x, self.dtype, self.rowwise, self.colwise)
        return quantize_blockwise(x, self.block, self.dtype, self.pow2_scales, self.amax_epsilon, self.colwise,
                                  self.rowwise)

    @property
    def block_rows(self) -> int:
        """Height of the tallest block among the usages asked for (1 when no block spans rows)."""
        if self.fmt == "mxfp8":
            return MX_BLOCK if self.colwise else 1
        return FLOAT8_BLOCK if self.colwise or self.block == (FLOAT8_BLOCK, FLOAT8_BLOCK) else 1

    def _format(self) -> tuple:
        """What fixes the bits of a usage (MXFP8 has no block or scale options)."""
        if self.fmt == "mxfp8":
            return (self.fmt, self.dtype)
        return (self.fmt, self.dtype, self.block, bool(self.pow2_scales), float(self.amax_epsilon))

    def satisfied_by(self, q) -> bool:
        """Whether ``q`` already holds every usage this quantizer asks for, in this format."""
        other = Quantizer.of(q)
        return (other._format() == self._format() and (other.rowwise or not self.rowwise)
                and (other.colwise or not self.colwise))


def _gather(a, axis_name):
    return lax.all_gather(a, axis_name, axis=0, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_high(x, axis_name):
    """All-gather along the first dim; its VJP reduce-scatters the gradient (psum_scatter)."""
    return _gather(x, axis_name)


gather_high.defvjp(lambda x, axis_name: (_gather(x, axis_name), None),
                   lambda axis_name, _, g: (lax.psum_scatter(g, axis_name, scatter_dimension=0, tiled=True),))


def _gather_quantized(q, axis_name, ranks: int):
    fields = {f: (None if getattr(q, f) is None else _gather(getattr(q, f), axis_name))
              for f in ("rowwise_data", "rowwise_scale_inv", "colwise_data", "colwise_scale_inv")}
    return dataclasses.replace(q, **fields, shape=(q.shape[0] * ranks, *q.shape[1:]))


def _keep(q, quantizer: Quantizer):
    """Drop usages the quantizer did not ask for."""
    return dataclasses.replace(q, **({} if quantizer.rowwise else dict(rowwise_data=None, rowwise_scale_inv=None)),
                               **({} if quantizer.colwise else dict(colwise_data=None, colwise_scale_inv=None)))


def all_gather_first_dim(x, axis_name, quantizer: Optional[Quantizer] = None):
    """All-gather ``x`` along its first dim over ``axis_name`` (inside shard_map), quantized.

    Args:
      x: a high-precision array (rank >= 2 for quantized gathers) or an MXFP8Tensor / BlockwiseTensor.
      quantizer: what to produce. None: a high-precision ``x`` is gathered as is (differentiable: the
        backward is a reduce-scatter); a quantized ``x`` is gathered in its own format.

    The path is chosen first, at trace time, from static shapes: FP8 travels when the local rows keep
    every block inside one rank; otherwise (one warning) the input is dequantized if quantized,
    gathered in high precision and quantized after the gather. A quantized ``x`` that lacks a usage
    the quantizer asks for, or is in another format, is converted from its dequantized values (a
    second rounding: it warns); on the fallback path that is the gathered tensor, never a local
    requantization. Either way the result equals quantizing the gathered (dequantized) tensor.
    """
    ranks = lax.psum(1, axis_name)
    quantized = isinstance(x, (MXFP8Tensor, BlockwiseTensor))
    if quantizer is None:
        if not quantized:
            return gather_high(x, axis_name)
        quantizer = Quantizer.of(x)
    if not isinstance(quantizer, Quantizer):
        raise TypeError("all_gather_first_dim: quantizer must be a jax_fp8.distributed.Quantizer or None, got "
                        f"{quantizer!r}; e.g. Quantizer('mxfp8', rowwise=True, colwise=True)")
    shape = x.shape
    if len(shape) < 2:
        raise ValueError(f"all_gather_first_dim: a quantized gather needs rank >= 2, got shape {shape}")
    convert = quantized and not quantizer.satisfied_by(x)
    if convert:
        warnings.warn(f"all_gather_first_dim: the input is {Quantizer.of(x)} but {quantizer} was asked for: "
                      "requantizing its dequantized values (a second rounding)", stacklevel=2)
    rows = view_2d(shape)[0]
    if rows % quantizer.block_rows == 0:
        if quantized and not convert:
            q = _keep(x, quantizer)
        else:
            q = quantizer.quantize(dequantize(x) if quantized else x)
        return _gather_quantized(q, axis_name, ranks)
    warnings.warn(f"all_gather_first_dim: local shape {tuple(shape)} has {rows} rows, not a multiple of the "
                  f"{quantizer.block_rows}-row blocks of {quantizer.fmt}; gathering in high precision and "
                  "quantizing after the gather", stacklevel=2)
    hp = dequantize(x) if quantized else x
    return quantizer.quantize(_gather(hp, axis_name))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_gather_dequantized(x, axis_name, quantizer: Quantizer, usage: str = "rowwise"):
    """``dequantize(all_gather_first_dim(x, axis_name, quantizer), usage=usage)`` in ``x.dtype`` with a
    straight-through backward: the gradient is reduce-scattered as for a plain all-gather.

    ``x`` is a high-precision array; ``quantizer`` (required) says what the forward quantizes to."""
    if not isinstance(quantizer, Quantizer):
        raise TypeError("all_gather_dequantized: quantizer must be a jax_fp8.distributed.Quantizer (the format "
                        f"of the forward), got {quantizer!r}; for an unquantized gather use all_gather_first_dim")
    if usage not in ("rowwise", "colwise") or not getattr(quantizer, usage):
        raise ValueError(f"all_gather_dequantized: usage must be a usage the quantizer produces "
                         f"({[u for u in ('rowwise', 'colwise') if getattr(quantizer, u)]}), got {usage!r}")
    return dequantize(all_gather_first_dim(x, axis_name, quantizer), x.dtype, usage)


all_gather_dequantized.defvjp(
    lambda x, axis_name, quantizer, usage: (all_gather_dequantized(x, axis_name, quantizer, usage), None),
    lambda axis_name, quantizer, usage, _, g: (lax.psum_scatter(g, axis_name, scatter_dimension=0, tiled=True),))
