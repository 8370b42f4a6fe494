"""The GEMM's contract: what every backend computes and what it states about itself.

The product: ``out = A · Bᵀ (+ C)`` of FP8 operands with block scales, the "TN" GEMM of Hopper's and
Blackwell's FP8 tensor cores:

- ``a``: (M, K) and ``b``: (N, K), both K-major (the contraction dim is the last one, contiguous),
  dtype ``float8_e4m3fn`` or ``float8_e5m2`` each, not both E5M2;
- Float8 blockwise (``"blockwise"``): ``a_scale`` / ``b_scale`` fp32 ``scale_inv`` (dequantized value =
  data * scale) in the GEMM-ready order of ``Scheme.scale_shape`` (TransformerEngine's GEMM_READY), for
  an operand of ``rows`` rows: 1x128 blocks ``(ceil(K/128), roundup(rows, 4))`` (transposed: rows
  contiguous), 128x128 blocks ``(ceil(rows/128), roundup(ceil(K/128), 4))``; padding entries are read
  by nobody (1.0 by convention, ``GEMM_SCALE_PAD``);
- MXFP8 (``"mxfp8"``): ``a_scale`` (M, ceil(K/32)) and ``b_scale`` (N, ceil(K/32)) uint8 E8M0 biased
  exponents, one per 32 elements along K (value 2**(e - 127); 255 is NaN): the compact rowwise scales
  of :class:`~jax_fp8.MXFP8Tensor`;
- ``c`` (optional): (M, N) of the output dtype; ``out = A·Bᵀ + C``;
- result: (M, N), float32 or bfloat16 from the kernels (:data:`OUT_DTYPES`; other float dtypes are
  computed in fp32 and cast). Its numbers are the reference math's (:mod:`jax_fp8.gemm.reference`)
  up to accumulation order and precision.

A backend (:class:`GemmBackend`) states which formats and shapes it takes and what padding it needs,
whether it runs here and why not, how it runs (a kernel lowered under the ``jf_fp8_gemm`` primitive,
or a jax function) and its options. The helpers below are the ones backends share.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._compat import ShapedArray, ffi
from ..arrays import cdiv
from ..formats import BLOCKWISE, MXFP8, format_of
from ..scheme import Scheme

#: The blocks of GEMM operands, as their formats name them: Float8 blockwise 1x128 and 128x128 ...
BLOCK_1D, BLOCK_2D = BLOCKWISE.blocks
#: ... and MXFP8's 1x32 (one E8M0 scale per 32 along the contraction).
MX_BLOCK_1D, = MXFP8.blocks
#: Output dtypes of the kernels (others: compute in fp32 and cast).
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def gemm_dtype(out_dtype) -> np.dtype:
    """The dtype a kernel computes an ``out_dtype`` result in: itself where a kernel gives it, else fp32."""
    out_dtype = jnp.dtype(out_dtype)
    return out_dtype if out_dtype in OUT_DTYPES else jnp.dtype(jnp.float32)


#: GEMM dims are 32-bit ints in cuBLASLt, TE and CUTLASS.
MAX_DIM = 2**31 - 1
#: Padding is "cheap" while the padded GEMM does at most this many times the multiply-adds of the
#: unpadded one. Padding costs one copy of the FP8 operands (<= 15 zero columns, <= 7 zero rows) and a
#: slice of the output; the fallback (the reference: fp32 dots of the FP8 data at HIGHEST) moves >= 4x
#: the operand bytes and runs the dot on CUDA cores, ~30x slower than FP8 tensor cores on H100/H200
#: (67 vs 1979 dense TFLOP/s). Padding up to 16x the work stays ahead; the fallback is left to
#: degenerate shapes (e.g. M = N = 1, or M = 1 with K = 1).
MAX_PAD_GROWTH = 16


def refused(M: int, N: int, K: int, a_dtype, b_dtype) -> Optional[str]:
    """What no backend's FP8 GEMM takes: a dim over :data:`MAX_DIM`, both operands E5M2; else None."""
    if max(M, N, K) > MAX_DIM:
        return f"a GEMM dim over 2**31 - 1 ({M}x{N}x{K})"
    if jnp.dtype(a_dtype) == jnp.dtype(jnp.float8_e5m2) == jnp.dtype(b_dtype):
        return "E5M2 on both operands (FP8 GEMMs take at most one E5M2 operand)"
    return None


def padded_sizes(library: str, M: int, N: int, K: int, align: tuple) -> tuple[Optional[tuple], Optional[str]]:
    """``((Mp, Np, Kp), None)``: M, N, K rounded up to ``align`` = (M's, N's, K's multiple), which a
    backend's ``sizes`` gives when zero padding to them is cheap (:data:`MAX_PAD_GROWTH`); else
    ``(None, why not)`` naming ``library``."""
    Mp, Np, Kp = (cdiv(v, m) * m for v, m in zip((M, N, K), align))
    growth = (Mp * Np * Kp) / (M * N * K)
    if growth > MAX_PAD_GROWTH:
        return None, (f"padding {M}x{N}x{K} to {library}'s alignment ({Mp}x{Np}x{Kp}) would multiply the GEMM's "
                      f"work by {growth:.0f} (more than {MAX_PAD_GROWTH})")
    return (Mp, Np, Kp), None


def cuda_capabilities(devices: Optional[Sequence] = None) -> tuple[set, Optional[str]]:
    """The compute capabilities (``{"9.0"}`` on an H100/H200) of the GPUs among ``devices`` (those a
    lowering compiles for, also ahead of time on a machine without them), else of this process's CUDA
    devices; and None, or an empty set and why there are none. Never raises (a backend's
    ``unavailable`` asks it)."""
    gpus = [d for d in devices or () if d.platform in ("gpu", "cuda")]
    try:
        gpus = gpus or jax.devices("cuda")
    except Exception as e:  # no CUDA backend
        return set(), f"no CUDA device ({e})"
    caps = {str(getattr(d, "compute_capability", "?")) for d in gpus}
    return caps, None if caps else "no CUDA device"


def lower_with_workspace(target: str, ctx, workspace_bytes: int, *operands, **attrs) -> list:
    """The lowering of a GEMM backend's custom call ``target`` that takes its workspace as one more
    result, ``workspace_bytes`` of uint8, dropped here: a result buffer, unlike XLA's scratch, lives
    while a CUDA graph that captured the call replays, and XLA reuses its memory once the call has run."""
    ctx = ctx.replace(avals_out=[*ctx.avals_out, ShapedArray((workspace_bytes,), np.uint8)])
    return ffi.ffi_lowering(target)(ctx, *operands, **attrs)[:1]


def operand_scheme(block, dtype=jnp.float8_e4m3fn) -> Scheme:
    """The scheme whose rowwise usage is a GEMM operand with ``block`` blocks (GEMM-ready layout)."""
    return Scheme("blockwise", dtype, block=tuple(block), layout="gemm_ready")


def operand_scale_shape(rows: int, k: int, block) -> tuple[int, int]:
    """GEMM-ready scale shape of a (rows, k) operand, contraction over k (``Scheme.scale_shape``)."""
    return operand_scheme(block).scale_shape(rows, k, "rowwise")


@dataclasses.dataclass(frozen=True, eq=False)
class GemmBackend:
    """One library that runs the FP8 GEMM ``out = a · bᵀ (+ c)`` (one module per backend in
    :mod:`jax_fp8.gemm.backends`; the plan, :mod:`jax_fp8.gemm.plan`, picks one per GEMM). What every
    backend states:

    - what it takes: ``formats``, :class:`~jax_fp8.formats.Format` objects or their names
      (``BLOCKWISE``: Float8 blocks (1, 128) / (128, 128), fp32 scales; ``MXFP8``: (1, 32) blocks with
      E8M0 scales) and ``sizes(M, N, K, a_block, b_block, a_dtype,
      b_dtype)``: ``((M, N, K) to run at, None)`` (zero padding up to those sizes changes no product:
      its padding), or ``(None, why it cannot take the problem)``;
    - whether it runs here and why not: ``unavailable(platform, devices=None)``: None where its kernel
      runs on ``devices`` (those a lowering compiles for; None: this process's) of ``platform``, else
      why not, in words (never raises); ``platforms``: where it may run;
    - how it runs, one of two: ``lowerings``, platform -> MLIR lowering rule of its kernel under the
      ``jf_fp8_gemm`` primitive (:mod:`jax_fp8.gemm.primitive`: partitioning, batching, the reference
      lowering where the kernel does not run, with one :class:`Fp8GemmFallbackWarning`), called with
      the primitive's operands and params (``backend`` excepted) and the backend's ``options`` as
      keywords; or ``compute(a, a_scale, b, b_scale, c, *, a_block, b_block, out_dtype)``, a jax
      function traced in place of the primitive (cuDNN's MXFP8 GEMM, ``jax.nn.scaled_matmul``; the
      reference math);
    - its options: ``options``, ``((name, int), ...)``, which of its kernels runs (a cuBLASLt algorithm,
      a CUTLASS configuration); ``()``: its own choice. :meth:`with_options` makes them, one object per
      choice (the primitive's params compare backends by identity); ``check_options(**options)`` raises
      ValueError or TypeError naming an option it does not know or a value out of its range."""

    name: str
    sizes: Callable
    unavailable: Callable
    lowerings: dict = dataclasses.field(default_factory=dict)
    compute: Optional[Callable] = None
    formats: tuple = (BLOCKWISE,)
    platforms: tuple = ("cuda",)
    check_options: Callable = dataclasses.field(default=lambda **options: None, repr=False)
    options: tuple = ()
    base: Optional["GemmBackend"] = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if (self.compute is None) == (not self.lowerings):
            raise ValueError(f"GemmBackend {self.name!r}: give lowerings (a kernel under jf_fp8_gemm) or compute "
                             "(a jax function), one of the two")
        object.__setattr__(self, "formats", tuple(format_of(f, f"GemmBackend {self.name!r}: formats")
                                                 for f in self.formats))

    def takes(self, fmt) -> bool:
        """Whether it multiplies operands of format ``fmt`` (a :class:`~jax_fp8.formats.Format` or its name)."""
        return format_of(fmt, "GemmBackend.takes") in self.formats

    def unavailable_here(self) -> Optional[str]:
        """None where it runs on one of this machine's platforms, else why not (the first platform's)."""
        whys = [self.unavailable(platform) for platform in self.platforms]
        return None if any(w is None for w in whys) else whys[0]

    def with_options(self, **options: int) -> "GemmBackend":
        """This backend running the kernel ``options`` name, checked (the same object for the same
        options; none: the backend with its own choice)."""
        root = self.base or self
        opts = tuple(sorted((k, int(v)) for k, v in options.items()))
        if not opts:
            return root
        key = (id(root), opts)
        if key not in _VARIANTS:
            root.check_options(**dict(opts))
            _VARIANTS[key] = dataclasses.replace(root, options=opts, base=root)
        return _VARIANTS[key]

    def __repr__(self) -> str:  # the backend as the jaxpr prints it
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.options)})"


#: (id of a backend, options) -> its variant; backends live as long as the process (module constants)
_VARIANTS: dict = {}
