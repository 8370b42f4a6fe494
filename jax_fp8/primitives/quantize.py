"""``jf_quantize`` and ``jf_dequantize`` primitives over (B, M, K) arrays, parameterised by a Scheme.

Lowering (:func:`.registration.define_primitive`): our FFI kernels on ``cpu`` and ``cuda`` when their
module is built, else (and on every other platform) the jax.numpy contract, the same numbers. The scheme reaches the FFI
handlers as one dictionary attribute, ``scheme`` (ffi_common.h's ``Scheme``). Under ``jax.jit`` on a
mesh each splits over its batch, rows and last dim (:mod:`.partitioning`): the lowerings above belong
to the local twins, which run on each device's shard.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._compat import ShapedArray, ffi
from ..arrays import cdiv
from ..formats import BLOCKWISE, FLOAT8_BLOCK
from .. import contracts
from ..scheme import GEMM_SCALE_PAD
from ..vma import out_aval
from .partitioning import Dim, Rule
from .registration import define_primitive

# ---- quantize ----------------------------------------------------------------------------------
_FFI_RESULTS = 4  # the FFI target always has two (data, scale) result slots; unused ones are empty


def _quantize_abstract(x, *, scheme, stacked=False):
    if x.ndim != 3:
        raise ValueError(f"jf_quantize takes a (batch, rows, cols) array, got shape {x.shape}")
    B, M, K = x.shape
    if stacked and not (scheme.format is BLOCKWISE and scheme.block == (1, FLOAT8_BLOCK) and scheme.gemm_ready
                        and M % FLOAT8_BLOCK == 0):
        raise ValueError(f"jf_quantize: stacked sequences take GEMM-ready 1x{FLOAT8_BLOCK} blocks and rows (sequence "
                         f"length) a multiple of {FLOAT8_BLOCK}; got {scheme} and shape {x.shape}")
    outs = []
    for usage, (data, scale) in zip(scheme.output_usages, scheme.kernel_outputs((M, K))):
        d_at, s_at = _stacked_at(scheme, usage, stacked)
        outs += [out_aval(_insert(data, d_at, B), np.uint8, x), out_aval(_insert(scale, s_at, B), scheme.scale_dtype, x)]
    return outs


# Stacked sequences (``stacked=True``, for jf_fp8_gemm's stacked operands): the (B, S, K) input
# quantized as the (B*S, K) rows it folds into, each output with its rows' dim split into (B, S) in
# place: rowwise data (B, S, K) and scales (K/128, B, S); columnwise data (K, B, S) and scales
# (B, S/128, K). Every output is a reshape of the folded tensor's (no copy when the GEMM folds them
# back), and B and S stay separate dims, so a split S stays split under jit.
def _stacked_at(scheme, usage: str, stacked: bool = True) -> tuple[int, int]:
    """Where the batch dim of an output's data and scales sits: stacked, the sequences dim just before
    their rows; else first."""
    if not stacked:
        return 0, 0
    return int(scheme.transposed_data(usage)), int(scheme.transposed_scales(usage))


def _stacked_ats(scheme, stacked: bool = True) -> list:
    """:func:`_stacked_at` of every output, in the kernels' order (data, scale, data, scale)."""
    return [at for usage in scheme.output_usages for at in _stacked_at(scheme, usage, stacked)]


def _insert(shape: tuple, at: int, b) -> tuple:
    return (*shape[:at], b, *shape[at:])


def _unfold(folded, at: int, B: int):
    """A folded output with its dim ``at`` (B*S entries) split into (B, S)."""
    shape = folded.shape
    return folded.reshape(*shape[:at], B, shape[at] // B, *shape[at + 1:])


def _quantize_on_shard(bind, reduce_axes, params):
    """One device's quantize: the kernel on its (B, M, K) block; stacked, on its folded rows."""
    scheme = params["scheme"]
    if not params.get("stacked"):
        return lambda x: tuple(bind(x, scheme=scheme))

    def run(x):
        B, S, K = x.shape
        outs = bind(x.reshape(1, B * S, K), scheme=scheme)
        return tuple(_unfold(o[0], at, B) for o, at in zip(outs, _stacked_ats(scheme)))

    return run


def _input_dims(sizes):
    return Dim("b", sizes["b"]), Dim("m", sizes["m"]), Dim("k", sizes["k"])


def scale_dims(scheme, M: int, K: int, usage: str, m: str = "m", k: str = "k"):
    """A usage's scale grid of the (M, K) view as op dims (labels ``m`` and ``k``): entries per block,
    transposed and padded where ``scheme`` stores them so."""
    rows, cols = scheme.scale_shape(M, K, usage)
    bm, bk = scheme.usage_block(usage)
    pad = scheme.scale_row_align  # Scheme.scale_shape pads the stored rows
    if scheme.transposed_scales(usage):
        return Dim(k, rows, bk), Dim(m, cols, bm, pad)
    return Dim(m, rows, bm), Dim(k, cols, bk, pad)


def _quantize_arrays(sizes, params):
    scheme = params["scheme"]
    b, m, k = x = _input_dims(sizes)
    outs = []
    for usage in scheme.output_usages:
        data, scale = ((k, m) if scheme.transposed_data(usage) else (m, k)), scale_dims(scheme, m.size, k.size, usage)
        d_at, s_at = _stacked_at(scheme, usage, params.get("stacked", False))
        outs += [_insert(data, d_at, b), _insert(scale, s_at, b)]
    return [x], outs


_SIZES = lambda shapes, params: dict(zip("bmk", shapes[0]))  # noqa: E731  (data / x: (B, M, K))
_NAMES = dict(b="the batch dim", m="the rows (leading dims)", k="the last dim")


def _quantize_ffi_lowering(ctx, x, *, scheme):
    n = len(ctx.avals_out)
    padded = list(ctx.avals_out) + [ShapedArray((0,), np.uint8)] * (_FFI_RESULTS - n)
    outs = ffi.ffi_lowering("jf_quantize")(ctx.replace(avals_out=padded), x, scheme=scheme.ffi_attrs())
    return outs[:n]


def _quantize_batch(args, dims, *, scheme, **stacked):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    b, B = x.shape[:2]
    outs = quantize_p.bind(x.reshape(b * B, *x.shape[2:]), scheme=scheme, **stacked)
    ats = _stacked_ats(scheme, stacked.get("stacked", False))
    return [_unfold(o, at, b) for o, at in zip(outs, ats)], ats


_HINT = ("For a straight-through estimator use jax_fp8.quantize_dequantize (dequantize(quantize(x)) with an "
         "identity derivative).")
quantize_p = define_primitive(
    "jf_quantize", abstract=_quantize_abstract, reference=contracts.quantize_usages,
    ffi_rules=dict(cpu=_quantize_ffi_lowering, cuda=_quantize_ffi_lowering), batch=_quantize_batch,
    rule=Rule(("b", "m", "k"), _NAMES, _SIZES, _quantize_arrays, local=_quantize_on_shard, pad_value=GEMM_SCALE_PAD),
    multiple_results=True, no_jvp_hint=_HINT)

# ---- dequantize --------------------------------------------------------------------------------

def _dequantize_abstract(data, scale, *, scheme, out_dtype):
    if data.ndim != 3 or scale.ndim != 3 or data.dtype != np.uint8:
        raise ValueError("jf_dequantize takes (batch, rows, cols) uint8 data and rank-3 scales")
    (bm, bk), = scheme.kernel_blocks
    B, M, K = data.shape
    if scale.shape != (B, cdiv(M, bm), cdiv(K, bk)) or scale.dtype != scheme.scale_dtype:
        raise ValueError(f"jf_dequantize: scales {scale.dtype}{scale.shape} do not match data {data.shape} with "
                         f"{bm}x{bk} blocks of {scheme.scale_dtype}")
    return out_aval(data.shape, out_dtype, data, scale)


def _dequantize_arrays(sizes, params):
    scheme = params["scheme"]
    x = _input_dims(sizes)
    usage, = scheme.output_usages
    return [x, (x[0], *scale_dims(scheme, x[1].size, x[2].size, usage))], [x]


def _dequantize_ffi_lowering(ctx, data, scale, *, scheme, out_dtype):
    return ffi.ffi_lowering("jf_dequantize")(ctx, data, scale, scheme=scheme.ffi_attrs())


def _dequantize_batch(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    data, scale = (jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
                   for a, d in zip(args, dims))
    b, B = data.shape[:2]
    y = dequantize_p.bind(data.reshape(b * B, *data.shape[2:]), scale.reshape(b * B, *scale.shape[2:]), **params)
    return y.reshape(b, B, *y.shape[1:]), 0


dequantize_p = define_primitive(
    "jf_dequantize", abstract=_dequantize_abstract, reference=contracts.dequantize_blocks,
    ffi_rules=dict(cpu=_dequantize_ffi_lowering, cuda=_dequantize_ffi_lowering), batch=_dequantize_batch,
    rule=Rule(("b", "m", "k"), _NAMES, _SIZES, _dequantize_arrays), no_jvp_hint=_HINT)
