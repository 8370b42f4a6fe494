"""The producers that quantization fuses with, as exact fp32 math: RMSNorm, SwiGLU and SwiGLU's
derivative, and the cast of fp32 master weights to the model dtype.

Each producer's value is defined here once, in ``jax.numpy`` / NumPy (same code, :func:`~.arrays.xp_of`),
with every fp32 operation in a fixed order and no fused multiply-add, so that the CPU and CUDA kernels
(``csrc/producers.h``) compute the same bits. A fused kernel's outputs are the composition of the
unfused ops: the produced value rounded to its output dtype (as the unfused program would store it),
then quantized by :func:`~.contracts.quantize_usages` (:func:`produce_quantize`, the contract of the
``jf_produce_quantize`` primitive; :func:`produce_values` is that of ``jf_produce``, the unfused op).

- The row sum of squares of RMSNorm: 256 partial sums, partial ``v`` adding the squares of elements
  ``v, v + 256, v + 512, ...`` in order, then a pairwise tree (``v + v ^ 128``, then 64, ... 1): what
  a warp does with 8 consecutive elements per lane and XOR shuffles.
- ``exp``: Cody-Waite range reduction (``n = rint(x log2 e)``), a degree-6 polynomial (fitted to e**r
  on [-ln2/2, ln2/2] for the least maximal relative error, coefficients rounded to float32) by Horner's
  rule, then ``2**n`` as two exact power-of-two products; within 1.2 ulp of the true exponential, and
  the same bits everywhere (libm's and CUDA's ``expf`` differ in their last bits).

As everywhere in :mod:`jax_fp8.contracts`: XLA's CPU runtime flushes subnormals, so evaluate these on
NumPy inputs where subnormal intermediates must be exact.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from .arrays import bitcast, xp_of
from .contracts import quantize_usages
from .formats import quiet as _quiet

_F32 = np.float32

#: The producers, in the kernels' numbering (producers.h's Producer).
PRODUCERS = ("cast", "rmsnorm", "swiglu", "swiglu_grad")
#: How many inputs each producer takes.
N_INPUTS = {"cast": 1, "rmsnorm": 2, "swiglu": 1, "swiglu_grad": 2}

SUM_LANES = 256  # the row sum of squares' partial sums (producers.h's kSumLanes)

_LOG2E = _F32(1.44269502)         # 0x3FB8AA3B
_LN2_HI = _F32(0.693145751953125)  # 0x3F317200: 15 significant bits, so n * _LN2_HI is exact
_LN2_LO = _F32(1.42860677e-06)    # 0x35BFBE8E: ln 2 - _LN2_HI
_EXP_OVER = _F32(88.7228394)      # above: inf
_EXP_UNDER = _F32(-103.972084)    # below: 0
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


def _pow2(xp, k):
    """2**k (float32) for int32 ``k`` in [-126, 127], exactly: the exponent field alone."""
    return bitcast((k + 127).astype(np.int32) << 23, _F32)


def exp_f32(x):
    """e**x for float32 ``x`` (see the module docstring); NaN stays NaN."""
    xp = xp_of(x)
    x = _f32(xp, x)
    with _quiet():
        n = xp.clip(xp.rint(x * _LOG2E), _F32(-151), _F32(128))
        r = (x - _rounded(n * _LN2_HI)) - _rounded(n * _LN2_LO)
        p = xp.full_like(r, _EXP_POLY[0])
        for c in _EXP_POLY[1:]:
            p = _rounded(p * r) + c
        k = n.astype(np.int32)
        half = k // 2  # floor: both halves in [-76, 64]
        y = (p * _pow2(xp, half)) * _pow2(xp, k - half)
    y = xp.where(x > _EXP_OVER, _F32(np.inf), y)
    y = xp.where(x < _EXP_UNDER, _F32(0), y)
    return xp.where(xp.isnan(x), x, y)


def sigmoid_f32(g):
    """1 / (1 + e**-g), float32."""
    with _quiet():
        return _F32(1) / (_F32(1) + exp_f32(-g))


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


def row_sum_squares(x):
    """Sum over the last dim of x**2 in float32, in the order of the module docstring: (...,)."""
    xp = xp_of(x)
    x = _f32(xp, x)
    K = x.shape[-1]
    chunks = -(-K // SUM_LANES)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, chunks * SUM_LANES - K)]
    with _quiet():
        sq = xp.pad(x, pad).reshape(*x.shape[:-1], chunks, SUM_LANES)
        sq = _rounded(sq * sq)
        acc = sq[..., 0, :]
        for j in range(1, chunks):
            acc = acc + sq[..., j, :]
        while acc.shape[-1] > 1:
            half = acc.shape[-1] // 2
            acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def rms_norm_rstd(x, eps: float):
    """1 / sqrt(mean(x**2) + eps) per row (...,), float32: the mean is the sum of squares times the
    float32 nearest 1 / K (K the row length; XLA turns a division by a constant into that product); a
    NaN is the canonical one."""
    xp = xp_of(x)
    with _quiet():
        ms = _rounded(row_sum_squares(x) * _F32(1.0 / x.shape[-1]))
        rstd = _F32(1) / _rounded(xp.sqrt(ms + _F32(eps)))  # kept apart: XLA rewrites 1 / sqrt as rsqrt
    return xp.where(xp.isnan(rstd), _F32(np.nan), rstd)  # one NaN (0x7FC00000), whatever the row's NaNs were


def rms_norm_values(x, gamma, rstd):
    """(x * rstd) * gamma in float32 (before rounding); ``rstd`` per row (...,)."""
    xp = xp_of(x, gamma, rstd)
    with _quiet():
        return (_f32(xp, x) * rstd[..., None]) * _f32(xp, gamma)


def rms_norm(x, gamma, eps: float = 1e-6):
    """RMSNorm of ``x`` along its last dim with scale ``gamma``, rounded to x's dtype; and the rstd."""
    rstd = rms_norm_rstd(x, eps)
    return rms_norm_values(x, gamma, rstd).astype(x.dtype), rstd


def produced_dtype(producer: str, dtypes: tuple, out_dtype) -> jnp.dtype:
    """The dtype a producer's values are rounded to: ``out_dtype``, else its (first) input's."""
    return jnp.dtype(out_dtype if out_dtype is not None else dtypes[-1] if producer == "swiglu_grad" else dtypes[0])


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
    raise ValueError(f"producer must be one of {PRODUCERS}, got {producer!r}")


def _canonical_nans(y):
    """``y`` with every NaN the one quiet NaN of its dtype (what the kernels store)."""
    xp = xp_of(y)
    return xp.where(xp.isnan(y), xp.asarray(np.nan, y.dtype), y)


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
