"""FP8 GEMMs: ``fp8_dot_general``, a drop-in ``dot_general`` that multiplies Float8 blockwise operands
on the ``jf_fp8_gemm`` primitive, with a training VJP whose three GEMMs all run in FP8.

Recipe (:class:`Float8BlockScaling`, TransformerEngine's / DeepSeek-V3's): the lhs (activations) and
the gradients are quantized in 1x128 blocks, the rhs (weights) in 128x128 tiles; E4M3, gradients
optionally E5M2. For ``y = x · W`` with x (M, K) and W (N, K) (or (K, N), flax's kernel):

- fprop ``y = x · Wᵀ``: x rowwise (1x128) x W with 128x128 tiles, contraction over K;
- dgrad ``dx = dy · W``: dy rowwise (1x128) x W's other orientation (the same tiles, transposed, from
  the same quantization pass), contraction over N;
- wgrad ``dW = dyᵀ · x``: the columnwise usages of dy and x (128x1 blocks along M, stored transposed:
  K-major for a contraction over M), 1x128 x 1x128.

x and W are quantized once in the forward (both usages in one pass, GEMM-ready layout) and saved as the
operands the backward needs; dy is quantized once (rowwise and columnwise in one call).
"""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import vma
from .warn import warn
from ._compat import E8M0_DTYPE
from .api import dequantize, quantize, quantize_dequantize, to_layout
from .arrays import bitcast, cdiv, view_2d
from .formats import FLOAT8_BLOCK, HIGH_DTYPES, MX_BLOCK, check_amax_epsilon, fp8_dtype
from .layout import kernel_pairs
from .primitives.gemm import (BLOCK_1D, BLOCK_2D, K_ALIGN, OUT_DTYPES, Fp8GemmFallbackWarning, GemmPlan,
                              blocked_gemm, dense_gemm, fp8_gemm_bind, gemm_supported, operand_scale_shape,
                              operand_values)
from .primitives.partitioning import explicit_sharding
from .primitives.quantize import quantize_p
from .scheme import GEMM_SCALE_PAD, Scheme
from .tensors import BlockwiseTensor, MXFP8Tensor

Array = Any
__all__ = ["fp8_dot_general", "fp8_gemm", "gemm_operand", "gemm_supported", "GemmOperand", "GemmPlan",
           "Float8BlockScaling", "Fp8GemmFallbackWarning", "mxfp8_scaled_matmul_operands"]


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling:
    """The Float8 blockwise recipe (TE's ``Float8BlockScaling``, DeepSeek-V3): lhs and gradients in 1x128
    blocks, rhs (weights) in 128x128 tiles, E4M3; ``grad_dtype`` E4M3 (default) or E5M2 for the output
    gradient; ``pow2_scales`` and ``amax_epsilon`` as in :func:`jax_fp8.quantize_blockwise`. Hashable.

    Its schemes have ``saturate_inf=False``: a block holding an infinity gets an infinite scale_inv, so
    the GEMMs return non-finite values wherever an infinity of an operand reaches, as lax.dot_general
    does (TE's rule, saturation, would return finite numbers there)."""

    grad_dtype: Any = jnp.float8_e4m3fn
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "grad_dtype", fp8_dtype(self.grad_dtype, "Float8BlockScaling: grad_dtype"))
        object.__setattr__(self, "amax_epsilon", check_amax_epsilon(self.amax_epsilon, "Float8BlockScaling"))
        if not isinstance(self.pow2_scales, (bool, np.bool_)):
            raise TypeError(f"Float8BlockScaling: pow2_scales must be a bool, got {self.pow2_scales!r}")

    def scheme(self, role: str, rowwise: bool = True, colwise: bool = True) -> Scheme:
        """The GEMM-ready scheme of a role: 'lhs' (activations), 'rhs' (weights) or 'grad'."""
        block = BLOCK_2D if role == "rhs" else BLOCK_1D
        dtype = self.grad_dtype if role == "grad" else jnp.float8_e4m3fn
        return Scheme("blockwise", dtype, rowwise=rowwise, colwise=colwise, block=block,
                      pow2_scales=bool(self.pow2_scales), amax_epsilon=self.amax_epsilon, layout="gemm_ready",
                      saturate_inf=False)


# ---- operands -----------------------------------------------------------------------------------
@partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=["block"])
@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """One operand of the TN GEMM: FP8 ``data`` (rows, K), contraction over its last dim, and its fp32
    GEMM-ready ``scale`` for ``block`` ((1, 128) or (128, 128)) blocks (``jf_fp8_gemm``'s contract)."""

    data: Array
    scale: Array
    block: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def values(self):
        """fp32 values (rows, K): the dequantized operand."""
        return operand_values(self.data, self.scale, self.block)

    def padded(self, rows: int, k: int) -> "GemmOperand":
        """Zero rows / columns appended (scale padding 1.0): the same product, aligned shapes."""
        r, c = self.shape
        if (rows, k) == (r, c):
            return self
        data = jnp.pad(self.data, ((0, rows - r), (0, k - c)))
        want = operand_scale_shape(rows, k, self.block)
        pads = [(0, w - s) for w, s in zip(want, self.scale.shape)]
        return GemmOperand(data, jnp.pad(self.scale, pads, constant_values=np.float32(GEMM_SCALE_PAD)), self.block)


def _share_tiles(q: BlockwiseTensor) -> BlockwiseTensor:
    """128x128 tiles serve both usages: fill the missing one from the other (exact)."""
    q = to_layout(q, "compact")
    src = "rowwise" if q.has_rowwise else "colwise"
    d, s = getattr(q, f"{src}_data"), getattr(q, f"{src}_scale_inv")
    return dataclasses.replace(q, rowwise_data=d, rowwise_scale_inv=s, colwise_data=d, colwise_scale_inv=s)


def gemm_operand(q: BlockwiseTensor, contract: str = "last") -> Optional[GemmOperand]:
    """The GEMM operand of a Float8 blockwise tensor, viewed as 2-D (R, C): contracted over C
    (``contract='last'``: its rowwise usage, (R, C)) or over R (``'first'``: its columnwise usage, the
    transposed (C, R)). Any layout is accepted (converted exactly); 128x128 tiles serve both. Returns
    None when the tensor does not hold the usage (1x128 blocks without it)."""
    if not isinstance(q, BlockwiseTensor):
        raise TypeError(f"gemm_operand: q must be a jax_fp8.BlockwiseTensor, got {type(q).__name__}")
    if contract not in ("last", "first"):
        raise ValueError(f"gemm_operand: contract must be 'last' or 'first', got {contract!r}")
    tiles = tuple(q.block) == BLOCK_2D
    usage = "rowwise" if contract == "last" else "colwise"
    if usage not in q.usage_blocks():
        if not tiles:
            return None
        q = _share_tiles(q)
    q = to_layout(q, "gemm_ready")
    data, scale = q.usage_fields(usage, "gemm_operand")
    R, C = view_2d(q.shape)
    return GemmOperand(data.reshape(R, C) if usage == "rowwise" else data, scale, BLOCK_2D if tiles else BLOCK_1D)


def _plan(a: GemmOperand, b: GemmOperand) -> GemmPlan:
    (M, K), (N, _) = a.shape, b.shape
    return gemm_supported(M, N, K, a.block, b.block, a.data.dtype, b.data.dtype)


def _gemm_dtype(out_dtype) -> np.dtype:
    out_dtype = jnp.dtype(out_dtype)
    return out_dtype if out_dtype in OUT_DTYPES else jnp.dtype(jnp.float32)


def _gemm(a, b, out_dtype, c=None):
    """``a · bᵀ (+ c)`` as ``out_dtype``: the FP8 GEMM (padded as ``gemm_supported`` plans), else the
    reference math; no warning here. ``a`` / ``b``: GemmOperands, or fp32 values (rows, K) where no
    FP8 operand exists (then dequantize + fp32 dot)."""
    if isinstance(a, GemmOperand) and a.data.ndim == 3:  # stacked (aligned by _stackable)
        out = fp8_gemm_bind(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block,
                            out_dtype=_gemm_dtype(out_dtype))
        return out.astype(out_dtype)
    M, N = a.shape[0], b.shape[0]
    plan = _plan(a, b) if isinstance(a, GemmOperand) and isinstance(b, GemmOperand) else None
    if plan is not None and not plan.ok:  # the primitive's reference numbers: no overflow the GEMM lacks
        return blocked_gemm(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block,
                            out_dtype=out_dtype)
    if plan is None:
        vals = [x.values() if isinstance(x, GemmOperand) else x for x in (a, b)]
        return dense_gemm(*vals, c, out_dtype=out_dtype)
    dtype = _gemm_dtype(out_dtype)
    if c is not None:
        c = jnp.pad(c.astype(dtype), ((0, plan.M - M), (0, plan.N - N)))
    a, b = a.padded(plan.M, plan.K), b.padded(plan.N, plan.K)
    out = fp8_gemm_bind(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block, out_dtype=dtype)
    return out[:M, :N].astype(out_dtype)


def fp8_gemm(a, b, out_dtype=jnp.bfloat16, c=None):
    """``a · bᵀ (+ c)`` on the FP8 GEMM, for already-quantized operands.

    ``a`` (M, K) and ``b`` (N, K): :class:`GemmOperand` or :class:`~jax_fp8.BlockwiseTensor` (2-D view,
    contracted over its last dim, see :func:`gemm_operand`). Misaligned shapes are padded
    (:func:`gemm_supported`); what the GEMM cannot take is computed by its reference math, with a
    :class:`Fp8GemmFallbackWarning`. ``out_dtype``: float32, bfloat16 (the GEMM's own outputs) or
    float16 (computed in fp32). Not differentiable (use :func:`fp8_dot_general`).
    """
    ops = []
    for name, x in (("a", a), ("b", b)):
        if isinstance(x, BlockwiseTensor):
            op = gemm_operand(x, "last")
            if op is None:
                raise ValueError(f"fp8_gemm: {name} has no rowwise usage (its 1x128 blocks along the last dim)")
            x = op
        if not isinstance(x, GemmOperand):
            raise TypeError(f"fp8_gemm: {name} must be a GemmOperand or BlockwiseTensor, got {type(x).__name__}")
        ops.append(x)
    if ops[0].shape[1] != ops[1].shape[1]:
        raise ValueError(f"fp8_gemm: a {ops[0].shape} and b {ops[1].shape} must share K, their last dim")
    plan = _plan(*ops)
    if not plan.ok and plan.M * plan.N * plan.K:
        _warn(f"fp8_gemm: computed by the reference math: the FP8 GEMM cannot take {plan.reason}")
    return _gemm(*ops, jnp.dtype(out_dtype), c)


def _warn(msg: str) -> None:
    warn(msg, Fp8GemmFallbackWarning)


# ---- the linear layer with its VJP ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Linear:
    """Static description of one ``y = x · W`` (x (M, K); W (K, N) when ``rhs_kn`` else (N, K))."""

    recipe: Float8BlockScaling
    rhs_kn: bool
    out_dtype: np.dtype
    x_sharding: Any = None  # x's and W's shardings where their types carry one (an Explicit mesh): a
    w_sharding: Any = None  # custom VJP's gradients must have the primals' types

    @property
    def w_fprop(self) -> str:  # contraction of W's 2-D view in fprop: over K
        return "first" if self.rhs_kn else "last"

    @property
    def w_dgrad(self) -> str:  # and in dgrad: over N
        return "last" if self.rhs_kn else "first"


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A (B, S, K) activation or gradient quantized sequence by sequence (the kernels' batch dim), so
    that a split S stays split under jit: rowwise data (B, S, K) with scales (B, K/128, S), columnwise
    data (B, K, S) with scales (B, S/128, K); the stacked operands of ``jf_fp8_gemm``. With S % 128 == 0
    every block lies inside one sequence: the same blocks, bits and GEMMs as the (B*S, K) tensor's."""

    usages: dict  # usage -> (FP8 data, fp32 scale)

    @classmethod
    def of(cls, x3, scheme: Scheme) -> "_Stacked":
        return cls(dict(zip(scheme.kernel_usages, kernel_pairs(scheme, quantize_p.bind(x3, scheme=scheme)))))

    def operand(self, contract: str) -> GemmOperand:
        data, scale = self.usages["rowwise" if contract == "last" else "colwise"]
        return GemmOperand(data, scale, BLOCK_1D)


def _stackable(lshape, N: int, x) -> bool:
    """Whether the lhs takes the stacked GEMMs: rank >= 3, not pre-quantized, S % 128 == 0 and K, N
    aligned as contractions (fprop's, dgrad's; the stacked GEMMs take no padding), and its sequences may
    be split across devices (:func:`_sequences_may_split`)."""
    return (len(lshape) >= 3 and not isinstance(x, BlockwiseTensor) and lshape[-2] % FLOAT8_BLOCK == 0
            and lshape[-1] % K_ALIGN == 0 and N % K_ALIGN == 0 and _sequences_may_split(x))


def _sequences_may_split(x) -> bool:
    """Stacking pays only where ``x``'s sequences may be split over devices: elsewhere the folded GEMMs
    are the same bits, and cheaper (the stacked weight gradient transposes its FP8 operands, about 3%
    of the H200 model step, bench/RESULTS.md). An Explicit type says whether an inner leading dim is
    split; inside shard_map the arrays are local; otherwise (Auto axes: the split is decided when XLA
    compiles) it may be wherever jit has more than one device."""
    s = explicit_sharding(x)
    if s is not None:
        spec = tuple(s.spec) + (None,) * (x.ndim - len(tuple(s.spec)))
        return any(e is not None for e in spec[1:-1])
    types = tuple(jax.sharding.get_abstract_mesh().axis_types)
    if types and all(t == jax.sharding.AxisType.Manual for t in types):  # inside shard_map: local arrays
        return False
    return len(jax.devices()) > 1 or len(jax.devices("cpu")) > 1


def _quantized(x, scheme: Scheme):
    if isinstance(x, BlockwiseTensor):
        return x
    return _Stacked.of(x, scheme) if x.ndim == 3 else quantize(x, scheme)


def _operand(q, contract: str):
    return q.operand(contract) if isinstance(q, _Stacked) else gemm_operand(q, contract)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear(x, w, cfg: _Linear):
    """y (M, N) = x · W on the FP8 GEMM. x: (M, K) array or BlockwiseTensor; w: (N, K) / (K, N)."""
    r = cfg.recipe
    xq = _quantized(x, r.scheme("lhs", colwise=False))
    wq = _quantized(w, r.scheme("rhs", rowwise=not cfg.rhs_kn, colwise=cfg.rhs_kn))
    return _gemm(_operand(xq, "last"), gemm_operand(wq, cfg.w_fprop), cfg.out_dtype)


def _linear_fwd(x, w, cfg: _Linear):
    """Forward: quantize x (1x128, both usages) and W (128x128, both orientations) once; the residuals
    are the backward's operands: xᵀ (K, M) for wgrad, W's dgrad orientation (K, N), and the dtypes.
    An operand the backward needs but a pre-quantized tensor lacks is saved as fp32 values instead."""
    r = cfg.recipe
    xq, wq = _quantized(x, r.scheme("lhs")), _quantized(w, r.scheme("rhs"))
    y = _gemm(_operand(xq, "last"), gemm_operand(wq, cfg.w_fprop), cfg.out_dtype)
    x_t = None if isinstance(w, BlockwiseTensor) else _operand_or_values(xq, "first")  # wgrad: xᵀ (K, M)
    w_d = None if isinstance(x, BlockwiseTensor) else _operand_or_values(wq, cfg.w_dgrad)  # dgrad: (K, N)
    return y, (x_t, w_d, _dtype_of(x), _dtype_of(w))


def _operand_or_values(q: BlockwiseTensor, contract: str):
    """``gemm_operand(q, contract)``, or, where ``q`` lacks that usage, its fp32 values in the same
    orientation (the backward then computes that GEMM by the reference math)."""
    op = _operand(q, contract)
    if op is not None:
        return op
    v = dequantize(q, jnp.float32).reshape(view_2d(q.shape))
    return v if contract == "last" else v.T


def _dtype_of(v):
    """A zero-size array carrying ``v``'s dtype (dtypes are not valid residuals)."""
    return None if isinstance(v, BlockwiseTensor) else jnp.zeros((0,), v.dtype)


def _linear_bwd(cfg: _Linear, res, dy):
    x_t, w_d, x_dtype, w_dtype = res
    with _reverse_mode_only():  # under jax.hessian this runs under forward mode: say why it cannot
        dyq = _quantized(dy, cfg.recipe.scheme("grad"))  # rowwise (dgrad) and columnwise (wgrad) in one pass
    dx = dw = None
    if x_dtype is not None:  # dx (M, K) = dy (M, N) · [W as (K, N)]ᵀ
        dx = _retyped(_gemm(_operand(dyq, "last"), w_d, x_dtype.dtype), cfg.x_sharding)
    if w_dtype is not None:  # dW = dyᵀ · x: (N, K) = dyᵀ (N, M) · [xᵀ (K, M)]ᵀ, or its transpose for (K, N)
        dy_t = _operand(dyq, "first")
        dw = _gemm(x_t, dy_t, w_dtype.dtype) if cfg.rhs_kn else _gemm(dy_t, x_t, w_dtype.dtype)
        dw = _retyped(dw, cfg.w_sharding)
    return dx, dw


def _explicit_sharding_of(v):
    """:func:`explicit_sharding` of an array operand (a pre-quantized tensor gets no gradient)."""
    return None if isinstance(v, BlockwiseTensor) else explicit_sharding(v)


def _retyped(v, sharding):
    return v if sharding is None or jax.typeof(v).sharding == sharding else jax.sharding.reshard(v, sharding)


@contextlib.contextmanager
def _reverse_mode_only():
    """Turn jax's forward-mode error inside fp8_dot_general's GEMM path into one that names it."""
    try:
        yield
    except TypeError as e:
        if "forward-mode" in str(e) or "is not differentiable" in str(e):
            raise TypeError(
                "fp8_dot_general: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) is not "
                "supported on the FP8 GEMM path: its derivative is a custom VJP whose backward "
                "GEMMs run in FP8 on the operands quantized in the forward, a rule for reverse mode only. Use "
                "reverse mode (jax.grad, jax.vjp, jax.jacrev), or lax.dot_general where forward mode is needed."
            ) from e
        raise


_linear.defvjp(_linear_fwd, _linear_bwd)


def _usable(x, contract: str) -> bool:
    """Whether ``x`` (an array to quantize, or a BlockwiseTensor) gives a GEMM operand contracted so."""
    if not isinstance(x, BlockwiseTensor):
        return True
    return tuple(x.block) == BLOCK_2D or ("rowwise" if contract == "last" else "colwise") in x.usage_blocks()


def _fallback_reasons(M: int, N: int, K: int, x, w, cfg: _Linear) -> list[str]:
    """Why any of the GEMMs of this linear layer (fprop; dgrad when x gets a gradient; wgrad when W
    does) cannot run on the FP8 GEMM; empty when all can. Each one that cannot is computed by the
    reference math (fp32, scaled per K block) on the same quantized operands."""
    xq = isinstance(x, BlockwiseTensor)
    wq = isinstance(w, BlockwiseTensor)
    xb, xd = (tuple(x.block), x.fp8_dtype) if xq else (BLOCK_1D, jnp.float8_e4m3fn)
    wb, wd = (tuple(w.block), w.fp8_dtype) if wq else (BLOCK_2D, jnp.float8_e4m3fn)
    g = cfg.recipe.grad_dtype
    gemms = [("fprop", (M, N, K, xb, wb, xd, wd), _usable(x, "last") and _usable(w, cfg.w_fprop))]
    if not xq:  # dx = dy · W: (M, K), contraction over N
        gemms.append(("dgrad", (M, K, N, BLOCK_1D, wb, g, wd), _usable(w, cfg.w_dgrad)))
    if not wq:  # dW = dyᵀ · x over M: xᵀ (K, M) and dyᵀ (N, M), in W's orientation
        args = (K, N, M, xb, BLOCK_1D, xd, g) if cfg.rhs_kn else (N, K, M, BLOCK_1D, xb, g, xd)
        gemms.append(("wgrad", args, _usable(x, "first")))
    reasons = []
    for name, args, usable in gemms:
        plan = gemm_supported(*args)
        if not usable:
            reasons.append(f"{name}: a pre-quantized operand lacks the usage this GEMM contracts (1x128 blocks "
                           "along the other dim)")
        elif not plan.ok:
            reasons.append(f"{name}: {plan.reason}")
    return reasons


# ---- dot_general ------------------------------------------------------------------------------------
def _recipe_shape(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> Union[bool, str]:
    """``rhs_kn`` (rhs is (K, N)) when the recipe's GEMM takes these dimension numbers, else why not."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in np.atleast_1d(v)) for v in (lc, rc, lb, rb))  # ints or sequences
    if lb or rb:
        return "batch dimensions in dimension_numbers"
    if rhs_ndim != 2:
        return f"an rhs of rank {rhs_ndim} (the GEMM takes a 2-D weight)"
    if len(lc) != 1 or len(rc) != 1:
        return f"a contraction over {len(lc)} dimensions (the GEMM contracts one)"
    if lc[0] != lhs_ndim - 1:
        return "a contraction over an lhs dimension other than the last"
    return rc[0] == 0


def _fake_quant(x, block, recipe: Float8BlockScaling):
    """The fallback's operand: quantize-dequantize (straight-through gradient) or dequantized values."""
    if isinstance(x, (BlockwiseTensor, MXFP8Tensor)):
        return dequantize(x)
    if x.ndim == 0 or x.size == 0 or jnp.dtype(x.dtype) not in HIGH_DTYPES:
        return x
    qdq = quantize_dequantize(x, "blockwise", usage="rowwise", block=block, dtype=jnp.float8_e4m3fn,
                              pow2_scales=bool(recipe.pow2_scales), amax_epsilon=recipe.amax_epsilon)
    return jnp.where(jnp.isfinite(x), qdq, x)  # infinities reach the dot, as in lax.dot_general


def _check_like_lax(lhs, rhs, dimension_numbers, precision, preferred_element_type) -> None:
    """Raise what ``lax.dot_general`` raises for these arguments (dimension numbers out of range or
    malformed, mismatched shapes, a bad precision or dtype): evaluate it abstractly on the operands'
    shapes and (high-precision) dtypes."""
    ops = [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x
           for x in (lhs, rhs)]  # anything else (a scalar, a Python list) goes to lax as it is
    shaped = [i for i, x in enumerate(ops) if isinstance(x, jax.ShapeDtypeStruct)]

    def dot(*avals):
        args = list(ops)
        for i, a in zip(shaped, avals):
            args[i] = a
        return lax.dot_general(*args, dimension_numbers, precision, preferred_element_type=preferred_element_type)

    jax.eval_shape(dot, *(ops[i] for i in shaped))


def _as_operand(x):
    if isinstance(x, (BlockwiseTensor, MXFP8Tensor)):
        return x
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    return x


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                    recipe: Optional[Float8BlockScaling] = None, out_sharding=None):
    """``lax.dot_general`` on the FP8 GEMM, with ``lax.dot_general``'s signature: a drop-in for
    ``flax.linen.Dense(dot_general=...)``, ``flax.nnx.Linear(dot_general=...)`` and
    ``jnp.einsum(..., _dot_general=...)``.

    High-precision operands (float32, bfloat16, float16) are quantized with ``recipe`` (default
    :class:`Float8BlockScaling`): ``lhs`` (activations) in 1x128 blocks, ``rhs`` (weights) in 128x128
    tiles; a :class:`~jax_fp8.BlockwiseTensor` is used as it is (any layout, converted exactly; it gets
    no gradient). Differentiable through a custom VJP whose dgrad and wgrad GEMMs run in FP8 too, on
    the operands quantized in the forward (see the module docstring); gradients come back in the
    primal dtypes. Works under ``jit`` (sharded operands split as ``lax.dot_general``'s; README,
    "Sharded jit"), ``vmap``, ``grad``, ``jax.checkpoint`` and ``shard_map``.

    Taken by the GEMM: contraction over ``lhs``'s last dim and one dim of a 2-D ``rhs`` ((K, N), as
    flax's kernel, or (N, K)), no batch dims; ``lhs``'s leading dims flatten into M (an lhs (..., S, K)
    with S % 128 == 0 and K, N multiples of 16 runs as stacked sequences of S rows, each device folding
    its own: the same bits, and a split S stays split under ``jit``). Shapes are padded
    to cuBLASLt's alignment (:func:`gemm_supported`). Anything else is computed as ``lax.dot_general``
    of quantize-dequantized operands (dequantized ones for quantized inputs; unquantized for non-float
    ones), with one :class:`Fp8GemmFallbackWarning` per call saying why: always a correct answer. A
    single GEMM of the three that cannot run in FP8 (shapes too small to pad cheaply, 2D x 2D or
    E5M2 x E5M2 pre-quantized pairs, a pre-quantized operand without the usage it needs) is computed
    by the reference math on the same quantized operands; the call's one warning names each of them
    (dgrad and wgrad included, decided from the shapes at the call).

    The result has ``preferred_element_type`` (default: the operands' promoted dtype); ``precision`` is
    ignored by the FP8 GEMM (it accumulates in fp32) and passed on by the fallback. Arguments that
    ``lax.dot_general`` rejects (dimension numbers out of range, negative or malformed, mismatched
    contracted dims, an unknown ``precision``) raise what it raises.

    Non-finite values propagate as in ``lax.dot_general``: an infinity or NaN in an operand (or in the
    output gradient) makes every output (gradient) it reaches non-finite, so NaN checks and loss
    scalers see an overflow. On the GEMM path a NaN stays NaN in FP8, and a block holding an infinity
    gets an infinite scale (the recipe's ``saturate_inf=False``), so its outputs are inf or NaN; an
    infinity in a weight's 128x128 tile reaches all 128 output columns of that tile. On the
    ``lax.dot_general`` fallback an infinity reaches the dot as it is (lax's pattern exactly) and the
    rest of its block is quantized at scale 1 (TransformerEngine's rule), losing its precision.

    Reverse mode only on the GEMM path (``jax.grad``, ``jax.vjp``, ``jax.jacrev``): forward mode
    (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) raises a ``TypeError`` that says why; the fallback
    (``lax.dot_general`` of straight-through quantize-dequantized operands) supports both.
    """
    recipe = Float8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, Float8BlockScaling):
        raise TypeError(f"fp8_dot_general: recipe must be a Float8BlockScaling, got {recipe!r}")
    _check_like_lax(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    lhs, rhs = _as_operand(lhs), _as_operand(rhs)
    lshape, rshape = tuple(lhs.shape), tuple(rhs.shape)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs.dtype, rhs.dtype))
    rhs_kn = _recipe_shape(len(lshape), len(rshape), dimension_numbers)
    reason = None if isinstance(rhs_kn, bool) else rhs_kn
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if reason is None and isinstance(x, MXFP8Tensor):
            reason = f"an MXFP8 {name} (no Hopper GEMM; on Blackwell see mxfp8_scaled_matmul_operands)"
        elif reason is None and not isinstance(x, BlockwiseTensor) and jnp.dtype(x.dtype) not in HIGH_DTYPES:
            reason = f"an {name} of dtype {x.dtype} (FP8 quantizes float32, bfloat16, float16)"
    if reason is None and out_sharding is not None:
        reason = "out_sharding (not supported by the FP8 GEMM)"
    if reason is None and out_dtype not in HIGH_DTYPES:  # its gradient could not be quantized either
        reason = f"preferred_element_type {out_dtype} (the GEMM gives float32, bfloat16 or float16)"
    if reason is None:
        K = lshape[-1]
        M, N = int(np.prod(lshape[:-1], dtype=np.int64)), rshape[1 if rhs_kn else 0]
        cfg = _Linear(recipe, rhs_kn, out_dtype)
        if not (_usable(lhs, "last") and _usable(rhs, cfg.w_fprop)):
            reason = "a pre-quantized operand lacks the usage the forward GEMM contracts (1x128 blocks along it)"
        elif M * N * K:
            reasons = _fallback_reasons(M, N, K, lhs, rhs, cfg)
            if reasons:
                _warn("fp8_dot_general: computing by the reference math (same quantized operands) instead of "
                      "the FP8 GEMM: " + "; ".join(reasons))
            # sequences (B, S, K) kept apart where all three GEMMs take them stacked: a split S stays split
            x = (lhs if isinstance(lhs, BlockwiseTensor) else lhs.reshape(-1, *lshape[-2:])
                 if not reasons and _stackable(lshape, N, lhs) else lhs.reshape(M, K))
            cfg = dataclasses.replace(cfg, x_sharding=_explicit_sharding_of(x), w_sharding=_explicit_sharding_of(rhs))
            # one varying-axes type for both operands, as lax.dot_general casts them: the cast of a
            # replicated operand transposes to the psum its gradient needs under shard_map
            x, w = vma.match(x, rhs)
            with _reverse_mode_only():
                return _linear(x, w, cfg).reshape(*lshape[:-1], N)
    if reason is not None:
        _warn(f"fp8_dot_general: computing dot_general of quantize-dequantized operands instead of the FP8 "
              f"GEMM: {reason}")
    # the fallback, and empty products (nothing to quantize, no warning)
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    return lax.dot_general(_fake_quant(lhs, BLOCK_1D, recipe), _fake_quant(rhs, BLOCK_2D, recipe),
                           dimension_numbers, precision, preferred_element_type=out_dtype, **kw)


# ---- MXFP8 interop (Blackwell: cuDNN through jax.nn.scaled_matmul) ---------------------------------
def mxfp8_scaled_matmul_operands(q: MXFP8Tensor, usage: str = "rowwise"):
    """An MXFP8 tensor as one operand of ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM on
    Blackwell): ``(data, scales)`` of shapes (1, rows, Kp) FP8 and (1, rows, Kp/32) ``float8_e8m0fnu``.

    ``usage='rowwise'``: the (M, K) 2-D view contracted over K (1x32 blocks); ``'colwise'``: the (K, M)
    transpose contracted over M (32x1 blocks). The contraction dim is zero-padded to a multiple of 32
    (``scaled_matmul`` infers the block size as K // K_scales), which changes no product. With
    ``a, sa = mxfp8_scaled_matmul_operands(qx)`` and ``b, sb = mxfp8_scaled_matmul_operands(qw)`` for x
    (M, K) and W (N, K), ``jax.nn.scaled_matmul(a, b, sa, sb)[0]`` is ``x̃ · W̃ᵀ`` of the dequantized
    operands. (jax 0.10 lowers ``scaled_matmul`` on CUDA and ROCm only; its ROCm rule is
    ``lax.scaled_dot`` with dimension numbers (((2,), (2,)), ((0,), (0,))), which runs anywhere.)
    """
    if not isinstance(q, MXFP8Tensor):
        raise TypeError(f"mxfp8_scaled_matmul_operands: q must be a jax_fp8.MXFP8Tensor, got {type(q).__name__}")
    if E8M0_DTYPE is None:
        raise NotImplementedError("mxfp8_scaled_matmul_operands: this jax has no float8_e8m0fnu dtype")
    if usage not in ("rowwise", "colwise"):
        raise ValueError(f"mxfp8_scaled_matmul_operands: usage must be 'rowwise' or 'colwise', got {usage!r}")
    data, scale = q.usage_fields(usage, "mxfp8_scaled_matmul_operands")
    M, K = view_2d(q.shape)
    if usage == "rowwise":
        data = data.reshape(M, K)
    else:  # columnwise: (K, M) data, contraction over M; compact scales (ceil(M/32), K) transposed
        data = data if q.layout == "gemm_ready" else data.reshape(M, K).T
        scale = scale.T
    k = data.shape[1]
    data = jnp.pad(data, ((0, 0), (0, cdiv(k, MX_BLOCK) * MX_BLOCK - k)))
    return data[None], bitcast(jnp.asarray(scale), E8M0_DTYPE)[None]
