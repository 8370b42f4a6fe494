"""Flax helpers for :func:`jax_fp8.fp8_dot_general` (needs flax; ``import jax_fp8`` never imports this).

``fp8_dot_general`` has ``lax.dot_general``'s signature, so one argument puts a Flax layer on the FP8
GEMM, with no other change to the model::

    flax.nnx.Linear(d_in, d_out, dot_general=jf.fp8_dot_general, rngs=rngs)
    flax.linen.Dense(d_out, dot_general=jf.fp8_dot_general)

Float8 blockwise scaling keeps no state: every call computes its scales from the operands (1x128
blocks for activations and gradients, 128x128 tiles for weights). There are no amax histories or
scale variables, so none of flax's FP8 meta machinery (the ``_overwrite_with_gradient`` collection)
is involved: parameters, optimizer and train step stay as they are in bf16.

For an existing ``nnx`` model (one built by someone else's code), :func:`use_fp8_dot_general` swaps the
``dot_general`` of every ``nnx.Linear`` in place.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

from .gemm import RECIPES, Float8BlockScaling, MXFP8BlockScaling, fp8_dot_general

__all__ = ["use_fp8_dot_general", "fp8_dot_general_for"]


def fp8_dot_general_for(recipe: Optional[Float8BlockScaling | MXFP8BlockScaling] = None) -> Callable:
    """``fp8_dot_general`` bound to ``recipe`` (default: :class:`Float8BlockScaling`()), as a ``dot_general``
    for Flax layers, e.g. ``Float8BlockScaling(grad_dtype=jnp.float8_e5m2)`` for E5M2 gradients."""
    if recipe is None:
        return fp8_dot_general
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"fp8_dot_general_for: recipe must be a jax_fp8.Float8BlockScaling or MXFP8BlockScaling, "
                        f"got {recipe!r}")
    return partial(fp8_dot_general, recipe=recipe)


def use_fp8_dot_general(model: Any, recipe: Optional[Float8BlockScaling | MXFP8BlockScaling] = None, *,
                        where: Optional[Callable[[tuple, Any], bool]] = None) -> list[tuple]:
    """Put every ``flax.nnx.Linear`` of ``model`` on the FP8 GEMM, in place: sets its ``dot_general`` to
    :func:`jax_fp8.fp8_dot_general` (bound to ``recipe`` when given). Parameters are untouched.

    Args:
      model: an ``nnx.Module`` (any graph of them).
      recipe: a :class:`jax_fp8.Float8BlockScaling` or :class:`jax_fp8.MXFP8BlockScaling`, or None for the
        default recipe (Float8 blockwise).
      where: ``where(path, linear) -> bool`` picks which layers change (e.g. to keep an output head in
        bf16: ``where=lambda path, m: "lm_head" not in path``); default: all of them.

    Returns the paths (tuples of attribute names / indices) of the layers it changed.
    """
    from flax import nnx  # flax is an optional dependency: only this function needs it

    if not isinstance(model, nnx.Module):
        raise TypeError(f"use_fp8_dot_general: model must be a flax.nnx.Module, got {type(model).__name__} "
                        "(for flax.linen, pass dot_general=jax_fp8.fp8_dot_general to nn.Dense)")
    dot_general = fp8_dot_general_for(recipe)
    changed = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and (where is None or where(tuple(path), node)):
            node.dot_general = dot_general
            changed.append(tuple(path))
    return changed
