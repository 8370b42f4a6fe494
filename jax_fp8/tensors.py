"""Quantized tensor pytrees: data and scales are leaves; the shape, the dtype that was quantized and
the :class:`~jax_fp8.Scheme` that produced them are static."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import numpy as np
from jax import lax

from ._compat import E8M0_DTYPE
from .arrays import view_2d
from .formats import BLOCKWISE, FORMATS, MXFP8, Format
from .scheme import Scheme

Array = Any


@dataclasses.dataclass(frozen=True)
class _QuantizedBase:
    """Fields shared by every quantized tensor: the four leaves, then the static ``shape`` (its 2-D
    view is ``(prod(shape[:-1]), shape[-1])``), ``dtype`` (the high-precision dtype that was
    quantized) and ``scheme``, which says everything else: format, FP8 dtype, blocks, layout, and
    which usages the tensor holds (a usage not held has None fields)."""

    rowwise_data: Optional[Array]
    rowwise_scale_inv: Optional[Array]
    colwise_data: Optional[Array]
    colwise_scale_inv: Optional[Array]
    shape: tuple
    dtype: np.dtype
    scheme: Scheme

    FORMAT: ClassVar[Format]  # the format whose tensors the subclass holds (set by Format.builds)

    def __post_init__(self):
        if not isinstance(self.scheme, Scheme) or self.scheme.format is not self.FORMAT:
            raise TypeError(f"{type(self).__name__}: scheme must be a jax_fp8.Scheme with fmt={self.FORMAT.name!r}, "
                            f"got {self.scheme!r}")

    def tree_flatten(self):
        return (self.rowwise_data, self.rowwise_scale_inv, self.colwise_data, self.colwise_scale_inv), \
            (self.shape, self.dtype, self.scheme)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    # ---- read from the scheme ---------------------------------------------------------------------
    @property
    def fp8_dtype(self) -> np.dtype:
        return self.scheme.dtype

    @property
    def layout(self) -> str:
        return self.scheme.layout

    @property
    def block(self) -> tuple:
        return self.scheme.block

    @property
    def has_rowwise(self) -> bool:
        return self.scheme.rowwise

    @property
    def has_colwise(self) -> bool:
        return self.scheme.colwise

    def usage_blocks(self) -> dict:
        """{'rowwise': (bm, bk), 'colwise': (bm, bk)} for the usages this tensor holds."""
        return {u: self.scheme.usage_block(u) for u in ("rowwise", "colwise") if getattr(self.scheme, u)}

    def with_scheme(self, scheme: Scheme, **fields):
        """This tensor with another scheme (and the leaves in ``fields`` replaced)."""
        return dataclasses.replace(self, **fields, scheme=scheme)

    def usage_fields(self, usage: str, where: str):
        """The (data, scale_inv) of a usage, checked against the scheme: data of the layout's shape
        and FP8 dtype, scales of the layout's shape and the format's scale dtype (E8M0 scales as
        uint8). Raises naming the field, never reinterprets bits."""
        blocks = self.usage_blocks()
        if usage not in blocks:
            raise ValueError(f"{where}: usage must be one of {sorted(blocks)}, got {usage!r}")
        data, scale = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")
        cls = type(self).__name__
        for name, leaf in (("data", data), ("scale_inv", scale)):
            if leaf is None:
                raise ValueError(f"{where}: {cls}'s scheme holds the {usage} usage but {usage}_{name} is None")
        scheme = self.scheme
        stacked = ("; its leaves look stacked (e.g. by vmap or scan outside the quantize): index the tensor "
                   "first or dequantize inside jax.vmap")
        want = scheme.data_shape(self.shape, usage)
        if tuple(data.shape) != want:
            extra = stacked if tuple(data.shape[-len(want):]) == want else ""
            raise ValueError(f"{where}: {cls}.{usage}_data has shape {tuple(data.shape)} but the tensor's "
                             f"{self.layout} layout has {want}{extra}")
        if np.dtype(data.dtype) != scheme.dtype:
            raise TypeError(f"{where}: {cls}.{usage}_data has dtype {data.dtype} but the scheme's FP8 dtype is "
                            f"{scheme.dtype}")
        M, K = view_2d(self.shape)
        grid = scheme.scale_shape(M, K, usage)
        if tuple(scale.shape) != grid:
            extra = stacked if tuple(scale.shape[-2:]) == grid else ""
            bm, bk = blocks[usage]
            raise ValueError(f"{where}: {cls}.{usage}_scale_inv has shape {tuple(scale.shape)}, want {grid} "
                             f"({bm}x{bk} blocks of the {M}x{K} view, {self.layout} layout){extra}")
        return data, self._checked_scale(scale, f"{where}: {cls}.{usage}_scale_inv")


@MXFP8.builds
@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MXFP8Tensor(_QuantizedBase):
    """An MXFP8 tensor (OCP microscaling): FP8 data with one E8M0 scale per 32 elements.

    ``rowwise_data`` / ``colwise_data`` have the input's shape and an FP8 dtype; the scales are uint8
    biased exponents (value ``2**(e - 127)``): rowwise ``(M, ceil(K/32))`` for 1x32 blocks along the
    last dim, columnwise ``(ceil(M/32), K)`` for 32x1 blocks along the first dim of the 2-D view
    ``(M, K) = (prod(shape[:-1]), shape[-1])``. Fields not asked for are None. ``layout="gemm_ready"``:
    ``colwise_data`` is stored transposed, (K, M) (K-major for a GEMM over M); scales stay as above.
    """

    @staticmethod
    def _checked_scale(scale, name):
        if E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE:
            return scale.view(np.uint8) if isinstance(scale, np.ndarray) else lax.bitcast_convert_type(scale, np.uint8)
        if scale.dtype != np.uint8:
            raise TypeError(f"{name} must hold E8M0 scales as uint8 (or float8_e8m0fnu), got {scale.dtype}")
        return scale

    @property
    def rowwise_scale_e8m0(self) -> Optional[Array]:
        """Rowwise scales as ``jnp.float8_e8m0fnu`` (where this jax has the dtype)."""
        return _as_e8m0(self.rowwise_scale_inv)

    @property
    def colwise_scale_e8m0(self) -> Optional[Array]:
        """Columnwise scales as ``jnp.float8_e8m0fnu`` (where this jax has the dtype)."""
        return _as_e8m0(self.colwise_scale_inv)


@BLOCKWISE.builds
@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockwiseTensor(_QuantizedBase):
    """A Float8 blockwise tensor (DeepSeek-V3 / TE Float8BlockQuantizer): FP8 data, fp32 ``scale_inv``.

    ``layout="compact"``: ``block == (1, 128)``: rowwise 1x128 blocks, scales ``(M, ceil(K/128))``;
    columnwise (if asked) 128x1 blocks, scales ``(ceil(M/128), K)``. ``block == (128, 128)``: one scale
    per 128x128 tile, ``(ceil(M/128), ceil(K/128))``; the tiles serve both usages, so ``colwise_*`` (if
    asked) are the same arrays as ``rowwise_*``. Data has the input's shape; dequantized value =
    data * scale_inv. ``layout="gemm_ready"`` (TE's GEMM_READY): columnwise data is the (K, M)
    transpose and the scales are transposed / padded as ``Scheme.scale_shape`` says; ``to_layout``
    converts between the two, exactly. ``scheme.saturate_inf`` False: blocks that held an infinity
    have scale_inv inf.
    """

    @staticmethod
    def _checked_scale(scale, name):
        if scale.dtype != np.float32:
            raise TypeError(f"{name} must be float32 scale_inv values, got {scale.dtype}")
        return scale


#: The quantized tensor types (what the API takes as already quantized): every format's.
QUANTIZED_TENSORS = tuple(f.tensor_class for f in FORMATS.values())


def _as_e8m0(scale):
    if scale is None:
        return None
    if E8M0_DTYPE is None:
        raise NotImplementedError("this jax has no float8_e8m0fnu dtype; use the uint8 scales")
    return lax.bitcast_convert_type(scale, E8M0_DTYPE)
