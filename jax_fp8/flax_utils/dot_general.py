"""The FP8 ``dot_general`` for a recipe and a ``where=`` choice (:func:`fp8_dot_general_for`), how
``where`` resolves, and how a ``dot_general`` made here is recognised (converting again rebinds it)."""
from __future__ import annotations

import functools
from functools import partial
from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
from jax import lax

from ..gemm.crossover import layer_pays
from ..gemm import RECIPES, Float8BlockScaling, MXFP8BlockScaling, fp8_dot_general

#: ``where`` values that pick layers by measurement ("auto") or take all of them ("all").
WHERE = ("all", "auto")

Recipe = Optional[Union[Float8BlockScaling, MXFP8BlockScaling]]
#: ``where``: None / "all", "auto", or ``where(path, layer) -> bool``
Where = Optional[Union[str, Callable[[tuple, Any], bool]]]

_OURS = "_jax_fp8_dot_general"  # marks the dot_generals made here (re-converting a layer rebinds them)


def _check_recipe(recipe: Recipe, caller: str) -> None:
    if recipe is not None and not isinstance(recipe, RECIPES):
        raise TypeError(f"{caller}: recipe must be a jax_fp8.Float8BlockScaling or MXFP8BlockScaling, got {recipe!r}")


def fp8_dot_general_for(recipe: Recipe = None, where: str = "all") -> Callable:
    """``fp8_dot_general`` bound to ``recipe`` (default: :class:`Float8BlockScaling`()), as a ``dot_general``
    for Flax layers, e.g. ``Float8BlockScaling(grad_dtype=jnp.float8_e5m2)`` for E5M2 gradients.

    ``where="auto"``: FP8 only where it pays: each call asks :func:`jax_fp8.gemm.crossover.layer_pays` (when
    traced) whether a linear layer of its shapes ran faster in FP8 than in bf16 on this GPU, and calls
    ``lax.dot_general`` with the same arguments where it did not. ``"all"`` (the default): every call on
    ``fp8_dot_general``."""
    _check_recipe(recipe, "fp8_dot_general_for")
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

    setattr(auto_dot_general, _OURS, True)
    return auto_dot_general


def _is_fp8(fn: Any) -> bool:
    """Whether ``fn`` is ``fp8_dot_general`` or one made from it here (any recipe, any ``where``)."""
    return fn is fp8_dot_general or getattr(fn, _OURS, False) or (
        isinstance(fn, partial) and fn.func is fp8_dot_general)


def _is_fp8_einsum(op: Any) -> bool:
    return isinstance(op, partial) and op.func is jnp.einsum and _is_fp8(op.keywords.get("_dot_general"))


def _where(where: Where, caller: str) -> tuple[Optional[Callable], str]:
    """``(pick, mode)``: the callable that picks layers (None: all of them) and the dot_general's mode."""
    if where is None or (isinstance(where, str) and where in WHERE):
        return None, "auto" if where == "auto" else "all"
    if callable(where):
        return where, "all"
    raise ValueError(f"{caller}: where must be None, 'all', 'auto' or a callable (path, layer) -> bool, got {where!r}")
