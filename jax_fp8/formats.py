"""The quantization formats and their element dtypes.

A :class:`Format` owns everything that differs between MXFP8 and Float8 blockwise: its blocks (the
block length, the blocks a scheme may ask for, the kernel block of each usage), its scales (dtype and
the rule from a block amax, the value the master-weight cast reduces), its GEMM-ready rule (whether the
scales are rearranged for the GEMM), the tensor class it builds and its value in the kernels' ``Format``
enum (ffi_common.h). A new format is one more :class:`Format` subclass and instance here (registered in
``FORMATS``) plus its kernels: the scheme, the tensors, the contracts, the primitives and the
collectives read the format through this interface. The per-block scale math (bits of the contract,
mirrored by ``csrc/fp8_math.h``) lives with its format; :mod:`jax_fp8.contracts` uses it.

Below them: the FP8 element dtypes, the input dtypes, and the validation of dtype-like arguments.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np
import jax.numpy as jnp

from .arrays import bitcast, cdiv, xp_of

#: FP8 element dtypes, in the kernels' numbering (0 = E4M3, 1 = E5M2; ffi_common.h's Fp8Kind).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: Largest finite value of each FP8 format.
FP8_MAX = {FP8_DTYPES[0]: 448.0, FP8_DTYPES[1]: 57344.0}
#: High-precision dtypes accepted as input and produced by dequantize.
HIGH_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

MX_BLOCK = 32
FLOAT8_BLOCK = 128


def fp8_dtype(dtype, name: str = "dtype") -> jnp.dtype:
    """Validate an FP8 element dtype argument."""
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype!r}") from e
    if d not in FP8_DTYPES:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {d}")
    return d


def high_dtype(dtype, name: str) -> jnp.dtype:
    """Validate a high-precision dtype (float32, bfloat16, float16)."""
    d = jnp.dtype(dtype)
    if d not in HIGH_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {d}")
    return d


def check_input(x, name: str = "x"):
    """Validate a tensor to quantize; return it as a jax array."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    high_dtype(x.dtype, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have rank >= 1 (it is viewed as 2-D: (prod(shape[:-1]), shape[-1])), got a scalar")
    return x


def check_amax_epsilon(amax_epsilon, where: str) -> float:
    """Validate a Float8 blockwise amax epsilon (a finite float >= 0)."""
    try:
        eps = float(amax_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: amax_epsilon must be a finite float >= 0, got {amax_epsilon!r}") from None
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"{where}: amax_epsilon must be finite and >= 0, got {amax_epsilon}")
    return eps


def max_finite(dtype) -> np.float32:
    """Largest finite value of a high-precision dtype, as fp32 (TE's value for an infinite scale)."""
    return np.float32(jnp.finfo(dtype).max)


# ---- per-block scale math (mirrors csrc/fp8_math.h) -------------------------------------------------
_F32 = jnp.float32


def _bits(v):
    return bitcast(v.astype(_F32), jnp.uint32)


def _from_bits(u):
    return bitcast(u.astype(jnp.uint32), _F32)


def quiet():
    """NumPy path: inf and NaN are expected values here, not errors."""
    return np.errstate(divide="ignore", over="ignore", invalid="ignore")


def e8m0_from_amax(amax, dtype=jnp.float8_e4m3fn):
    """E8M0 scale (uint8, biased 127) of a block amax, TE's float_to_e8m0(amax * (1/fp8_max))."""
    xp = xp_of(amax)
    rcp = np.float32(1.0) / np.float32(FP8_MAX[jnp.dtype(dtype)])
    with quiet():
        v = xp.asarray(amax).astype(_F32) * rcp
    bits = _bits(v)
    exp = (bits >> 23) & np.uint32(0xFF)
    mant = bits & np.uint32(0x7FFFFF)
    bump = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    e = exp + bump.astype(np.uint32)
    e = xp.where(v == 0, np.uint32(0), e)
    e = xp.where(xp.isinf(v), np.uint32(0xFE), e)
    e = xp.where(xp.isnan(v), np.uint32(0xFF), e)
    return e.astype(np.uint8)


def e8m0_reciprocal(e):
    """Multiplier 2**(127 - e) applied before the cast (1.0 for e == 0), as fp32."""
    e = e.astype(np.int32)
    return xp_of(e).where(e == 0, np.float32(1.0), _from_bits(((254 - e) << 23).astype(np.uint32)))


def e8m0_to_float(e):
    """Dequantization scale 2**(e - 127): 2**-127 for e == 0, NaN for 0xFF."""
    xp = xp_of(e)
    e32 = e.astype(np.uint32)
    v = xp.where(e32 == 0, np.float32(2.0**-127), _from_bits(e32 << 23))
    return xp.where(e32 == 0xFF, np.float32(np.nan), v)


def block_scale_from_amax(amax, dtype, pow2: bool, eps: float, inf_value):
    """Float8 blockwise scale, TE's compute_scale_from_amax (returns the multiplier ``scale``)."""
    xp = xp_of(amax)
    amax = amax.astype(_F32)
    amax = xp.where(amax < np.float32(eps), np.float32(eps), amax)
    with quiet():
        scale = np.float32(FP8_MAX[jnp.dtype(dtype)]) / amax
    scale = xp.where(xp.isinf(scale), np.float32(inf_value), scale)
    if pow2:
        scale = _from_bits(_bits(scale) & np.uint32(0xFF800000))
    trivial = xp.isinf(amax) | (amax == 0) | xp.isnan(amax)
    return xp.where(trivial, np.float32(1.0), scale)


# ---- the formats ---------------------------------------------------------------------------------
#: A scale rule: block amaxes -> (the stored scales, the multiplier applied before the cast).
ScaleRule = Callable[[Any], tuple]


class Format:
    """What a quantization format decides. One instance per format (``FORMATS``), compared by identity.

    Class attributes (overridden per format): ``name`` (the ``Scheme(fmt=...)`` string), ``kernel_id``
    (the kernels' ``Format`` enum, ffi_common.h), ``block`` (the block length), ``blocks`` (the block
    shapes a scheme may name; the first is the default), ``tile_block`` (a 2-D block serving both usages,
    or None), ``scale_dtype`` (stored scales), ``partial_dtype`` / ``reduce_dtype`` (the values the
    master-weight cast computes per shard, and the integer type its ``pmax`` reduces them as),
    ``partials_are_scales`` (the reduced values are the stored scales; else the cast writes
    ``scale_inv``), ``gemm_ready_scales`` (``layout="gemm_ready"`` rearranges the scales as well as the
    columnwise data: see :meth:`gemm_scale_shape`), ``gemm_scale_align`` (each stored row of GEMM-ready
    scales is padded to a multiple of it), ``empty_scale`` (the scale value of an empty tensor's grids,
    and of the padding of GEMM-ready scales).
    """

    name: str = ""
    kernel_id: int = -1
    block: int = 0
    blocks: tuple = ()
    tile_block: Optional[tuple] = None
    scale_dtype: np.dtype = np.dtype(np.float32)
    partial_dtype: np.dtype = np.dtype(np.float32)
    reduce_dtype: np.dtype = np.dtype(np.uint32)
    partials_are_scales: bool = False
    gemm_ready_scales: bool = False
    gemm_scale_align: int = 1
    empty_scale: float = 0.0
    _tensor_class: Optional[type] = None

    def __repr__(self) -> str:
        return f"jax_fp8.formats.{type(self).__name__}()"

    def __reduce__(self):  # pickles as the registered instance (identity comparisons survive)
        return (format_of, (self.name,))

    # ---- blocks ---------------------------------------------------------------------------------
    def check_block(self, block, where: str) -> tuple[int, int]:
        """Validate a scheme's ``block`` (None: the default); returns it as a tuple of ints."""
        if block is None:
            return self.blocks[0]
        allowed = " or ".join(f"({bm}, {bk})" for bm, bk in self.blocks)
        try:
            block = tuple(int(b) for b in block)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: block must be {allowed}, got {block!r}") from None
        if block not in self.blocks:
            raise ValueError(f"{where}: block must be {allowed}, got {block}")
        return block

    def usage_block(self, block: tuple, usage: str) -> tuple[int, int]:
        """The kernel block of a usage for a scheme's ``block``: (1, b) rowwise, (b, 1) columnwise, the
        2-D tile for both."""
        if block == self.tile_block:
            return block
        return (1, self.block) if usage == "rowwise" else (self.block, 1)

    # ---- scale grids ----------------------------------------------------------------------------
    def grid(self, block: tuple, M: int, K: int, usage: str) -> tuple[int, int]:
        """Shape of a usage's compact scale grid for the (M, K) view: one scale per block."""
        bm, bk = self.usage_block(block, usage)
        return cdiv(M, bm), cdiv(K, bk)

    def gemm_transposed_scales(self, block: tuple, usage: str) -> bool:
        """Whether GEMM-ready scales of a usage are stored as the transpose of the compact grid."""
        return False

    def gemm_scale_shape(self, block: tuple, M: int, K: int, usage: str) -> tuple[int, int]:
        """Shape of a usage's stored scales in the GEMM-ready layout: the compact grid, transposed where
        :meth:`gemm_transposed_scales` says, each stored row padded to ``gemm_scale_align``."""
        rows, cols = self.grid(block, M, K, usage)
        if not self.gemm_ready_scales:
            return rows, cols
        if self.gemm_transposed_scales(block, usage):
            rows, cols = cols, rows
        return rows, cdiv(cols, self.gemm_scale_align) * self.gemm_scale_align

    # ---- scheme options ---------------------------------------------------------------------------
    def check_options(self, pow2_scales: bool, amax_epsilon: float, saturate_inf: bool, where: str) -> None:
        """Raise unless the format takes these scale options (every format takes the defaults)."""

    def describe(self, scheme) -> str:
        """The scheme's one-line description (``str(scheme)``): the format, its block and options where
        it has a choice of them (:meth:`describe_block`, :meth:`describe_options`), dtype, usages, layout."""
        usages = "+".join(u for u in ("rowwise", "colwise") if getattr(scheme, u))
        layout = "" if scheme.layout == "compact" else f" {scheme.layout}"
        return (f"{self.name}{self.describe_block(scheme)} {scheme.dtype.name} {usages}{layout}"
                f"{self.describe_options(scheme)}")

    def describe_block(self, scheme) -> str:
        return ""

    def describe_options(self, scheme) -> str:
        return ""

    # ---- scales ---------------------------------------------------------------------------------
    def scale_rule(self, scheme, in_dtype) -> ScaleRule:
        """amax -> (stored scale, multiplier applied before the cast), for ``scheme`` and inputs of
        ``in_dtype``."""
        raise NotImplementedError

    def dequantize_scale(self, stored):
        """The fp32 factor that dequantizes a block from its stored scale."""
        raise NotImplementedError

    def partial_value(self, amax, scheme):
        """What the master-weight cast's partial amax stores for a block amax: ``partial_dtype`` values
        whose max over the ranks is the value of the max amax."""
        raise NotImplementedError

    def cast_from_global(self, glob, scheme, in_dtype) -> tuple:
        """(scale_inv or None, multiplier) of the reduced ``partial_value`` grid ``glob``: None where the
        reduced values are the stored scales (``partials_are_scales``)."""
        raise NotImplementedError

    # ---- tensors ---------------------------------------------------------------------------------
    @property
    def tensor_class(self) -> type:
        """The quantized tensor class of this format (registered by :mod:`jax_fp8.tensors`)."""
        if self._tensor_class is None:
            raise RuntimeError(f"no tensor class is registered for the {self.name!r} format")
        return self._tensor_class

    def builds(self, cls: type) -> type:
        """Class decorator: ``cls`` is this format's tensor class."""
        self._tensor_class = cls
        cls.FORMAT = self
        return cls


class MXFP8Format(Format):
    """OCP microscaling (TE's MXFP8 1D scaling): 1x32 / 32x1 blocks, E8M0 scales (uint8 biased
    exponents). Powers of two by nature: no scale options, and an infinity makes its block NaN. Its
    scales stay compact in the GEMM-ready layout (cuDNN's block-scaled GEMM swizzles them itself)."""

    name = "mxfp8"
    kernel_id = 0
    block = MX_BLOCK
    blocks = ((1, MX_BLOCK),)
    scale_dtype = partial_dtype = reduce_dtype = np.dtype(np.uint8)
    partials_are_scales = True

    def check_options(self, pow2_scales, amax_epsilon, saturate_inf, where):
        if not pow2_scales or amax_epsilon != 0.0 or not saturate_inf:
            raise ValueError(f"{where}: pow2_scales, amax_epsilon and saturate_inf apply to fmt='blockwise' (MXFP8 "
                             "scales are E8M0 powers of two, and an infinity makes its block NaN)")

    def check_block(self, block, where):
        if block is not None and tuple(block) != (1, MX_BLOCK):
            raise ValueError(f"{where}: MXFP8 blocks are 1x32 / 32x1; block applies to fmt='blockwise', got "
                             f"{block!r}")
        return (1, MX_BLOCK)

    def scale_rule(self, scheme, in_dtype):
        def rule(amax):
            stored = e8m0_from_amax(amax, scheme.dtype)
            return stored, e8m0_reciprocal(stored)
        return rule

    def dequantize_scale(self, stored):
        return e8m0_to_float(stored)

    def partial_value(self, amax, scheme):
        # E8M0 is monotonic in the amax: the max of the bytes is the byte of the max amax
        return e8m0_from_amax(amax, scheme.dtype)

    def cast_from_global(self, glob, scheme, in_dtype):
        return None, e8m0_reciprocal(glob)


class BlockwiseFormat(Format):
    """Float8 blockwise (TE's Float8BlockQuantizer, DeepSeek-V3): 1x128 / 128x1 blocks or 128x128 tiles,
    fp32 ``scale_inv`` from TE's ``compute_scale_from_amax`` (options ``pow2_scales``, ``amax_epsilon``,
    ``saturate_inf``). The master-weight cast reduces the fp32 amaxes (as their uint32 bits: they are
    non-negative). GEMM-ready scales are transposed / padded as cuBLASLt reads them."""

    name = "blockwise"
    kernel_id = 1
    block = FLOAT8_BLOCK
    blocks = ((1, FLOAT8_BLOCK), (FLOAT8_BLOCK, FLOAT8_BLOCK))
    tile_block = (FLOAT8_BLOCK, FLOAT8_BLOCK)
    scale_dtype = partial_dtype = np.dtype(np.float32)
    reduce_dtype = np.dtype(np.uint32)
    gemm_ready_scales = True
    gemm_scale_align = 4  # TE's GEMM_READY: cuBLASLt reads scale rows in multiples of 4
    empty_scale = 1.0  # the scale_inv of an all-zero block (also what pads GEMM-ready scales)

    def describe_block(self, scheme):
        bm, bk = scheme.block
        return f" {bm}x{bk}"

    def describe_options(self, scheme):
        inf = "" if scheme.saturate_inf else ", saturate_inf=False"
        return f" (pow2_scales={scheme.pow2_scales}, amax_epsilon={scheme.amax_epsilon}{inf})"

    def scale_rule(self, scheme, in_dtype):
        def rule(amax):
            mult = block_scale_from_amax(amax, scheme.dtype, scheme.pow2_scales, scheme.amax_epsilon,
                                         max_finite(in_dtype))
            stored = np.float32(1.0) / mult
            if not scheme.saturate_inf:  # a block that holds an infinity dequantizes to non-finite values
                stored = xp_of(amax).where(xp_of(amax).isinf(amax), np.float32(np.inf), stored)
            return stored, mult
        return rule

    def dequantize_scale(self, stored):
        return stored.astype(_F32)

    def partial_value(self, amax, scheme):
        return amax

    def cast_from_global(self, glob, scheme, in_dtype):
        return self.scale_rule(scheme, in_dtype)(glob)

    def gemm_transposed_scales(self, block, usage):
        # 1x128 rowwise scales M-major (the grid transposed); 128x128 columnwise tiles, whose grid is the
        # transposed tensor's
        return (usage == "rowwise") != (block == self.tile_block)


MXFP8 = MXFP8Format()
BLOCKWISE = BlockwiseFormat()
#: Every format by its name, in the kernels' enum order.
FORMATS = {f.name: f for f in (MXFP8, BLOCKWISE)}


def format_of_block(block) -> Format:
    """The format whose blocks include ``block`` (an operand's block shape, e.g. a GEMM's (1, 32))."""
    block = tuple(block)
    for f in FORMATS.values():
        if block in f.blocks:
            return f
    raise ValueError(f"no format has {block} blocks")


def format_of(fmt, where: str = "Scheme") -> Format:
    """The :class:`Format` named by ``fmt`` (its name, or the format itself)."""
    if isinstance(fmt, Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        names = " or ".join(repr(n) for n in FORMATS)
        raise ValueError(f"{where}: fmt must be {names}, got {fmt!r}") from None
