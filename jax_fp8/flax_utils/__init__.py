"""Flax helpers for :func:`jax_fp8.fp8_dot_general` (they need flax, which ``import jax_fp8`` does not import: a
function here imports it when called).

``fp8_dot_general`` has ``lax.dot_general``'s signature, so one argument puts a Flax layer on the FP8
GEMM, with no other change to the model::

    flax.nnx.Linear(d_in, d_out, dot_general=jf.fp8_dot_general, rngs=rngs)
    flax.linen.Dense(d_out, dot_general=jf.fp8_dot_general)

Float8 blockwise scaling keeps no state: every call computes its scales from the operands (1x128
blocks for activations and gradients, 128x128 tiles for weights). There are no amax histories or
scale variables, so none of flax's FP8 meta machinery (the ``_overwrite_with_gradient`` collection)
is involved: parameters, optimizer and train step stay as they are in bf16.

A whole existing model (one built by someone else's code) goes on FP8 in one call, which reports
what it converted and what it left and why (:class:`Fp8Report`):

- nnx: :func:`use_fp8_dot_general` swaps, in place, the ``dot_general`` of every ``nnx.Linear`` and
  ``nnx.LinearGeneral`` (those inside ``nnx.MultiHeadAttention`` included) and the ``einsum_op`` of
  every ``nnx.Einsum``.
- linen: :func:`fp8_model` wraps a module (``.init`` / ``.apply`` as the module's), and
  :func:`fp8_autocast` is the context manager under which it runs: a ``flax.linen.intercept_methods``
  interceptor gives ``nn.Dense``, ``nn.DenseGeneral`` (those inside ``nn.MultiHeadDotProductAttention``
  included, which their attention builds with ``dot_general=None``), ``nn.Einsum`` and
  ``nn.Embed.attend`` (a tied output head) ``fp8_dot_general`` as they are called.

Neither touches a parameter (same tree, same values: checkpoints load either way). The attention's
own products, q·k and p·v (``dot_product_attention``), multiply activations by activations: they are
not projections and stay in bf16 (the report says so). ``where="auto"`` (every function here) keeps in
bf16 the calls whose shapes were measured not to gain from FP8 on this GPU (:mod:`jax_fp8.gemm.crossover`).

Fused layers (:mod:`jax_fp8.fused`: quantization fused into the norm and the activation that produce
each operand): :class:`RMSNormDense` and :class:`RMSNormMLP`, linen modules whose parameters keep the
names of the ``nn.RMSNorm`` / ``nn.Dense`` they replace (module ``fused``, which imports flax on first use).

The modules, from the top down: ``linen_model`` (:func:`fp8_model`, :class:`Fp8Model`), ``linen``
(:func:`fp8_autocast` and its interceptor), ``linen_calls`` (``nn.Einsum`` / ``nn.Embed.attend``
computed with a ``dot_general``), ``nnx`` (:func:`use_fp8_dot_general`), ``report`` (:class:`Fp8Report`,
:class:`Layer`), ``dot_general`` (:func:`fp8_dot_general_for`, ``where`` resolution).
"""
from .dot_general import fp8_dot_general_for
from .linen import fp8_autocast
from .linen_model import Fp8Model, fp8_model
from .nnx import use_fp8_dot_general
from .report import Fp8Report, Layer

_LAZY = {"RMSNormDense", "RMSNormMLP"}  # in .fused, which imports flax when loaded


def __getattr__(name: str):
    if name in _LAZY:
        from . import fused
        return getattr(fused, name)
    raise AttributeError(f"module 'jax_fp8.flax_utils' has no attribute {name!r}")


__all__ = ["RMSNormDense", "RMSNormMLP", "use_fp8_dot_general", "fp8_dot_general_for", "fp8_model", "fp8_autocast", "Fp8Model", "Fp8Report",
           "Layer"]
