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
``dot_general`` of every ``nnx.Linear`` in place. ``where="auto"`` (either function) keeps in bf16 the
calls whose shapes were measured not to gain from FP8 on this GPU (:mod:`jax_fp8.crossover`).
"""
from __future__ import annotations

import functools
from functools import partial
from typing import Any, Callable, Optional

from jax import lax

from .crossover import layer_pays
from .gemm import RECIPES, Float8BlockScaling, MXFP8BlockScaling, fp8_dot_general

__all__ = ["use_fp8_dot_general", "fp8_dot_general_for"]


#: ``where`` values that pick layers by measurement ("auto") or take all of them ("all").
WHERE = ("all", "auto")


def fp8_dot_general_for(recipe: Optional[Float8BlockScaling | MXFP8BlockScaling] = None, where: str = "all"
                        ) -> Callable:
    """``fp8_dot_general`` bound to ``recipe`` (default: :class:`Float8BlockScaling`()), as a ``dot_general``
    for Flax layers, e.g. ``Float8BlockScaling(grad_dtype=jnp.float8_e5m2)`` for E5M2 gradients.

    ``where="auto"``: FP8 only where it pays: each call asks :func:`jax_fp8.crossover.layer_pays` (when
    traced) whether a linear layer of its shapes ran faster in FP8 than in bf16 on this GPU, and calls
    ``lax.dot_general`` with the same arguments where it did not. ``"all"`` (the default): every call on
    ``fp8_dot_general``."""
    if recipe is not None and not isinstance(recipe, RECIPES):
        raise TypeError(f"fp8_dot_general_for: recipe must be a jax_fp8.Float8BlockScaling or MXFP8BlockScaling, "
                        f"got {recipe!r}")
    if where not in WHERE:
        raise ValueError(f"fp8_dot_general_for: where must be 'all' or 'auto', got {where!r}")
    dot = fp8_dot_general if recipe is None else partial(fp8_dot_general, recipe=recipe)
    if where == "all":
        return dot

    @functools.wraps(fp8_dot_general)
    def auto_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        if layer_pays(lhs, rhs, dimension_numbers, recipe):
            return dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kw)
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kw)

    return auto_dot_general


def use_fp8_dot_general(model: Any, recipe: Optional[Float8BlockScaling | MXFP8BlockScaling] = None, *,
                        where: Optional[str | Callable[[tuple, Any], bool]] = None) -> list[tuple]:
    """Put every ``flax.nnx.Linear`` of ``model`` on the FP8 GEMM, in place: sets its ``dot_general`` to
    :func:`jax_fp8.fp8_dot_general` (bound to ``recipe`` when given). Parameters are untouched.

    Args:
      model: an ``nnx.Module`` (any graph of them).
      recipe: a :class:`jax_fp8.Float8BlockScaling` or :class:`jax_fp8.MXFP8BlockScaling`, or None for the
        default recipe (Float8 blockwise).
      where: which layers change. None or ``"all"``: all of them. ``"auto"``: all of them, each call then
        running in FP8 only where a layer of its shapes was measured faster in FP8 than in bf16 on this
        GPU (:func:`fp8_dot_general_for`, :mod:`jax_fp8.crossover`), else as ``lax.dot_general``. A
        callable ``where(path, linear) -> bool`` picks them (e.g. to keep an output head in bf16:
        ``where=lambda path, m: "lm_head" not in path``).

    Returns the paths (tuples of attribute names / indices) of the layers it changed.
    """
    from flax import nnx  # flax is an optional dependency: only this function needs it

    if not isinstance(model, nnx.Module):
        raise TypeError(f"use_fp8_dot_general: model must be a flax.nnx.Module, got {type(model).__name__} "
                        "(for flax.linen, pass dot_general=jax_fp8.fp8_dot_general to nn.Dense)")
    if where is not None and not callable(where) and where not in WHERE:
        raise ValueError(f"use_fp8_dot_general: where must be None, 'all', 'auto' or a callable (path, linear) -> "
                         f"bool, got {where!r}")
    pick = where if callable(where) else None
    dot_general = fp8_dot_general_for(recipe, "auto" if where == "auto" else "all")
    changed = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and (pick is None or pick(tuple(path), node)):
            node.dot_general = dot_general
            changed.append(tuple(path))
    return changed
