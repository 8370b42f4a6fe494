"""flax.linen calls computed here with a given ``dot_general``: ``nn.Einsum.__call__`` and
``nn.Embed.attend`` (which have no ``dot_general`` field), and the call-counting wrapper the linen
interceptor hands a layer."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax.numpy as jnp

_IN_FLIGHT = "_jax_fp8_in_flight"  # marks the linen interceptor's per-call wrapper (see _LinenConverter)


def _in_flight(dot_general: Callable, calls: list) -> Callable:
    """``dot_general`` counting its calls into ``calls``: a layer whose call never reached it is
    reported as left (e.g. a subclass whose ``__call__`` computes its product another way)."""

    @functools.wraps(dot_general)
    def call(*args, **kwargs):
        calls.append(None)
        return dot_general(*args, **kwargs)

    setattr(call, _IN_FLIGHT, True)
    return call


def _linen_einsum(module: Any, dot_general: Callable, inputs, einsum_str: Optional[str] = None):
    """``nn.Einsum.__call__`` with ``jnp.einsum(..., _dot_general=dot_general)`` (flax's calls
    ``jnp.einsum`` with no hook for it), line for line as flax 0.12's: the same parameters, the same
    bias handling. Runs inside the module's compact call (the interceptor's), so ``param`` works."""
    from flax.linen.module import merge_param

    einsum_str = merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    if "->" not in einsum_str:
        raise ValueError('`einsum_str` equation must be explicit and include "->".')
    if einsum_str.count(",") != 1:
        raise ValueError("`einsum_str` equation must have exactly two operands and therefore, exactly one comma "
                         f"character, instead of {einsum_str.count(',')}")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        bias_shape, broadcasted_bias_shape = module._get_bias_shape(einsum_str, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    y = jnp.einsum(einsum_str, inputs, kernel, precision=module.precision,
                   preferred_element_type=module.preferred_element_type, _dot_general=dot_general)
    if bias is not None:
        y += jnp.reshape(bias, broadcasted_bias_shape)
    return y


def _linen_attend(module: Any, dot_general: Callable, query):
    """``nn.Embed.attend`` (``jnp.dot(query, embedding.T)``) as ``dot_general`` of the (vocab, features)
    table, contracting its features: the same product, with the table as an (N, K) weight."""
    query, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
    return dot_general(query, embedding, (((query.ndim - 1,), (1,)), ((), ())))
