"""Layers whose quantization is fused into the kernels that produce each FP8 operand, so that no
activation, gradient or weight makes a separate quantize pass (DESIGN section 11):

- :func:`norm_dense`: ``fp8_dot_general(rms_norm(x, gamma), kernel)`` (or :func:`layer_norm`): the
  norm writes x's FP8 operands directly (rowwise for the forward GEMM, columnwise for the weight
  gradient), and the fp32 master ``kernel`` is cast and quantized to its 128x128 tiles in one pass;
- :func:`norm_mlp`: the SwiGLU (or GELU) MLP ``fp8_dot_general(swiglu(fp8_dot_general(rms_norm(x,
  gamma), w_gate_up)), w_down)``: the norm and the activation write the next GEMM's operands, and in the
  backward the activation's derivative writes the up projection's output gradient in FP8
  (TransformerEngine's ``layernorm_mlp`` with ``dact_lu`` + quantize).

Each gives the bits of the unfused composition of :func:`rms_norm` (:func:`layer_norm`), :func:`swiglu`
(:func:`gelu`) and :func:`~jax_fp8.fp8_dot_general` (the produced tensors are rounded to the activation
dtype and quantized exactly as the unfused program quantizes them), forward and backward, except that a
master weight's gradient comes out of the weight-gradient GEMM in the weight's dtype rather than rounded
to the activation dtype first. :func:`rms_norm`, :func:`layer_norm`, :func:`swiglu` and :func:`gelu` are
the unfused ops, with jax_fp8's exact numbers (:mod:`jax_fp8.producers`) and the VJPs the fused layers
use.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import vma
from .arrays import view_2d
from .formats import HIGH_DTYPES
from .gemm.dot_general import Linear, fp8_dot_general, linear_backward, linear_forward
from .gemm.plan import plan_dot_general
from .gemm.recipes import RECIPES, Float8BlockScaling, MXFP8BlockScaling
from .gemm.backends.cudnn import warn_emulated
from .primitives.partitioning import explicit_sharding, rows_view
from .quantization import produce, produce_quantize, quantize
from .warn import Fp8GemmFallbackWarning, warn

_F32 = np.float32


# ---- the unfused ops: exact numbers, their VJPs ------------------------------------------------------
def _norm_grad(norm: str, x, gamma, stats, dy):
    """(dx, dgamma, dbeta) of a norm given the output gradient ``dy`` and the forward's statistics (RMSNorm:
    rstd (...,); LayerNorm: (..., 2) = (mean, rstd)), fp32 math in XLA; dbeta float32, None for RMSNorm.
    (:func:`jax_fp8.quantization.norm_grad`, our kernel, gives the same quantities with the same bits on
    every platform and run, but took 1.5-2.7x XLA's time on an H100: bench/RESULTS.md, "Issue 48, fifth
    session".)"""
    K = x.shape[-1]
    if norm == "rmsnorm":
        rstd = stats[..., None]
        xhat = x.astype(_F32) * rstd
    else:
        mean, rstd = stats[..., 0:1], stats[..., 1:2]
        xhat = (x.astype(_F32) - mean) * rstd
    dyf = dy.astype(_F32)
    dxhat = dyf * gamma.astype(_F32)
    dgamma = jnp.sum((dyf * xhat).reshape(-1, K), axis=0).astype(gamma.dtype)
    c2 = jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
    if norm == "rmsnorm":
        return (rstd * (dxhat - xhat * c2)).astype(x.dtype), dgamma, None
    c1 = jnp.mean(dxhat, axis=-1, keepdims=True)
    dbeta = jnp.sum(dyf.reshape(-1, K), axis=0)
    return (rstd * (dxhat - c1 - xhat * c2)).astype(x.dtype), dgamma, dbeta


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, gamma, eps: float):
    return produce("rmsnorm", x, gamma, eps=eps)[0]


def _rms_norm_fwd(x, gamma, eps):
    y, (rstd,) = produce("rmsnorm", x, gamma, eps=eps)
    return y, (x, gamma, rstd)


def _rms_norm_bwd(eps, res, dy):
    return _norm_grad("rmsnorm", *res, dy)[:2]


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x, gamma, eps: float = 1e-6):
    """RMSNorm of ``x`` along its last dim: ``x / sqrt(mean(x**2) + eps) * gamma``, computed in fp32 in
    a fixed order (:mod:`jax_fp8.producers`; on our kernels, the same bits on every platform and as the
    fused layers' norm) and rounded to x's dtype. Differentiable (reverse mode). ``gamma``:
    (x.shape[-1],), any float dtype."""
    x, gamma = _checked_norm(x, gamma, "rms_norm")
    x, gamma = vma.match(x, gamma)  # one varying type: a replicated gamma's gradient is summed over shard_map's axes
    return _rms_norm(x, gamma, float(eps))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, gamma, beta, eps: float):
    return produce("layernorm", x, gamma, beta, eps=eps)[0]


def _layer_norm_fwd(x, gamma, beta, eps):
    y, (stats,) = produce("layernorm", x, gamma, beta, eps=eps)
    return y, (x, gamma, stats, _marker(beta))


def _layer_norm_bwd(eps, res, dy):
    x, gamma, stats, beta = res
    dx, dgamma, dbeta = _norm_grad("layernorm", x, gamma, stats, dy)
    return dx, dgamma, dbeta.astype(beta.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x, gamma, beta=None, eps: float = 1e-6):
    """LayerNorm of ``x`` along its last dim: ``(x - mean) / sqrt(var + eps) * gamma + beta``, computed in
    fp32 in a fixed order (two passes: the mean, then the centred sum of squares; :mod:`jax_fp8.producers`;
    on our kernels, the same bits on every platform and as the fused layers' norm) and rounded to x's
    dtype. Differentiable (reverse mode). ``gamma``, ``beta``: (x.shape[-1],), any float dtype; ``beta``
    None: no bias."""
    x, gamma = _checked_norm(x, gamma, "layer_norm")
    beta = _checked_beta(beta, x.shape[-1], "layer_norm")
    x, gamma, b = vma.match(x, gamma, _beta_or_zeros(beta, x.shape[-1]))
    return _layer_norm(x, gamma, b, float(eps))


def _activation(producer: str, doc: str):
    """The unfused activation ``producer`` on jf_produce, its VJP the ``producer + "_grad"`` kernel."""
    @jax.custom_vjp
    def act(h):
        return produce(producer, h)[0]

    act.defvjp(lambda h: (produce(producer, h)[0], h),
               lambda h, da: (produce(producer + "_grad", da, h, out_dtype=h.dtype)[0],))
    act.__name__ = act.__qualname__ = producer
    act.__doc__ = doc
    return act


swiglu = _activation("swiglu", """SwiGLU of ``h`` (..., 2F) = [gate | up]: ``silu(gate) * up`` in fp32 with
    jax_fp8's exact sigmoid (:mod:`jax_fp8.producers`; on our kernels, the same bits on every platform and as
    the fused layers'), rounded to h's dtype. Differentiable (reverse mode).""")
gelu = _activation("gelu", """GELU, tanh form (``jax.nn.gelu(x, approximate=True)``): ``x * sigmoid(x * (A + B
    x**2))`` in fp32 with jax_fp8's exact sigmoid (:mod:`jax_fp8.producers`; on our kernels, the same bits
    on every platform and as the fused layers'), rounded to x's dtype. Differentiable (reverse mode).""")

#: norm_mlp's activations: the unfused op, and how many columns of the up projection make one output
ACTIVATIONS = {"swiglu": (swiglu, 2), "gelu": (gelu, 1)}


# ---- the fused layers ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Layer:
    """Static description of a fused layer: its norm (``NORMS``; None: none) and ``eps``, the recipe, its
    projections' :class:`~jax_fp8.gemm.dot_general.Linear` (their GEMM plans) in order, the MLP's
    activation."""

    norm: Optional[str]
    eps: float
    recipe: Float8BlockScaling | MXFP8BlockScaling
    dense: tuple
    activation: str = "swiglu"


def _linear(where: str, M: int, K: int, N: int, dtype, recipe, x=None, w=None) -> Optional[Linear]:
    """The FP8 projection (M, K) x (K, N) in ``dtype`` with its three GEMMs (and the Explicit shardings
    of its operands ``x`` and ``w`` where given: their gradients keep them), or None where
    ``fp8_dot_general`` would not run it as one (then the layer runs unfused). Warns, as
    ``fp8_dot_general`` does, of GEMMs that run by the reference math."""
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    plan = plan_dot_general(spec(M, K), spec(K, N), (((1,), (0,)), ((), ())), jnp.dtype(dtype), recipe)
    if plan.fallback is not None or plan.empty or len(plan.steps) != 3:
        return None
    if plan.reasons():
        warn(f"{where} (a {M}x{K} by {K}x{N} projection): computing by the reference math (same quantized operands) "
             "instead of the FP8 GEMM: " + "; ".join(plan.reasons()), Fp8GemmFallbackWarning)
    if isinstance(recipe, MXFP8BlockScaling):
        warn_emulated(where)
    shardings = [None if v is None else explicit_sharding(v) for v in (x, w)]
    return Linear(recipe, plan, jnp.dtype(dtype), *shardings)


def _norm_quantize(x2, gamma, beta, cfg: _Layer, scheme):
    """x's FP8 operands: the norm fused with the quantization (with its statistics), or x quantized as it is."""
    if cfg.norm is None:
        return quantize(x2, scheme), None
    params = (gamma,) if cfg.norm == "rmsnorm" else (gamma, beta)
    q, (stats,) = produce_quantize(cfg.norm, x2, *params, scheme=scheme, eps=cfg.eps)
    return q, stats


def _weight(w, dtype, scheme):
    """A weight's FP8 tiles: a master of another dtype is rounded to ``dtype`` in the same pass."""
    if jnp.dtype(w.dtype) == jnp.dtype(dtype):
        return quantize(w, scheme)
    return produce_quantize("cast", w, scheme=scheme, out_dtype=dtype)[0]


def _x_grad(x2, gamma, beta, stats, dn, cfg: _Layer):
    """(dx, dgamma, dbeta) through the norm (None where it has none, or no beta)."""
    if cfg.norm is None:
        return dn, None, None
    dx, dgamma, dbeta = _norm_grad(cfg.norm, x2, gamma, stats, dn)
    return dx, dgamma, None if dbeta is None else dbeta.astype(beta.dtype)


def _marker(v):
    """A zero-size array carrying ``v``'s dtype (dtypes are not valid residuals)."""
    return jnp.zeros((0,), v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_dense(x2, gamma, beta, w, cfg: _Layer):
    return _norm_dense_fwd(x2, gamma, beta, w, cfg)[0]


def _norm_dense_fwd(x2, gamma, beta, w, cfg: _Layer):
    (lin,) = cfg.dense
    xq, stats = _norm_quantize(x2, gamma, beta, cfg, cfg.recipe.scheme("lhs"))
    y, saved = linear_forward(lin, {"x": xq, "w": _weight(w, x2.dtype, cfg.recipe.scheme("rhs"))})
    return y, (saved, x2, gamma, beta, stats, _marker(w))


def _norm_dense_bwd(cfg: _Layer, res, dy):
    saved, x2, gamma, beta, stats, w_dtype = res
    (lin,) = cfg.dense
    dn, dw = linear_backward(lin, saved, quantize(dy, cfg.recipe.scheme("grad")), x2.dtype, w_dtype.dtype)
    return (*_x_grad(x2, gamma, beta, stats, dn, cfg), dw)


_norm_dense.defvjp(_norm_dense_fwd, _norm_dense_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _norm_mlp(x2, gamma, beta, w1, w2, cfg: _Layer):
    return _norm_mlp_fwd(x2, gamma, beta, w1, w2, cfg)[0]


def _norm_mlp_fwd(x2, gamma, beta, w1, w2, cfg: _Layer):
    up, down = cfg.dense
    lhs, rhs = cfg.recipe.scheme("lhs"), cfg.recipe.scheme("rhs")
    xq, stats = _norm_quantize(x2, gamma, beta, cfg, lhs)
    h, saved_up = linear_forward(up, {"x": xq, "w": _weight(w1, x2.dtype, rhs)})
    aq, _ = produce_quantize(cfg.activation, h, scheme=lhs)  # the down projection's input, straight to FP8
    y, saved_down = linear_forward(down, {"x": aq, "w": _weight(w2, x2.dtype, rhs)})
    return y, (saved_up, saved_down, h, x2, gamma, beta, stats, _marker(w1), _marker(w2))


def _norm_mlp_bwd(cfg: _Layer, res, dy):
    saved_up, saved_down, h, x2, gamma, beta, stats, w1_dtype, w2_dtype = res
    up, down = cfg.dense
    grad = cfg.recipe.scheme("grad")
    da, dw2 = linear_backward(down, saved_down, quantize(dy, grad), h.dtype, w2_dtype.dtype)
    # the activation's gradient, in FP8
    dhq, _ = produce_quantize(cfg.activation + "_grad", da, h, scheme=grad, out_dtype=h.dtype)
    dn, dw1 = linear_backward(up, saved_up, dhq, x2.dtype, w1_dtype.dtype)
    return (*_x_grad(x2, gamma, beta, stats, dn, cfg), dw1, dw2)


_norm_mlp.defvjp(_norm_mlp_fwd, _norm_mlp_bwd)


# ---- the public layers -------------------------------------------------------------------------------
def _checked_norm(x, gamma, where: str):
    x = jnp.asarray(x) if not hasattr(x, "dtype") else x
    gamma = jnp.asarray(gamma) if not hasattr(gamma, "dtype") else gamma
    if jnp.dtype(x.dtype) not in HIGH_DTYPES or x.ndim < 1:
        raise TypeError(f"{where}: x must be a float32, bfloat16 or float16 array of rank >= 1, got "
                        f"{jnp.dtype(x.dtype).name}{list(x.shape)}")
    if tuple(gamma.shape) != (x.shape[-1],) or jnp.dtype(gamma.dtype) not in HIGH_DTYPES:
        raise ValueError(f"{where}: gamma must be a float array of shape ({x.shape[-1]},) (x's last dim), got "
                         f"{jnp.dtype(gamma.dtype).name}{list(gamma.shape)}")
    return x, gamma


def _checked_beta(beta, K: int, where: str):
    """LayerNorm's bias checked (None stays None)."""
    if beta is None:
        return None
    beta = jnp.asarray(beta) if not hasattr(beta, "dtype") else beta
    if tuple(beta.shape) != (K,) or jnp.dtype(beta.dtype) not in HIGH_DTYPES:
        raise ValueError(f"{where}: beta must be a float array of shape ({K},) (x's last dim), got "
                         f"{jnp.dtype(beta.dtype).name}{list(beta.shape)}")
    return beta


def _beta_or_zeros(beta, K: int):
    """The bias the LayerNorm kernels add: ``beta``, or zeros where there is none."""
    return jnp.zeros((K,), _F32) if beta is None else beta


#: The fused layers' norms (:mod:`jax_fp8.producers`' names)
NORMS = ("rmsnorm", "layernorm")


def _norm_kind(norm: str, gamma, beta, where: str) -> Optional[str]:
    """The layer's norm: ``norm`` (checked), or None where ``gamma`` is None (no norm)."""
    if norm not in NORMS:
        raise ValueError(f"{where}: norm must be one of {NORMS}, got {norm!r}")
    if beta is not None and (gamma is None or norm != "layernorm"):
        raise ValueError(f"{where}: beta is LayerNorm's bias: it takes norm='layernorm' and a gamma")
    return None if gamma is None else norm


def _unfused_norm(x, gamma, beta, norm: Optional[str], eps: float):
    if norm is None:
        return x
    return rms_norm(x, gamma, eps) if norm == "rmsnorm" else layer_norm(x, gamma, beta, eps)


def _checked_kernel(w, rows: int, name: str, where: str):
    w = jnp.asarray(w) if not hasattr(w, "dtype") else w
    if w.ndim != 2 or w.shape[0] != rows or jnp.dtype(w.dtype) not in HIGH_DTYPES:
        raise ValueError(f"{where}: {name} must be a float (in, out) kernel with {rows} rows, got "
                         f"{jnp.dtype(w.dtype).name}{list(w.shape)}")
    return w


def _recipe(recipe, where: str):
    recipe = Float8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"{where}: recipe must be a Float8BlockScaling or MXFP8BlockScaling, got {recipe!r}")
    return recipe


def _dense(x, w, recipe):
    """The unfused projection (as flax's ``Dense`` with ``dtype=x.dtype``: the kernel cast first)."""
    return fp8_dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())), recipe=recipe)


def _checked_layer_norm(x, gamma, beta, norm: str, where: str):
    """(x, gamma, beta, the norm's kind) of a fused layer, checked."""
    kind = _norm_kind(norm, gamma, beta, where)
    x, gamma = _checked_norm(x, gamma, where) if gamma is not None else (x, None)
    return x, gamma, _checked_beta(beta, x.shape[-1], where), kind


def norm_dense(x, gamma, kernel, *, eps: float = 1e-6, recipe=None, norm: str = "rmsnorm", beta=None):
    """``fp8_dot_general(rms_norm(x, gamma, eps), kernel.astype(x.dtype))`` with the norm fused into x's
    quantization and the kernel's cast into its, the same bits (module docstring). ``x`` (..., K) in the
    activation dtype; ``gamma`` (K,) or None (no norm: x quantized as it is); ``kernel`` (K, N) (flax's
    layout; an fp32 master is rounded to x's dtype in the quantize pass, and its gradient comes back in
    fp32). ``norm="layernorm"``: :func:`layer_norm` instead, with the bias ``beta`` (K,) or None (none).
    Returns (..., N) in x's dtype; differentiable in x, gamma, beta and kernel (reverse mode). Shapes
    ``fp8_dot_general`` does not run on its GEMM run unfused, as that composition."""
    recipe = _recipe(recipe, "norm_dense")
    x, gamma, beta, kind = _checked_layer_norm(x, gamma, beta, norm, "norm_dense")
    kernel = _checked_kernel(kernel, x.shape[-1], "kernel", "norm_dense")
    M, K = view_2d(x.shape)
    x2 = rows_view(x, (M, K))
    lin = _linear("norm_dense", M, K, kernel.shape[1], x.dtype, recipe, x2, kernel)
    if lin is None:
        return _dense(_unfused_norm(x, gamma, beta, kind, eps), kernel, recipe)
    b = _beta_or_zeros(beta, K) if kind == "layernorm" else None
    x2, gamma, b, kernel = vma.match(x2, gamma, b, kernel)  # one varying type, as fp8_dot_general's operands
    y = _norm_dense(x2, gamma, b, kernel, _Layer(kind, float(eps), recipe, (lin,)))
    return rows_view(y, (*x.shape[:-1], kernel.shape[1]))


def norm_mlp(x, gamma, w_gate_up, w_down, *, eps: float = 1e-6, recipe=None, activation: str = "swiglu",
             norm: str = "rmsnorm", beta=None):
    """The SwiGLU MLP ``fp8_dot_general(swiglu(fp8_dot_general(rms_norm(x, gamma, eps), w_gate_up)),
    w_down)`` (kernels cast to x's dtype) with every quantization fused into its producer, the same
    bits (module docstring). ``x`` (..., K); ``gamma`` (K,) or None (no norm); ``w_gate_up`` (K, 2F)
    whose first F columns make the gate and the last F the up projection; ``w_down`` (F, N).
    ``activation="gelu"``: the GELU MLP ``gelu(x @ w_gate_up) @ w_down`` instead, ``w_gate_up`` (K, F)
    the up projection. ``norm="layernorm"``: :func:`layer_norm` with the bias ``beta`` (K,) or None, as
    :func:`norm_dense`'s. Returns (..., N) in x's dtype; differentiable in x, gamma, beta and both kernels
    (reverse mode). Shapes ``fp8_dot_general`` does not run on its GEMM run unfused, as that composition."""
    recipe = _recipe(recipe, "norm_mlp")
    if activation not in ACTIVATIONS:
        raise ValueError(f"norm_mlp: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    act, per_out = ACTIVATIONS[activation]
    x, gamma, beta, kind = _checked_layer_norm(x, gamma, beta, norm, "norm_mlp")
    w_gate_up = _checked_kernel(w_gate_up, x.shape[-1], "w_gate_up", "norm_mlp")
    if w_gate_up.shape[1] % per_out:
        raise ValueError(f"norm_mlp: w_gate_up must have an even number of columns ([gate | up]), got "
                         f"{list(w_gate_up.shape)}")
    H = w_gate_up.shape[1]
    F = H // per_out
    w_down = _checked_kernel(w_down, F, "w_down", "norm_mlp")
    M, K = view_2d(x.shape)
    x2 = rows_view(x, (M, K))
    up = _linear("norm_mlp", M, K, H, x.dtype, recipe, x2, w_gate_up)
    down = _linear("norm_mlp", M, F, w_down.shape[1], x.dtype, recipe, None, w_down)
    if up is None or down is None:
        h = _dense(_unfused_norm(x, gamma, beta, kind, eps), w_gate_up, recipe)
        return _dense(act(h), w_down, recipe)
    b = _beta_or_zeros(beta, K) if kind == "layernorm" else None
    x2, gamma, b, w_gate_up, w_down = vma.match(x2, gamma, b, w_gate_up, w_down)
    cfg = _Layer(kind, float(eps), recipe, (up, down), activation)
    y = _norm_mlp(x2, gamma, b, w_gate_up, w_down, cfg)
    return rows_view(y, (*x.shape[:-1], w_down.shape[1]))
