"""The producers that quantization fuses with, as exact fp32 math: RMSNorm and LayerNorm, SwiGLU and GELU
(tanh form) and their derivatives, and the cast of fp32 master weights to the model dtype; and the norms'
backward (``jf_norm_grad``'s contract).

Each producer's value is defined here once, in ``jax.numpy`` / NumPy (same code, :func:`~.arrays.xp_of`),
with every fp32 operation in a fixed order and no fused multiply-add, so that the CPU and CUDA kernels
(``csrc/producers.h``) compute the same bits. A fused kernel's outputs are the composition of the
unfused ops: the produced value rounded to its output dtype (as the unfused program would store it),
then quantized by :func:`~.contracts.quantize_usages` (:func:`produce_quantize`, the contract of the
``jf_produce_quantize`` primitive; :func:`produce_values` is that of ``jf_produce``, the unfused op).

- The row sums (RMSNorm's of x**2; LayerNorm's of x, then of (x - mean)**2): 256 partial sums, partial
  ``v`` adding the terms of elements ``v, v + 256, v + 512, ...`` in order, then a pairwise tree (``v +
  v ^ 128``, then 64, ... 1): what a warp does with 8 consecutive elements per lane and XOR shuffles.
- The norms' backward (:func:`norm_grad`): its row sums in that order too; its column sums (dgamma,
  dbeta) by blocks of :data:`GRAD_ROWS` rows of one batch entry, each from +0 in row order, then the
  blocks' sums from +0 in order.
- ``sigmoid``: ``1 / (1 + e**-g)``, the division IEEE's, with ``e**-g`` from our own ``exp`` on ``-g``
  clamped to [-17, 88] (below, ``1 + e`` rounds to 1 anyway; above, ``1 + e >= 2**126``) and 0 where
  ``1 + e >= 2**126`` (the quotient would be below float32's normal range: flushed, as FTZ would).
  ``exp``: Cody-Waite range reduction (``n = rint(x log2 e)``), a degree-6 polynomial (fitted to e**r
  on [-ln2/2, ln2/2] for the least maximal relative error, coefficients rounded to float32) by Horner's
  rule, then ``2**n`` as the exponent field; within 1.2 ulp of the true exponential on that domain, and
  the same bits everywhere (libm's and CUDA's ``expf`` differ in their last bits). So the GPU computes
  it without a branch or a select (producers.h).

As everywhere in :mod:`jax_fp8.contracts`: XLA's CPU runtime flushes subnormals, so evaluate these on
NumPy inputs where subnormal intermediates must be exact.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import jax.numpy as jnp
from jax import lax

from .arrays import bitcast, xp_of
from .contracts import quantize_usages
from .formats import quiet as _quiet

_F32 = np.float32

#: The producers, in the kernels' numbering (producers.h's Producer).
PRODUCERS = ("cast", "rmsnorm", "swiglu", "swiglu_grad", "gelu", "gelu_grad", "layernorm")
#: How many inputs each producer takes.
N_INPUTS = {"cast": 1, "rmsnorm": 2, "swiglu": 1, "swiglu_grad": 2, "gelu": 1, "gelu_grad": 2, "layernorm": 3}

SUM_LANES = 256  # the row sums' partial sums (producers.h's kSumLanes)

_LOG2E = _F32(1.44269502)         # 0x3FB8AA3B
_LN2_HI = _F32(0.693145751953125)  # 0x3F317200: 15 significant bits, so n * _LN2_HI is exact
_LN2_LO = _F32(1.42860677e-06)    # 0x35BFBE8E: ln 2 - _LN2_HI
#: the domain the sigmoid clamps exp's argument to, and where the sigmoid flushes to 0 (1 + e >= 2**126)
EXP_DOMAIN = (_F32(-17), _F32(88))
_SIGMOID_FLUSH = _F32(2.0 ** 126)
#: GELU's tanh form as a sigmoid (0.5 (1 + tanh z) = sigmoid(2 z)): gelu(x) = x * sigmoid(x * (A + (B x) x)),
#: A = 2 sqrt(2 / pi), B = 0.044715 A; its derivative's (A + (3B x) x) takes x clamped to +-GELU_CLAMP
_GELU_A = _F32(1.5957691669464111)    # 0x3FCC422A
_GELU_B = _F32(0.07135481387376785)   # 0x3D922279
_GELU_B3 = _F32(0.21406444907188416)  # 0x3E5B33B6: 3 B
GELU_CLAMP = _F32(20)  # beyond, s (1 - s) is 0 (|u| > 17), and (3B x) x must not overflow to inf * 0
#: exp's polynomial on [-ln2/2, ln2/2], highest power first (float32 bits: producers.h's kExpPoly)
_EXP_POLY = tuple(np.uint32(b).view(_F32) for b in (0x3AB55C67, 0x3C0936DF, 0x3D2AAC4F, 0x3E2AAA05, 0x3EFFFFFD,
                                                     0x3F800000, 0x3F800000))


def _rounded(v):
    """``v`` kept apart from the op that reads it, where XLA's compilers would fuse the two into other
    arithmetic: ``a * b + c`` into one FMA, ``1 / sqrt(v)`` into rsqrt (NumPy and our kernels round
    each op). A select between them blocks that (XLA removes optimization barriers and no-op
    reduce_precision); only NaN payloads could change."""
    if isinstance(v, (np.ndarray, np.generic)):
        return v
    return jnp.where(jnp.isnan(v), _F32(np.nan), v)


def _f32(xp, v):
    return xp.asarray(v, _F32) if xp is np else v.astype(_F32)


def _canonical_nans(y):
    """``y`` with every NaN the one quiet NaN of its dtype (what the kernels store)."""
    xp = xp_of(y)
    return xp.where(xp.isnan(y), xp.asarray(np.nan, y.dtype), y)


def _pow2(xp, k):
    """2**k (float32) for int32 ``k`` in [-126, 127], exactly: the exponent field alone."""
    return bitcast((k + 127).astype(np.int32) << 23, _F32)


def exp_f32(x):
    """e**x for float32 ``x`` in :data:`EXP_DOMAIN` (see the module docstring): a normal result, 2**n the
    exponent field alone. Outside that domain the result is meaningless: :func:`sigmoid_f32` clamps."""
    xp = xp_of(x)
    x = _f32(xp, x)
    with _quiet():
        n = xp.rint(x * _LOG2E)
        r = (x - _rounded(n * _LN2_HI)) - _rounded(n * _LN2_LO)
        p = xp.full_like(r, _EXP_POLY[0])
        for c in _EXP_POLY[1:]:
            p = _rounded(p * r) + c
        return p * _pow2(xp, n.astype(np.int32))


def sigmoid_f32(g):
    """1 / (1 + e**-g) in float32 (see the module docstring): e**-g by :func:`exp_f32` on -g clamped to
    :data:`EXP_DOMAIN` (NaN: its low end), 0 where 1 + e >= 2**126. A NaN ``g`` gives 1 (SwiGLU's
    products carry the NaN)."""
    xp = xp_of(g)
    lo, hi = EXP_DOMAIN
    with _quiet():
        d = _F32(1) + _rounded(exp_f32(xp.fmin(xp.fmax(-_f32(xp, g), lo), hi)))
        return xp.where(d >= _SIGMOID_FLUSH, _F32(0), _F32(1) / d)


def swiglu_values(h):
    """silu(gate) * up of ``h`` (..., 2F) = [gate | up], in float32 (before rounding)."""
    xp = xp_of(h)
    F = h.shape[-1] // 2
    g, u = _f32(xp, h[..., :F]), _f32(xp, h[..., F:])
    with _quiet():
        return (g * sigmoid_f32(g)) * u


def swiglu(h, out_dtype=None):
    """SwiGLU of ``h`` (..., 2F) = [gate | up]: silu(gate) * up, rounded to ``out_dtype`` (default h's)."""
    return swiglu_values(h).astype(h.dtype if out_dtype is None else out_dtype)


def swiglu_grad(da, h, out_dtype=None):
    """The gradient of :func:`swiglu` with respect to ``h`` (..., 2F), given ``da`` (..., F):
    [da * up * silu'(gate) | da * silu(gate)], silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g), each
    rounded to ``out_dtype`` (default h's)."""
    xp = xp_of(da, h)
    F = h.shape[-1] // 2
    g, u, d = _f32(xp, h[..., :F]), _f32(xp, h[..., F:]), _f32(xp, da)
    with _quiet():
        s = sigmoid_f32(g)
        d_up = d * (g * s)
        d_gate = (d * u) * (s * (_F32(1) + _rounded(g * (_F32(1) - s))))
    out = h.dtype if out_dtype is None else out_dtype
    return xp.concatenate([d_gate.astype(out), d_up.astype(out)], axis=-1)


def _gelu_arg(xp, x):
    """GELU's sigmoid argument x * (A + (B x) x) (module constants), float32."""
    return x * (_GELU_A + _rounded((_GELU_B * x) * x))


def gelu_values(x):
    """GELU (tanh form, ``jax.nn.gelu(approximate=True)``) in float32 before rounding: x * sigmoid(2 z),
    2 z = x * (A + (B x) x), the sigmoid :func:`sigmoid_f32`'s."""
    xp = xp_of(x)
    x = _f32(xp, x)
    with _quiet():
        return x * sigmoid_f32(_gelu_arg(xp, x))


def gelu(x, out_dtype=None):
    """GELU (tanh form) of ``x``, rounded to ``out_dtype`` (default x's)."""
    return gelu_values(x).astype(x.dtype if out_dtype is None else out_dtype)


def gelu_grad(da, x, out_dtype=None):
    """The gradient of :func:`gelu` given ``da``: da * (s + (x * (s (1 - s))) * (A + (3B c) c)), s the
    forward's sigmoid, c = x clamped to +-GELU_CLAMP (NaN: its low end), rounded to ``out_dtype`` (default
    x's)."""
    xp = xp_of(da, x)
    xf, d = _f32(xp, x), _f32(xp, da)
    with _quiet():
        s = sigmoid_f32(_gelu_arg(xp, xf))
        c = xp.fmin(xp.fmax(xf, -GELU_CLAMP), GELU_CLAMP)
        du = _GELU_A + _rounded((_GELU_B3 * c) * c)
        g = s + _rounded((xf * (s * (_F32(1) - s))) * du)
        return (d * g).astype(x.dtype if out_dtype is None else out_dtype)


def row_sum(v, square: bool = False):
    """Sum over the last dim of float32 ``v`` (``square``: of v**2, each square rounded) in the order of the
    module docstring: (...,)."""
    xp = xp_of(v)
    K = v.shape[-1]
    chunks = -(-K // SUM_LANES)
    pad = [(0, 0)] * (v.ndim - 1) + [(0, chunks * SUM_LANES - K)]
    with _quiet():
        t = xp.pad(v, pad).reshape(*v.shape[:-1], chunks, SUM_LANES)
        if square:
            t = _rounded(t * t)
        acc = t[..., 0, :]
        for j in range(1, chunks):
            acc = acc + t[..., j, :]
        while acc.shape[-1] > 1:
            half = acc.shape[-1] // 2
            acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def row_sum_squares(x):
    """Sum over the last dim of x**2 in float32, in the order of the module docstring: (...,)."""
    xp = xp_of(x)
    x = _f32(xp, x)
    return row_sum(x, square=True)


def rms_norm_rstd(x, eps: float):
    """1 / sqrt(mean(x**2) + eps) per row (...,), float32: the mean is the sum of squares times the
    float32 nearest 1 / K (K the row length; XLA turns a division by a constant into that product); a
    NaN is the canonical one."""
    xp = xp_of(x)
    with _quiet():
        ms = _rounded(row_sum_squares(x) * _F32(1.0 / x.shape[-1]))
        rstd = _F32(1) / _rounded(xp.sqrt(ms + _F32(eps)))  # kept apart: XLA rewrites 1 / sqrt as rsqrt
    return _canonical_nans(rstd)  # one NaN (0x7FC00000), whatever the row's NaNs were


def rms_norm_values(x, gamma, rstd):
    """(x * rstd) * gamma in float32 (before rounding); ``rstd`` per row (...,)."""
    xp = xp_of(x, gamma, rstd)
    with _quiet():
        return (_f32(xp, x) * rstd[..., None]) * _f32(xp, gamma)


def rms_norm(x, gamma, eps: float = 1e-6):
    """RMSNorm of ``x`` along its last dim with scale ``gamma``, rounded to x's dtype; and the rstd."""
    rstd = rms_norm_rstd(x, eps)
    return rms_norm_values(x, gamma, rstd).astype(x.dtype), rstd


def layer_norm_stats(x, eps: float):
    """LayerNorm's statistics of each row of ``x``: (mean, rstd), float32 (...,). mean = (row sum of x) *
    fp32(1/K); rstd = 1 / sqrt((row sum of (x - mean)**2) * fp32(1/K) + eps); both sums in the module
    docstring's order (two passes: no cancellation of E[x**2] - E[x]**2); NaNs canonical."""
    xp = xp_of(x)
    x = _f32(xp, x)
    inv_k = _F32(1.0 / x.shape[-1])
    with _quiet():
        mean = _canonical_nans(row_sum(x) * inv_k)
        mean = xp.where(mean == 0, _F32(0), mean)  # +0: the kernels' partial sums start from +0, NumPy's from x
        var = _rounded(row_sum(x - mean[..., None], square=True) * inv_k)
        rstd = _F32(1) / _rounded(xp.sqrt(var + _F32(eps)))
    return mean, _canonical_nans(rstd)


def layer_norm_values(x, gamma, beta, mean, rstd):
    """((x - mean) * rstd) * gamma + beta in float32 (before rounding); ``mean``, ``rstd`` per row."""
    xp = xp_of(x, gamma, beta, mean, rstd)
    with _quiet():
        return _rounded(((_f32(xp, x) - mean[..., None]) * rstd[..., None]) * _f32(xp, gamma)) + _f32(xp, beta)


#: The norms' backward sums its columns (dgamma's terms, LayerNorm's dbeta's) by blocks of GRAD_ROWS rows
#: of one batch entry, each block from +0 in row order, then the blocks' sums from +0 in order (producers.h's
#: kGradRows).
GRAD_ROWS = 64


def _ordered_sum(v):
    """The sum over the first dim of float32 ``v``, from +0 one entry after another (a sum from +0 is never
    -0, so entries of +0 change nothing)."""
    xp = xp_of(v)
    if xp is np:
        acc = np.zeros(v.shape[1:], _F32)
        for r in v:
            acc = acc + r
        return acc
    return lax.scan(lambda acc, r: (acc + r, None), jnp.zeros(v.shape[1:], _F32), v)[0]


def column_sum(t):
    """The column sums of float32 ``t`` (B, M, K) in the order of :data:`GRAD_ROWS`: (K,)."""
    xp = xp_of(t)
    B, M, K = t.shape
    nb = -(-M // GRAD_ROWS)
    with _quiet():
        blocks = xp.pad(t, [(0, 0), (0, nb * GRAD_ROWS - M), (0, 0)]).reshape(B * nb, GRAD_ROWS, K)
        return _ordered_sum(_ordered_sum(xp.moveaxis(blocks, 1, 0)))


def norm_grad(norm: str, x, gamma, stats, dy):
    """The backward of a norm (``norm`` in :data:`NORMS`) over x (B, M, K) given the output gradient ``dy``
    (B, M, K), gamma (K,) and the forward's statistics (RMSNorm: rstd (B, M); LayerNorm: (mean, rstd) (B, M,
    2)): [dx in x's dtype, dgamma (K,) float32] and LayerNorm's dbeta (K,) float32, NaNs canonical. With
    xhat = (x - mean) * rstd and dxhat = dy * gamma (RMSNorm: mean = 0, c1 = 0), c1 = row_sum(dxhat) *
    fp32(1/K), c2 = row_sum(dxhat * xhat) * fp32(1/K), dx = rstd * ((dxhat - c1) - xhat * c2); dgamma the
    :func:`column_sum` of dy * xhat, dbeta that of dy."""
    xp = xp_of(x, gamma, stats, dy)
    layer = norm == "layernorm"
    with _quiet():
        xf, d, g = _f32(xp, x), _f32(xp, dy), _f32(xp, gamma)
        inv_k = _F32(1.0 / x.shape[-1]) if x.shape[-1] else _F32(0)
        mean, rstd = (stats[..., 0:1], stats[..., 1:2]) if layer else (_F32(0), stats[..., None])
        xhat = (xf - mean) * rstd
        dxhat = _rounded(d * g)
        c1 = _rounded(row_sum(dxhat) * inv_k)[..., None] if layer else _F32(0)
        c2 = (row_sum(_rounded(dxhat * xhat)) * inv_k)[..., None]
        dx = rstd * (_rounded(dxhat - c1) - _rounded(xhat * c2))
        sums = [column_sum(_rounded(d * xhat))] + ([column_sum(d)] if layer else [])
    return [_canonical_nans(dx.astype(x.dtype))] + [_canonical_nans(v) for v in sums]


#: The norms: their inputs after x are (K,) parameters (RMSNorm: gamma; LayerNorm: gamma, beta), and their
#: extra output holds each row's statistics for the backward (RMSNorm: rstd (...,); LayerNorm: (mean, rstd)
#: stacked last, (..., 2)).
NORMS = ("rmsnorm", "layernorm")


def stats_shape(producer: str, lead: tuple) -> Optional[tuple]:
    """The shape of a producer's statistics output for rows ``lead``, or None (no extra output)."""
    return {"rmsnorm": tuple(lead), "layernorm": (*lead, 2)}.get(producer)


def produced_dtype(producer: str, dtypes: tuple, out_dtype) -> jnp.dtype:
    """The dtype a producer's values are rounded to: ``out_dtype``, else its (first) input's."""
    grad = producer in ("swiglu_grad", "gelu_grad")  # the forward input's dtype, not da's
    return jnp.dtype(out_dtype if out_dtype is not None else dtypes[-1] if grad else dtypes[0])


def produce(producer: str, *args, eps: float = 0.0, out_dtype=None):
    """The produced (..., M, K) tensor, rounded to its dtype, and the extra outputs (RMSNorm: rstd)."""
    dtype = produced_dtype(producer, tuple(a.dtype for a in args), out_dtype)
    if producer == "cast":
        (x,) = args
        return x.astype(dtype), []
    if producer == "rmsnorm":
        x, gamma = args
        rstd = rms_norm_rstd(x, eps)
        return rms_norm_values(x, gamma, rstd).astype(dtype), [rstd]
    if producer == "swiglu":
        return swiglu(args[0], dtype), []
    if producer == "swiglu_grad":
        return swiglu_grad(*args, dtype), []
    if producer == "layernorm":
        x, gamma, beta = args
        mean, rstd = layer_norm_stats(x, eps)
        xp = xp_of(mean, rstd)
        return layer_norm_values(x, gamma, beta, mean, rstd).astype(dtype), [xp.stack([mean, rstd], axis=-1)]
    if producer == "gelu":
        return gelu(args[0], dtype), []
    if producer == "gelu_grad":
        return gelu_grad(*args, dtype), []
    raise ValueError(f"producer must be one of {PRODUCERS}, got {producer!r}")


def produce_values(*args, producer: str, eps: float = 0.0, out_dtype=None):
    """The contract of ``jf_produce``: the produced tensor (NaNs canonical), then the producer's extra
    outputs."""
    y, extra = produce(producer, *args, eps=eps, out_dtype=out_dtype)
    return [_canonical_nans(y)] + extra


def produce_quantize(*args, producer: str, scheme, eps: float = 0.0, out_dtype=None):
    """The contract of ``jf_produce_quantize``: every kernel output of the produced (B, M, K) tensor (as
    :func:`~.contracts.quantize_usages`), then the producer's extra outputs."""
    y, extra = produce(producer, *args, eps=eps, out_dtype=out_dtype)
    return quantize_usages(y, scheme=scheme) + extra
