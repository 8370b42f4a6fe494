"""``fp8_ragged_dot``: a drop-in ``lax.ragged_dot`` (a mixture-of-experts layer's grouped GEMM) in Float8
blockwise FP8, with a training VJP whose three grouped GEMMs all take FP8 operands.

For ``y = ragged_dot(x, W, group_sizes)``, x (M, K) with its rows sorted by group and W (G, K, N), the
rows of group g (:mod:`jax_fp8.groups`) times expert g's weight:

- fprop ``y_g = x_g · W_g``: x rowwise (1x128 blocks along K) times each W_g in 128x128 tiles, an
  M-grouped GEMM;
- dgrad ``dx_g = dy_g · W_gᵀ``: dy rowwise (1x128 along N) times the same tiles in the other
  orientation (one quantization of W gives both), M-grouped;
- wgrad ``dW_g = x_gᵀ · dy_g``: x and dy columnwise, in blocks of 128 rows that restart at every group
  start (``jf_quantize_grouped``), so no block's scale mixes two experts' rows; a K-grouped GEMM whose
  contraction is each group's rows.

``group_sizes`` is read on the device everywhere: one compile serves every routing, with no host sync.
The three GEMMs are ``jf_fp8_ragged_gemm`` (:mod:`jax_fp8.gemm.ragged_primitive`): CUTLASS's grouped
kernels on an H100/H200, the reference math elsewhere.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import vma
from ..formats import HIGH_DTYPES
from ..quantization import quantize_each, quantize_grouped
from ..tensors import QUANTIZED_TENSORS
from ..warn import Fp8GemmFallbackWarning, warn
from ..primitives.partitioning import explicit_sharding
from .dot_general import (fallback_operand, lax_call, lax_keywords, reduction_order_reason, retyped,
                          reverse_mode_only, what_is_computed)
from .recipes import RECIPES, Float8BlockScaling
from .ragged_primitive import ragged_gemm

Array = Any


@dataclasses.dataclass(frozen=True)
class _Grouped:
    """Static description of one ``ragged_dot``: the recipe, the output dtype, and on an Explicit mesh
    the shardings that lhs's and rhs's types name (their gradients are typed alike; else None)."""

    recipe: Float8BlockScaling
    out_dtype: np.dtype
    x_sharding: Any = None
    w_sharding: Any = None


def _weights(w, recipe, rowwise: bool = True) -> dict:
    """Each expert's (K, N) weight in 128x128 tiles, both orientations from one pass (``rowwise`` False:
    fprop's alone): "rowwise" (G, K, N) data and tile scales (dgrad's operand, rows K), "colwise" (G, N, K)
    and scales (fprop's, rows N)."""
    return quantize_each(w, recipe.scheme("rhs", rowwise=rowwise))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged(x, w, group_sizes, cfg: _Grouped):
    xq = quantize_grouped(x, group_sizes, cfg.recipe.scheme("lhs", colwise=False))
    wq = _weights(w, cfg.recipe, rowwise=False)
    return ragged_gemm(*xq["rowwise"], *wq["colwise"], group_sizes, kind="m", out_dtype=cfg.out_dtype)


def _ragged_fwd(x, w, group_sizes, cfg: _Grouped):
    xq = quantize_grouped(x, group_sizes, cfg.recipe.scheme("lhs"))
    wq = _weights(w, cfg.recipe)
    y = ragged_gemm(*xq["rowwise"], *wq["colwise"], group_sizes, kind="m", out_dtype=cfg.out_dtype)
    return y, (xq["colwise"], wq["rowwise"], group_sizes, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _ragged_bwd(cfg: _Grouped, res, dy):
    x_cols, w_rows, group_sizes, x_dtype, w_dtype = res
    with reverse_mode_only("fp8_ragged_dot"):
        dyq = quantize_grouped(dy, group_sizes, cfg.recipe.scheme("grad"))  # rowwise (dgrad), columnwise (wgrad)
    dx = ragged_gemm(*dyq["rowwise"], *w_rows, group_sizes, kind="m", out_dtype=x_dtype.dtype)
    dw = ragged_gemm(*x_cols, *dyq["colwise"], group_sizes, kind="k", rows=dy.shape[0], out_dtype=w_dtype.dtype)
    return retyped(dx, cfg.x_sharding), retyped(dw, cfg.w_sharding), np.zeros(group_sizes.shape, jax.dtypes.float0)


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _fallback_reason(lhs, rhs, group_sizes, recipe, group_offset, reduction_order, out_dtype) -> Optional[str]:
    """Why a call does not run on the FP8 grouped GEMM (None: it does)."""
    if not isinstance(recipe, Float8BlockScaling):
        return f"the grouped FP8 GEMM takes the Float8BlockScaling recipe, not {type(recipe).__name__}"
    if group_offset is not None:
        return "group_offset is given"
    why = reduction_order_reason(reduction_order)
    if why:
        return why
    if isinstance(lhs, QUANTIZED_TENSORS) or isinstance(rhs, QUANTIZED_TENSORS):
        return "an operand is a quantized tensor (fp8_ragged_dot quantizes its high-precision operands itself)"
    if lhs.ndim != 2 or rhs.ndim != 3:
        return f"it takes lhs (M, K) and rhs (G, K, N), got ranks {lhs.ndim} and {rhs.ndim}"
    bad = [n for n, v in (("lhs", lhs), ("rhs", rhs)) if jnp.dtype(v.dtype) not in HIGH_DTYPES]
    if bad:
        return f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not float32, bfloat16 or float16"
    if jnp.dtype(out_dtype) not in HIGH_DTYPES:  # its gradient could not be quantized either
        return f"the result dtype {jnp.dtype(out_dtype).name} (the grouped GEMM gives float32, bfloat16 or float16)"
    return None


def _call_str(lhs, rhs) -> str:
    """``lhs float32[4, 8], rhs float32[2, 8, 16]``: the call's operands, for a warning."""
    return f"lhs {jnp.dtype(lhs.dtype).name}{list(lhs.shape)}, rhs {jnp.dtype(rhs.dtype).name}{list(rhs.shape)}"


def _fallback(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, out_sharding,
              reduction_order, recipe, why: str):
    """``lax.ragged_dot`` of the operands as ``fp8_dot_general``'s fallback takes them (quantize-dequantized,
    straight-through), with one warning."""
    (a, a_done), (b, b_done) = (fallback_operand(lhs, recipe.scheme("lhs")),
                                fallback_operand(rhs, recipe.scheme("rhs")))
    warn(f"fp8_ragged_dot ({_call_str(lhs, rhs)}): not on the FP8 grouped GEMM: {why}; computing "
         f"{what_is_computed(a_done, b_done, 'lax.ragged_dot')} instead", Fp8GemmFallbackWarning)
    return lax_call(lax.ragged_dot, a, b, group_sizes, precision, preferred_element_type, group_offset,
                    out_sharding=out_sharding, reduction_order=reduction_order)


def fp8_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                   out_sharding=None, *, reduction_order: Any = None,
                   recipe: Optional[Float8BlockScaling] = None):
    """``lax.ragged_dot`` in Float8 blockwise FP8, with ``lax.ragged_dot``'s signature and semantics: a
    drop-in for a mixture-of-experts layer's grouped GEMM.

    ``lhs`` (M, K): rows sorted by group; ``rhs`` (G, K, N): one weight per group (expert);
    ``group_sizes`` (G,) of an integer dtype (used as int32; wider dtypes cut to [0, M] first), read on
    the device (no host sync: one compile serves every routing, and the call captures into CUDA graphs).
    Group g holds the next ``group_sizes[g]`` rows; rows past the total give zeros, as in
    ``lax.ragged_dot``; a negative size counts as 0 and sizes past M are cut at M (``lax.ragged_dot``
    leaves both undefined). The result (M, N) has ``preferred_element_type`` (default:
    the operands' promoted dtype); ``precision`` is ignored on the FP8 path (it accumulates in fp32).

    Quantized with ``recipe`` (default :class:`Float8BlockScaling`, the only one taken): lhs in 1x128
    blocks, each rhs[g] in 128x128 tiles. Differentiable (reverse mode) through a custom VJP whose dgrad
    and weight gradient take FP8 operands too: the output gradient in 1x128 blocks, and for the weight
    gradient x and dy in blocks of 128 rows that restart at every group start (see the module doc).
    Gradients come back in the operands' dtypes; ``group_sizes`` gets none.

    Other calls (another recipe, ``group_offset``, other ranks or dtypes, a result dtype other than
    float32, bfloat16 or float16) compute ``lax.ragged_dot`` of quantize-dequantized operands (non-float
    ones as they are) with one :class:`~jax_fp8.Fp8GemmFallbackWarning` saying why. A float16 result is
    the float32 one rounded. ``out_sharding`` types the result on an Explicit mesh, as lax's, and where
    lax rejects it (Auto axes) constrains it instead, on the FP8 path and the fallback alike. On an
    Explicit mesh the gradients are typed as their operands. A ``reduction_order`` (jax 0.12's) other than
    "unordered" is the fallback's, which passes it on: the FP8 GEMMs sum in an order of their own.
    Arguments ``lax.ragged_dot`` rejects raise what it raises.
    """
    recipe = Float8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"fp8_ragged_dot: recipe must be a Float8BlockScaling or MXFP8BlockScaling, got {recipe!r}")
    # lax.ragged_dot's checks and result type: arrays by their shapes and jax's dtypes (float64 NumPy
    # operands are float32 without x64), anything else as given (a Python list or None raises what lax raises).
    # Outside any mesh: inside jax.set_mesh of Explicit axes lax.ragged_dot cannot type its result's sharding.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        out = jax.eval_shape(
            lambda *ops: lax.ragged_dot(*ops, precision, preferred_element_type, group_offset,
                                        **lax_keywords(reduction_order=reduction_order)),
            *(jax.ShapeDtypeStruct(v.shape, jax.dtypes.canonicalize_dtype(v.dtype))
              if hasattr(v, "shape") and hasattr(v, "dtype") else v for v in (lhs, rhs, group_sizes)))
    # jax arrays (tracers) and quantized tensors as given; NumPy arrays and scalars as jax.numpy takes them
    lhs, rhs, group_sizes = (v if isinstance(v, (jax.Array, *QUANTIZED_TENSORS)) else jnp.asarray(v)
                             for v in (lhs, rhs, group_sizes))
    why = _fallback_reason(lhs, rhs, group_sizes, recipe, group_offset, reduction_order, out.dtype)
    if why is not None:
        return _fallback(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, out_sharding,
                         reduction_order, recipe, why)
    if lhs.size == 0 or rhs.size == 0:
        return retyped(jnp.zeros(out.shape, out.dtype), out_sharding)
    # any integer dtype, as lax takes it, used as int32: sizes of wider dtypes cut to [0, M] first (a size
    # past M counts as M, not as what its low 32 bits say)
    if jnp.iinfo(group_sizes.dtype).max > np.iinfo(np.int32).max:
        group_sizes = jnp.clip(group_sizes, 0, lhs.shape[0])
    lhs, rhs, group_sizes = vma.match(lhs, rhs, group_sizes.astype(jnp.int32))
    with reverse_mode_only("fp8_ragged_dot"):
        y = _ragged(lhs, rhs, group_sizes,
                    _Grouped(recipe, jnp.dtype(out.dtype), explicit_sharding(lhs), explicit_sharding(rhs)))
    return retyped(y, out_sharding)
