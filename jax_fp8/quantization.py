"""How quantized tensors map onto the kernels' arrays and back: the one place that turns a scheme and
an input into a tensor, and a tensor into high-precision values.

Written once and run over two kernel sets (:class:`Kernels`): ``PRIMITIVES`` (our FFI kernels) for
the public API (``api.py``) and ``CONTRACTS`` (their jax.numpy contracts) for ``jax_fp8.reference``.
Kernels see (B, M, K) arrays; tensors keep the input's N-D shape with 2-D scales of the
(prod(shape[:-1]), shape[-1]) view.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import jax

import numpy as np
import jax.numpy as jnp

from . import contracts, producers, vma
from .arrays import bitcast, view_2d, xp_of
from .formats import check_input, high_dtype
from .primitives import dequantize_p, norm_grad_p, produce_p, produce_quantize_p, quantize_grouped_p, quantize_p
from .primitives.produce import produced_shape
from .primitives.partitioning import rows_view
from .scheme import LAYOUTS, Scheme
from .tensors import QUANTIZED_TENSORS


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A kernel set. ``quantize(x3, scheme=...)`` takes a (B, M, K) float array and returns, per output
    of ``Scheme.kernel_outputs``, the FP8 data as uint8 and the scales, each with a leading B (data
    (B, M, K), or (B, K, M) transposed for GEMM-ready columnwise data). ``dequantize(data3, scale3,
    scheme=..., out_dtype=...)`` takes one usage's compact uint8 data and scales (``scheme`` holds just
    that usage) and returns (B, M, K) values."""

    quantize: Callable
    dequantize: Callable


#: The kernel set of the public API: our FFI kernels, through their primitives.
PRIMITIVES = Kernels(quantize=quantize_p.bind, dequantize=dequantize_p.bind)
#: The kernel set of ``jax_fp8.reference``: the kernels' jax.numpy contracts.
CONTRACTS = Kernels(quantize=contracts.quantize_usages, dequantize=contracts.dequantize_blocks)


def _kernel_pairs(scheme: Scheme, outs) -> list:
    """The kernels' outputs (data as uint8, scale, data, scale, ...) as (FP8 data, scale) pairs in
    ``kernel_usages`` order, each with the kernels' leading batch dim."""
    return [(bitcast(outs[2 * i], scheme.dtype), outs[2 * i + 1]) for i in range(len(scheme.kernel_usages))]


def assemble(scheme: Scheme, pairs, shape, dtype):
    """The tensor of ``scheme`` from the kernels' (data, scale) pairs, given in ``kernel_usages`` order;
    data already has the layout's shape and the FP8 dtype. Compact 128x128 tiles serve both usages."""
    got = dict(zip(scheme.kernel_usages, pairs))
    if "tile" in got:
        got = {u: got["tile"] for u in ("rowwise", "colwise") if getattr(scheme, u)}
    row, col = got.get("rowwise", (None, None)), got.get("colwise", (None, None))
    return scheme.format.tensor_class(*row, *col, tuple(shape), jnp.dtype(dtype), scheme)


def quantize(x, scheme: Scheme, kernels: Kernels = PRIMITIVES):
    """Quantize ``x`` (validated here) with ``scheme`` on ``kernels``."""
    x = check_input(x)
    M, K = view_2d(x.shape)
    shapes = scheme.kernel_outputs(x.shape)
    if x.size == 0:  # empty input: empty data and scales of the documented shapes
        xp = xp_of(x)
        fill = scheme.format.empty_scale
        pairs = [(xp.zeros(d, scheme.dtype), xp.full(sc, fill, scheme.scale_dtype)) for d, sc in shapes]
        pairs = vma.vary(pairs, vma.axes_of(x))  # per-device wherever x is, as the kernels' outputs
    else:
        # 2-D, then [None]: an Explicit mesh types these reshapes (jax rejects a direct (1, M, K))
        outs = kernels.quantize(rows_view(x, (M, K))[None], scheme=scheme)
        pairs = [(rows_view(data[0], d), scale[0]) for (data, scale), (d, _) in zip(_kernel_pairs(scheme, outs), shapes)]
    return assemble(scheme, pairs, x.shape, x.dtype)


def _producer_call(producer: str, args, out_dtype):
    """A producer's kernel arguments: its inputs as (1, rows, cols) views (a norm's gamma and beta as they
    are), the inputs' leading dims, the produced last dim K and the produced dtype."""
    norm = producer in producers.NORMS
    rows = [a if norm and i >= 1 else rows_view(a, view_2d(a.shape))[None] for i, a in enumerate(args)]
    _, _, K = produced_shape(producer, [r.shape for r in rows])
    dtype = producers.produced_dtype(producer, tuple(jnp.dtype(a.dtype) for a in args), out_dtype)
    return rows, tuple(args[0].shape[:-1]), K, dtype


def produce(producer: str, *args, eps: float = 0.0, out_dtype=None):
    """A producer's tensor (:mod:`jax_fp8.producers`) on the ``jf_produce`` kernels, rounded to the produced
    dtype (``out_dtype``, else the input's), NaNs canonical; and its extra outputs (a norm's statistics of
    every row, :func:`~jax_fp8.producers.stats_shape`). Inputs as :func:`produce_quantize`'s."""
    rows, lead, K, dtype = _producer_call(producer, args, out_dtype)
    y, *extras = produce_p.bind(*rows, producer=producer, eps=float(eps), out_dtype=dtype)
    return rows_view(y[0], (*lead, K)), [e[0].reshape(producers.stats_shape(producer, lead)) for e in extras]


def norm_grad(norm: str, x, gamma, stats, dy):
    """The backward of a norm (``"rmsnorm"`` or ``"layernorm"``) on the ``jf_norm_grad`` kernels
    (:func:`jax_fp8.producers.norm_grad`'s numbers): x and dy (..., K), gamma (K,), the forward's statistics
    (:func:`~jax_fp8.producers.stats_shape` of x's leading dims). Returns dx (x's shape and dtype) and the
    column sums: dgamma, float32 (K,), and LayerNorm's dbeta, float32 (K,)."""
    lead, K = tuple(x.shape[:-1]), x.shape[-1]
    rows = view_2d(x.shape)
    x3, dy3 = rows_view(x, rows)[None], rows_view(dy, rows)[None]
    stats3 = rows_view(stats, producers.stats_shape(norm, rows[:1]))[None]
    dx, sums = norm_grad_p.bind(x3, gamma, stats3, dy3, norm=norm)
    return rows_view(dx[0], (*lead, K)), *sums


def produce_quantize(producer: str, *args, scheme: Scheme, eps: float = 0.0, out_dtype=None):
    """A producer's tensor (:mod:`jax_fp8.producers`) quantized with ``scheme`` in one kernel (the
    ``jf_produce_quantize`` primitive), and the producer's extra outputs (a norm's statistics of every row:
    RMSNorm's rstd ``x.shape[:-1]``, LayerNorm's (mean, rstd) ``x.shape[:-1] + (2,)``). The N-D inputs
    (..., cols) are viewed as rows; a norm's gamma and beta are (K,). The
    tensor has the inputs' leading dims and the produced last dim, and the produced dtype (``out_dtype``,
    else the input's)."""
    rows, lead, K, dtype = _producer_call(producer, args, out_dtype)
    outs = produce_quantize_p.bind(*rows, producer=producer, scheme=scheme, eps=float(eps), out_dtype=dtype)
    n = 2 * len(scheme.kernel_usages)
    shapes = scheme.kernel_outputs((*lead, K))
    pairs = [(rows_view(data[0], d), scale[0]) for (data, scale), (d, _) in zip(_kernel_pairs(scheme, outs[:n]), shapes)]
    extras = [e[0].reshape(producers.stats_shape(producer, lead)) for e in outs[n:]]
    return assemble(scheme, pairs, (*lead, K), dtype), extras


def quantize_grouped(x, group_sizes, scheme: Scheme) -> dict:
    """Each usage's (FP8 data, scale) of the (M, K) array ``x`` whose rows lie in the groups of
    ``group_sizes`` (G,) int32 (:mod:`jax_fp8.groups`), quantized with the GEMM-ready 1x128 ``scheme``
    (``jf_quantize_grouped``): rowwise data (M, K) and scales (ceil(K/128), roundup(M, 4)); columnwise
    data (K, M) and scales (slots, roundup(K, 4)), its 128-row blocks restarting at every group start.
    Rows in no group: data 0."""
    outs = quantize_grouped_p.bind(x[None], group_sizes[None], scheme=scheme)
    return dict(zip(scheme.kernel_usages, [(d[0], sc[0]) for d, sc in _kernel_pairs(scheme, outs)]))


def quantize_each(x3, scheme: Scheme) -> dict:
    """Each usage's (FP8 data, scale) of every (M, K) matrix of the (B, M, K) array ``x3`` quantized on its
    own (a mixture of experts' weights: no 128x128 tile spans two experts), with a leading B: the
    layouts of :meth:`Scheme.kernel_outputs` for one matrix."""
    return dict(zip(scheme.kernel_usages, _kernel_pairs(scheme, quantize_p.bind(x3, scheme=scheme))))


def quantize_stacked(x3, scheme: Scheme) -> dict:
    """Each usage's (FP8 data, scale) of the (B, S, K) array ``x3`` (S % 128 == 0) quantized with the
    GEMM-ready 1x128 ``scheme`` as its B*S rows, B kept as a dim of its own beside S: rowwise data
    (B, S, K) and scales (K/128, B, S), columnwise data (K, B, S) and scales (B, S/128, K) (the stacked
    operands of ``jf_fp8_gemm``, which folds them by reshapes)."""
    return dict(zip(scheme.kernel_usages, _kernel_pairs(scheme, quantize_p.bind(x3, scheme=scheme, stacked=True))))


def dequantize(q, dtype=None, usage: Optional[str] = None, kernels: Kernels = PRIMITIVES):
    """``data * scale`` of one usage of ``q`` (default: rowwise when present), rounded to ``dtype``
    (default: the dtype that was quantized). A GEMM-ready tensor is read through its compact form."""
    if not isinstance(q, QUANTIZED_TENSORS):
        raise TypeError(f"dequantize: expected an MXFP8Tensor or BlockwiseTensor, got {type(q).__name__}")
    out_dtype = high_dtype(q.dtype if dtype is None else dtype, "dequantize: dtype")
    if usage is None:
        usage = "rowwise" if q.has_rowwise else "colwise"
    if q.scheme.layout != "compact":
        q = to_layout(q, "compact")  # checks every field against the GEMM-ready layout
    data, scale = q.usage_fields(usage, "dequantize")
    if data.size == 0:
        return vma.vary(xp_of(data).zeros(q.shape, out_dtype), vma.axes_of(data) | vma.axes_of(scale))
    M, K = view_2d(q.shape)
    y = kernels.dequantize(rows_view(bitcast(data, jnp.uint8), (M, K))[None], scale[None], scheme=q.scheme.only(usage),
                           out_dtype=np.dtype(out_dtype))
    return rows_view(y[0], q.shape)


def to_layout(q, layout: str):
    """``q`` in ``layout`` ('compact' or 'gemm_ready'): the same bits, rearranged (exact both ways).

    GEMM-ready: columnwise data transposed to (K, M); Float8 blockwise scales transposed / padded as
    ``Scheme.scale_shape`` says, padding ``GEMM_SCALE_PAD``. MXFP8 scales stay compact.
    """
    if not isinstance(q, QUANTIZED_TENSORS):
        raise TypeError(f"to_layout: expected an MXFP8Tensor or BlockwiseTensor, got {type(q).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"to_layout: layout must be 'compact' or 'gemm_ready', got {layout!r}")
    if q.scheme.layout == layout:
        return q
    scheme, gemm = q.scheme, dataclasses.replace(q.scheme, layout="gemm_ready")
    M, K = view_2d(q.shape)
    fields = {}
    for usage in q.usage_blocks():
        data, scale = q.usage_fields(usage, "to_layout")
        xp = xp_of(data, scale)
        if gemm.transposed_data(usage):  # (K, M) in GEMM-ready, the input's shape in compact
            data = (xp.transpose(rows_view(data, (M, K))) if layout == "gemm_ready"
                    else rows_view(xp.transpose(data), q.shape))
        fields[f"{usage}_data"] = data
        fields[f"{usage}_scale_inv"] = scheme.scales_to_layout(xp, scale, M, K, usage, layout)
    return q.with_scheme(dataclasses.replace(scheme, layout=layout), **fields)


@partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def quantize_dequantize(x, scheme: Scheme, usage: str):
    """``dequantize(quantize(x, scheme), x.dtype, usage)`` on the primitives, with a straight-through
    derivative: the tangent passes unchanged (it is linear, so ``jax.grad`` transposes it into the
    identity VJP, and jvp / jacfwd / hessians see the same rule)."""
    return dequantize(quantize(x, scheme), x.dtype, usage)


@quantize_dequantize.defjvp
def _quantize_dequantize_jvp(scheme, usage, primals, tangents):
    (x,), (t,) = primals, tangents
    return quantize_dequantize(x, scheme, usage), t
