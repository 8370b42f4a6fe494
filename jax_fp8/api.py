"""Public quantization API: each function names a Scheme and runs it on the FFI kernels (primitives)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import jax.numpy as jnp

from . import quantization as _q
from .formats import check_input, fp8_dtype
from .contracts import e8m0_from_amax as _e8m0_from_amax
from .scheme import Scheme, build_scheme
from .tensors import BlockwiseTensor, MXFP8Tensor

QuantizedTensor = Union[MXFP8Tensor, BlockwiseTensor]


def quantize(x, scheme: Scheme) -> QuantizedTensor:
    """Quantize ``x`` with a :class:`jax_fp8.Scheme` (the format, FP8 dtype, usages and options)."""
    if not isinstance(scheme, Scheme):
        raise TypeError(f"quantize: scheme must be a jax_fp8.Scheme, got {scheme!r}")
    return _q.quantize(x, scheme, _q.PRIMITIVES)


def quantize_mxfp8(x, dtype=jnp.float8_e4m3fn, rowwise: bool = True, colwise: bool = False,
                   layout: str = "compact") -> MXFP8Tensor:
    """Quantize ``x`` to MXFP8: FP8 data with an E8M0 scale per 32-element block.

    Args:
      x: float32, bfloat16 or float16 array of rank >= 1, viewed as 2-D ``(prod(shape[:-1]), shape[-1])``.
        Trailing partial blocks are allowed; an empty ``x`` gives empty data and scales.
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      rowwise: produce 1x32 blocks along the last dim.
      colwise: produce 32x1 blocks along the first dim of the 2-D view (same pass as rowwise).
      layout: ``"compact"``, or ``"gemm_ready"`` to store the columnwise data transposed, (K, M), in the
        same pass (the K-major operand of a GEMM over M); the scales stay compact.

    Scales follow TE: ``e = float_to_e8m0(amax / fp8_max)`` (rounded up to a power of two), elements
    are multiplied by ``2**(127 - e)`` and cast with saturation; NaN elements stay NaN (byte 0x7F).
    Not differentiable; see :func:`quantize_dequantize` for a straight-through estimator.
    """
    return quantize(x, build_scheme("quantize_mxfp8", "mxfp8", dtype, rowwise=rowwise, colwise=colwise, layout=layout))


def quantize_blockwise(x, block: Sequence[int] = (1, 128), dtype=jnp.float8_e4m3fn, pow2_scales: bool = True,
                       amax_epsilon: float = 0.0, rowwise: bool = True, colwise: bool = False,
                       layout: str = "compact") -> BlockwiseTensor:
    """Quantize ``x`` to Float8 blockwise (TE's Float8BlockQuantizer, DeepSeek-V3 style).

    Args:
      x: float32, bfloat16 or float16 array of rank >= 1 (2-D view as in :func:`quantize_mxfp8`).
      block: ``(1, 128)`` (rowwise 1x128 and, with ``colwise``, 128x1 blocks) or ``(128, 128)`` tiles.
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      pow2_scales: round each scale down to a power of two (TE's default for this recipe).
      amax_epsilon: lower bound applied to each block amax.
      rowwise / colwise: which usages to produce (for 128x128 tiles both are the same tiles).
      layout: ``"compact"`` or ``"gemm_ready"`` (TE's GEMM_READY, what cuBLASLt's block-scaled GEMMs
        read): columnwise data transposed to (K, M) and the scales transposed / padded to multiples of
        4 (padding 1.0), written by the quantize kernels in the same pass. See ``Scheme.scale_shape``.

    Scale as TE's ``compute_scale_from_amax``: 1 for a zero, inf or NaN amax, else ``fp8_max / amax``
    (an infinite quotient becomes the input dtype's largest finite value); stored ``scale_inv = 1/scale``.
    """
    return quantize(x, build_scheme("quantize_blockwise", "blockwise", dtype, rowwise=rowwise, colwise=colwise,
                               block=block, pow2_scales=pow2_scales, amax_epsilon=amax_epsilon, layout=layout))


def to_layout(q: QuantizedTensor, layout: str) -> QuantizedTensor:
    """``q`` rearranged into ``layout`` ('compact' or 'gemm_ready'): the same bits, exact both ways."""
    return _q.to_layout(q, layout)


def dequantize(q: QuantizedTensor, dtype=None, usage: Optional[str] = None):
    """Dequantize any quantized tensor: ``data * scale`` per block, rounded to ``dtype``.

    ``dtype`` defaults to the dtype that was quantized; ``usage`` ('rowwise' or 'colwise') defaults to
    rowwise when present. NaN outputs are the dtype's canonical quiet NaN.
    """
    return _q.dequantize(q, dtype, usage, _q.PRIMITIVES)


def e8m0_from_amax(amax, dtype=jnp.float8_e4m3fn):
    """E8M0 scale (uint8, biased 127) for block amaxes, TE's rule; same shape as ``amax``. Deprecated at
    the top level (``jax_fp8.e8m0_from_amax``): use :func:`jax_fp8.reference.e8m0_from_amax`."""
    fp8_dtype(dtype)
    return _e8m0_from_amax(jnp.asarray(amax, jnp.float32), dtype)


def quantize_dequantize(x, fmt: Union[Scheme, str] = "mxfp8", usage: str = "rowwise", **options):
    """``dequantize(quantize(x))`` with a straight-through derivative, for training.

    The derivative is the identity: ``jax.grad`` passes the cotangent through unchanged and ``jax.jvp``
    passes the tangent through unchanged (forward and reverse mode agree).

    ``fmt`` names the scheme as every quantizing function does, by a :class:`jax_fp8.Scheme` (which
    must hold ``usage``; no ``options`` then), or, as a convenience that builds one, by a format name
    with its options: 'mxfp8' (options: ``dtype``) or 'blockwise' (options: ``block``, ``dtype``,
    ``pow2_scales``, ``amax_epsilon``). ``usage`` picks rowwise or columnwise blocks. The forward value
    equals ``dequantize(quantize(x, scheme), x.dtype, usage)`` bit for bit, so
    ``quantize_dequantize(x, jf.Scheme("blockwise", block=(128, 128)))`` and
    ``quantize_dequantize(x, "blockwise", block=(128, 128))`` are the same.
    """
    where = "quantize_dequantize"
    x = check_input(x)
    if usage not in ("rowwise", "colwise"):
        raise ValueError(f"{where}: usage must be 'rowwise' or 'colwise', got {usage!r}")
    if isinstance(fmt, Scheme):
        if options:
            raise TypeError(f"{where}: a Scheme says every option; got it and {sorted(options)} as well")
        if not getattr(fmt, usage):
            raise ValueError(f"{where}: usage {usage!r} is not one the scheme produces ({fmt})")
        scheme = fmt.only(usage)
    else:
        scheme = build_scheme(where, fmt, rowwise=usage == "rowwise", colwise=usage == "colwise", **options)
    return _q.quantize_dequantize(x, scheme, usage)
