"""A quantization scheme: the one value that says how a tensor is quantized, from the API to the kernels.

``Scheme`` (TE calls it a quantizer) holds the format, the FP8
element dtype, the usages asked for and the Float8 blockwise scale options. It is validated once, when
it is built, and travels as one static parameter through the tensors, the primitives, the kernels'
contracts and the collectives; the FFI handlers decode it once, as one struct (``ffi_attrs``).

The kernels produce the scheme's *kernel blocks*, in the order row, col, tile: MXFP8 1x32 and 32x1,
Float8 1x128 and 128x1, or one set of 128x128 tiles that serves both usages.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from .arrays import cdiv, view_2d
from .formats import BLOCKWISE, FORMATS, FP8_DTYPES, MXFP8, Format, check_amax_epsilon, format_of, fp8_dtype

USAGES = ("rowwise", "colwise")
LAYOUTS = ("compact", "gemm_ready")
#: Value of the padding entries of GEMM-ready fp32 scales: the scale_inv of an all-zero block.
GEMM_SCALE_PAD = BLOCKWISE.empty_scale
#: Each stored row of GEMM-ready fp32 scales is padded to a multiple of this many entries (TE's GEMM_READY).
GEMM_SCALE_ALIGN = BLOCKWISE.gemm_scale_align


def check_block(block, where: str) -> tuple[int, int]:
    """Validate a Float8 blockwise block shape: (1, 128) or (128, 128)."""
    return BLOCKWISE.check_block(block, where)


def _check_bool(value, name: str, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be a bool, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How to quantize: ``fmt`` 'mxfp8' or 'blockwise' (or the :class:`~jax_fp8.formats.Format` itself;
    stored as its name, the format object is ``scheme.format``), the FP8 ``dtype``, which usages (``rowwise``:
    blocks along the last dim; ``colwise``: blocks along the first dim of the 2-D view), and for
    'blockwise' the ``block`` ((1, 128) or (128, 128)), ``pow2_scales`` and ``amax_epsilon``.

    ``saturate_inf`` (blockwise): True is TransformerEngine's rule (a block whose amax is infinite
    gets scale 1, and its infinity saturates to the FP8 maximum); False gives such a block an infinite
    ``scale_inv`` (its data is cast as with True), so it dequantizes, and multiplies in a GEMM, to
    non-finite values: what :class:`jax_fp8.Float8BlockScaling` uses, so that an overflow reaches the
    GEMM's outputs as it reaches ``lax.dot_general``'s.

    MXFP8 has 1x32 / 32x1 blocks with E8M0 scales (powers of two by nature: ``pow2_scales`` must stay
    True and ``amax_epsilon`` 0; an infinity already makes its block NaN, so ``saturate_inf`` stays
    True). Hashable and immutable: a valid static argument for jit.

    ``layout``: ``"compact"`` (data of the input's shape, scale grids ``grid(M, K, usage)``) or
    ``"gemm_ready"``, the operand layout of Hopper's FP8 GEMMs, which take both operands K-major ("TN"):
    columnwise data is stored transposed, as the (K, M) transpose of the 2-D view, and Float8 blockwise
    scales are laid out as TransformerEngine's Float8BlockScaleTensorFormat.GEMM_READY and cuBLASLt's
    ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`` / ``BLK128x128_32F`` read them (TE's
    ``Float8BlockQuantizer::get_scale_shape``). See :meth:`scale_shape`. MXFP8 scales stay compact.
    """

    fmt: str = "mxfp8"
    dtype: Any = jnp.float8_e4m3fn
    rowwise: bool = True
    colwise: bool = False
    block: Optional[tuple] = None  # None: the format's own ((1, 32) MXFP8, (1, 128) blockwise)
    pow2_scales: bool = True
    amax_epsilon: float = 0.0
    layout: str = "compact"
    saturate_inf: bool = True

    def __post_init__(self):
        where = type(self).__name__
        fmt = format_of(self.fmt, where)
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731  (frozen dataclass)
        set_("fmt", fmt.name)
        for name in ("rowwise", "colwise", "pow2_scales", "saturate_inf"):
            set_(name, _check_bool(getattr(self, name), name, where))
        if not (self.rowwise or self.colwise):
            raise ValueError(f"{where}: at least one of rowwise, colwise must be True")
        set_("dtype", fp8_dtype(self.dtype, f"{where}: dtype"))
        set_("amax_epsilon", check_amax_epsilon(self.amax_epsilon, where))
        if self.layout not in LAYOUTS:
            raise ValueError(f"{where}: layout must be 'compact' or 'gemm_ready', got {self.layout!r}")
        set_("block", fmt.check_block(self.block, where))
        fmt.check_options(self.pow2_scales, self.amax_epsilon, self.saturate_inf, where)

    def __str__(self) -> str:
        return self.format.describe(self)

    # ---- what the scheme implies ------------------------------------------------------------------
    @property
    def format(self) -> Format:
        """The :class:`~jax_fp8.formats.Format` object: blocks, scale dtype and rule, GEMM-ready rule."""
        return FORMATS[self.fmt]

    @property
    def e8m0(self) -> bool:
        """Scales are E8M0 bytes (MXFP8); else fp32 ``scale_inv`` values (Float8 blockwise). Kept for the
        GEMM modules; new code reads ``format``."""
        return self.format is MXFP8

    @property
    def scale_dtype(self) -> np.dtype:
        return self.format.scale_dtype

    @property
    def tiles(self) -> bool:
        """2-D tiles (Float8 128x128: each tile one block for both orientations; see shared_tiles)."""
        return self.block == self.format.tile_block

    def usage_block(self, usage: str) -> tuple[int, int]:
        """The (bm, bk) block of a usage: (1, b) rowwise, (b, 1) columnwise, (128, 128) for tiles."""
        return self.format.usage_block(self.block, usage)

    @property
    def gemm_ready(self) -> bool:
        return self.layout == "gemm_ready"

    @property
    def shared_tiles(self) -> bool:
        """Compact 128x128 tiles: one (data, scale) pair serves both usages."""
        return self.tiles and not self.gemm_ready

    @property
    def kernel_usages(self) -> tuple[str, ...]:
        """The usage of each (data, scale) pair the kernels produce, in order ('tile' for shared tiles)."""
        if self.shared_tiles:
            return ("tile",)
        return tuple(u for u in USAGES if getattr(self, u))

    @property
    def output_usages(self) -> tuple[str, ...]:
        """The usage whose layout each kernel output has, in ``kernel_usages`` order (compact shared
        tiles are laid out as the rowwise usage)."""
        return tuple("rowwise" if u == "tile" else u for u in self.kernel_usages)

    @property
    def kernel_blocks(self) -> tuple[tuple[int, int], ...]:
        """The block of each (data, scale) pair the kernels produce (``kernel_usages`` order)."""
        return tuple(self.block if u == "tile" else self.usage_block(u) for u in self.kernel_usages)

    def grid(self, M: int, K: int, usage: str) -> tuple[int, int]:
        """Shape of a usage's compact scale grid for the (M, K) view: one scale per block."""
        return self.format.grid(self.block, M, K, usage)

    @property
    def gemm_ready_scales(self) -> bool:
        """Scales stored in the GEMM's order (a format whose ``gemm_ready_scales``, Float8 blockwise, in
        the GEMM-ready layout): transposed or not, rows padded; MXFP8 scales stay compact in both."""
        return self.gemm_ready and self.format.gemm_ready_scales

    def transposed_scales(self, usage: str) -> bool:
        """GEMM-ready blockwise scales stored as the transpose of the compact grid (1x128 rowwise
        scales M-major; 128x128 columnwise tiles, whose grid is the transposed tensor's)."""
        return self.gemm_ready_scales and self.format.gemm_transposed_scales(self.block, usage)

    def transposed_data(self, usage: str) -> bool:
        """A usage's data stored as the (K, M) transpose of the 2-D view: GEMM-ready columnwise data
        (K-major for a GEMM that contracts over M)."""
        return self.gemm_ready and usage == "colwise"

    def data_shape(self, shape, usage: str) -> tuple[int, ...]:
        """Shape of a usage's data: the input's, or (K, M) for GEMM-ready columnwise data."""
        if self.transposed_data(usage):
            M, K = view_2d(shape)
            return (K, M)
        return tuple(shape)

    def scale_shape(self, M: int, K: int, usage: str) -> tuple[int, int]:
        """Shape of a usage's stored scales for the (M, K) view.

        Compact, and MXFP8 in either layout: ``grid(M, K, usage)``. GEMM-ready Float8 blockwise (TE's
        GEMM_READY), for the operand the GEMM reads (rows R, contraction C: (M, K) rowwise, (K, M)
        columnwise): 1x128 blocks ``(ceil(C/128), roundup(R, 4))`` (the grid transposed, its rows
        padded to 4); 128x128 tiles ``(ceil(R/128), roundup(ceil(C/128), 4))``. Padding entries hold
        ``GEMM_SCALE_PAD`` (1.0, the scale_inv of an all-zero block).
        """
        if not self.gemm_ready:
            return self.grid(M, K, usage)
        return self.format.gemm_scale_shape(self.block, M, K, usage)

    @property
    def scale_row_align(self) -> int:
        """Each stored scale row holds a multiple of this many entries (padded): 4 for GEMM-ready
        Float8 blockwise scales (the format's ``gemm_scale_align``), else 1."""
        return self.format.gemm_scale_align if self.gemm_ready_scales else 1

    def kernel_outputs(self, shape) -> list[tuple[tuple[int, ...], tuple[int, int]]]:
        """(data shape, scale shape) of each output the kernels write for a tensor of ``shape``, in
        ``kernel_usages`` order (compact shared tiles are laid out as the rowwise usage)."""
        M, K = view_2d(shape)
        return [(self.data_shape(shape, u), self.scale_shape(M, K, u)) for u in self.output_usages]

    @property
    def block_rows(self) -> int:
        """Height of the tallest block among the usages asked for (1 when no block spans rows)."""
        return max(bm for bm, _ in self.kernel_blocks)

    def only(self, usage: str) -> "Scheme":
        """This scheme with one usage (what dequantizing that usage needs)."""
        return dataclasses.replace(self, rowwise=usage == "rowwise", colwise=usage == "colwise")

    def ffi_attrs(self) -> dict:
        """The scheme as the FFI handlers' ``Scheme`` struct (ffi_common.h): one dictionary attribute.

        ``format``: the format's ``kernel_id`` (int32), which the handlers decode into their ``Format``
        enum (an unknown value is an FFI error naming it). ``outputs``: the kernels' outputs in ``kernel_usages`` order, four int32 each, flattened: the
        block (bm, bk) (``kernel_blocks``), whether the data is stored transposed (GEMM-ready columnwise
        data, (K, M)) and whether the scales are (``transposed_scales``); compact shared tiles are laid
        out as the rowwise usage (``kernel_outputs``). The handlers read every size, the padded length
        of a stored scale row included, from the buffers they are given.
        """
        outputs = []
        for u, (bm, bk) in zip(self.output_usages, self.kernel_blocks):
            outputs += [bm, bk, int(self.transposed_data(u)), int(self.transposed_scales(u))]
        return dict(fp8=np.int32(FP8_DTYPES.index(self.dtype)), format=np.int32(self.format.kernel_id),
                    pow2=np.bool_(self.pow2_scales), eps=np.float32(self.amax_epsilon),
                    saturate_inf=np.bool_(self.saturate_inf), outputs=np.array(outputs, np.int32))

    def packed_grids(self, shapes) -> list[list[tuple[int, tuple[int, int]]]]:
        """Where each weight's scale grids lie in one packed buffer (the master-weight kernels' layout):
        per weight (2-D shape (M, K)), per kernel block, the grid's first element and its shape."""
        at, out = 0, []
        for M, K in shapes:
            grids = []
            for bm, bk in self.kernel_blocks:
                shape = (cdiv(M, bm), cdiv(K, bk))
                grids.append((at, shape))
                at += shape[0] * shape[1]
            out.append(grids)
        return out

    def satisfied_by(self, other: "Scheme") -> bool:
        """Whether a tensor quantized with ``other`` already holds every usage this scheme asks for, in
        this format and layout. ``saturate_inf`` does not count: the data are the same bits under both
        rules and so are the scales, but for blocks that held an infinity."""
        if other.format is not self.format:
            return False
        same = dataclasses.replace(other, rowwise=self.rowwise, colwise=self.colwise,
                                   saturate_inf=self.saturate_inf) == self
        return same and (other.rowwise or not self.rowwise) and (other.colwise or not self.colwise)

    def scales_to_layout(self, xp, scale, M: int, K: int, usage: str, layout: str):
        """A usage's scales (the last two axes of ``scale``) of the (M, K) view, converted to
        ``layout`` from the other one (``xp``: the array namespace). MXFP8 scales are compact in both."""
        if not self.format.gemm_ready_scales:
            return scale
        rows, cols = self.grid(M, K, usage)
        gemm = dataclasses.replace(self, layout="gemm_ready")
        transposed = gemm.transposed_scales(usage)
        if layout == "gemm_ready":
            g = xp.swapaxes(scale, -1, -2) if transposed else scale
            pad = [(0, 0)] * (g.ndim - 1) + [(0, gemm.scale_shape(M, K, usage)[1] - g.shape[-1])]
            return xp.pad(g, pad, constant_values=np.float32(GEMM_SCALE_PAD))
        g = scale[..., :rows] if transposed else scale[..., :cols]  # drop the padding
        return xp.swapaxes(g, -1, -2) if transposed else g


def build_scheme(where: str, *args, **kw) -> Scheme:
    """A Scheme whose validation errors name ``where`` (the public function that was called)."""
    try:
        return Scheme(*args, **kw)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("Scheme:", f"{where}:", 1)) from None


def packed_size(grids) -> int:
    """Elements of a packed buffer laid out by :meth:`Scheme.packed_grids`."""
    return sum(r * c for weight in grids for _, (r, c) in weight)


def unpack_grids(packed, grids) -> list:
    """One weight's scale grids, as 2-D arrays, out of a packed buffer (``grids``: that weight's entry
    of :meth:`Scheme.packed_grids`)."""
    return [packed[at:at + r * c].reshape(r, c) for at, (r, c) in grids]
