"""flax.linen modules on :mod:`jax_fp8.fused`'s layers: :class:`RMSNormDense` (an RMSNorm, or a LayerNorm,
and the projection it feeds) and :class:`RMSNormMLP` (the norm and a SwiGLU or GELU MLP), each with every
quantization fused into the kernel that produces the operand. This module imports flax
(``jax_fp8.flax_utils`` loads it on first use of these names).

Their parameters are those of the unfused modules they replace, under the names of those modules:
``RMSNormDense(norm_name="attn_norm", dense_name="wqkv")`` holds ``attn_norm/scale`` (as ``nn.RMSNorm``)
and ``wqkv/kernel`` (as ``nn.Dense(use_bias=False)``), with the same initialisers. With
``nn.share_scope(parent, module)`` those names land in the parent's scope, so a model that called
``nn.RMSNorm(name="attn_norm")`` and ``nn.Dense(name="wqkv")`` keeps its parameter tree, its
initial values and its checkpoints.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

from .. import fused


class _Param(nn.Module):
    """One parameter, in the scope of a module named as the unfused model's (its ``name``)."""

    param_name: str
    initializer: Callable
    shape: tuple
    dtype: Any

    @nn.compact
    def __call__(self):
        return self.param(self.param_name, self.initializer, self.shape, self.dtype)


class _Norm(nn.Module):
    """A norm's parameters, in the scope of a module named as the unfused model's norm: ``scale`` (as
    ``nn.RMSNorm`` / ``nn.LayerNorm``) and, for a LayerNorm with ``use_bias``, ``bias``."""

    features: int
    dtype: Any
    scale_init: Callable
    bias_init: Optional[Callable]  # None: no bias

    @nn.compact
    def __call__(self):
        scale = self.param("scale", self.scale_init, (self.features,), self.dtype)
        bias = None if self.bias_init is None else self.param("bias", self.bias_init, (self.features,), self.dtype)
        return scale, bias


def _norm_params(m: nn.Module, d: int):
    """(scale, bias) of module ``m``'s norm (None, None where ``m.norm`` is off; bias None unless a LayerNorm
    with ``use_bias``)."""
    if m.layernorm_type not in fused.NORMS:
        raise ValueError(f"{type(m).__name__}: layernorm_type must be one of {fused.NORMS}, got {m.layernorm_type!r}")
    if not m.norm:
        return None, None
    bias_init = m.bias_init if m.layernorm_type == "layernorm" and m.use_bias else None
    return _Norm(d, m.param_dtype, m.scale_init, bias_init, name=m.norm_name)()


class RMSNormDense(nn.Module):
    """``nn.Dense(features, use_bias=False)(nn.RMSNorm()(x))`` on :func:`jax_fp8.fused.norm_dense`: the norm
    writes the projection's FP8 operands directly and the fp32 master kernel is cast and quantized in one
    pass, with the bits of jax_fp8's unfused ops (:func:`jax_fp8.fused.rms_norm` and
    :func:`jax_fp8.fp8_dot_general`). ``dtype``: the activations' (default: x's); ``param_dtype``: the
    masters'. ``norm=False``: no norm (x quantized as it is). ``layernorm_type="layernorm"``
    (TransformerEngine's name): ``nn.LayerNorm`` instead, its ``bias`` too unless ``use_bias=False``."""

    features: int
    epsilon: float = 1e-6
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    scale_init: Callable = nn.initializers.ones
    bias_init: Callable = nn.initializers.zeros
    recipe: Optional[Any] = None
    norm: bool = True
    layernorm_type: str = "rmsnorm"
    use_bias: bool = True
    norm_name: str = "norm"
    dense_name: str = "dense"

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale, bias = _norm_params(self, d)
        kernel = _Param("kernel", self.kernel_init, (d, self.features), self.param_dtype, name=self.dense_name)()
        x = x.astype(self.dtype or x.dtype)
        return fused.norm_dense(x, scale, kernel, eps=self.epsilon, recipe=self.recipe, norm=self.layernorm_type,
                                beta=bias)


class RMSNormMLP(nn.Module):
    """The SwiGLU MLP of an RMSNorm'd ``x`` on :func:`jax_fp8.fused.norm_mlp`: ``gate, up =
    split(Dense(2 * hidden)(RMSNorm()(x)))``, ``Dense(features)(silu(gate) * up)``, every quantization
    fused into the kernel that produces its operand (forward and backward), with the bits of jax_fp8's
    unfused ops. ``activation="gelu"``: ``Dense(features)(gelu(Dense(hidden)(RMSNorm()(x))))`` (tanh
    form). ``features``: the output width (default: x's); ``norm=False``: no norm; ``layernorm_type`` and
    ``use_bias``: as :class:`RMSNormDense`'s. Parameter names: ``norm_name/scale`` (and ``norm_name/bias``),
    ``gate_up_name/kernel`` (d, 2 * hidden; GELU: d, hidden), ``down_name/kernel`` (hidden, features)."""

    hidden: int
    features: Optional[int] = None
    epsilon: float = 1e-6
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    scale_init: Callable = nn.initializers.ones
    bias_init: Callable = nn.initializers.zeros
    recipe: Optional[Any] = None
    norm: bool = True
    layernorm_type: str = "rmsnorm"
    use_bias: bool = True
    norm_name: str = "norm"
    gate_up_name: str = "gate_up"
    down_name: str = "down"
    activation: str = "swiglu"

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        out = self.features or d
        scale, bias = _norm_params(self, d)
        if self.activation not in fused.ACTIVATIONS:
            raise ValueError(f"RMSNormMLP: activation must be one of {tuple(fused.ACTIVATIONS)}, got "
                             f"{self.activation!r}")
        width = fused.ACTIVATIONS[self.activation][1] * self.hidden
        w1 = _Param("kernel", self.kernel_init, (d, width), self.param_dtype, name=self.gate_up_name)()
        w2 = _Param("kernel", self.kernel_init, (self.hidden, out), self.param_dtype, name=self.down_name)()
        x = x.astype(self.dtype or x.dtype)
        return fused.norm_mlp(x, scale, w1, w2, eps=self.epsilon, recipe=self.recipe, activation=self.activation,
                              norm=self.layernorm_type, beta=bias)
