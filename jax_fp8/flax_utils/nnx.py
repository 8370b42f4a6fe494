"""nnx: :func:`use_fp8_dot_general` puts an ``nnx`` model's projections on the FP8 GEMM, in place."""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax

from .dot_general import Recipe, Where, _check_recipe, _is_fp8, _is_fp8_einsum, _where, fp8_dot_general_for
from .report import Fp8Report, Layer, _dot_general_like, _name, _new_report, _unknown_reason, logger


def _convert(report: Fp8Report, node, path: tuple, kind: str, why: Optional[str], pick, attr: str, value) -> None:
    """Set ``node.<attr>`` to our ``value`` unless ``why`` (it has its own) or ``where`` excludes it; report it."""
    if why is None and pick is not None and not pick(path, node):
        why = "excluded by where"
    if why is None:
        setattr(node, attr, value)
    report._add(Layer(path, kind, why or ""), why is None)


def use_fp8_dot_general(model: Any, recipe: Recipe = None, *, where: Where = None, log: bool = False) -> Fp8Report:
    """Put every projection of an ``nnx`` model on the FP8 GEMM, in place: the ``dot_general`` of each
    ``nnx.Linear`` and ``nnx.LinearGeneral`` (the query/key/value/out of ``nnx.MultiHeadAttention``
    included) becomes :func:`jax_fp8.fp8_dot_general` (bound to ``recipe`` when given), the
    ``einsum_op`` of each ``nnx.Einsum`` ``jnp.einsum`` on it. Parameters are untouched.

    Left as they were, and listed in the report with the reason: a layer that has its own
    ``dot_general`` / ``dot_general_cls`` / ``einsum_op`` (one made here is replaced: calling this
    again rebinds ``recipe`` and ``where``), one ``where`` excludes, and a module of a type not known
    here that has a ``dot_general``-like attribute. The q·k and p·v products of attention layers stay
    in bf16 (``report.attention``).

    Args:
      model: an ``nnx.Module`` (any graph of them).
      recipe: a :class:`jax_fp8.Float8BlockScaling` or :class:`jax_fp8.MXFP8BlockScaling`, or None for the
        default recipe (Float8 blockwise).
      where: which layers change. None or ``"all"``: all of them. ``"auto"``: all of them, each call then
        running in FP8 only where a layer of its shapes was measured faster in FP8 than in bf16 on this
        GPU (:func:`fp8_dot_general_for`, :mod:`jax_fp8.gemm.crossover`), else as ``lax.dot_general``. A
        callable ``where(path, layer) -> bool`` picks them (e.g. to keep an output head in bf16:
        ``where=lambda path, m: "lm_head" not in path``).
      log: also log the report (logger ``"jax_fp8"``, level INFO).

    Returns an :class:`Fp8Report`, which is also the list of the converted layers' paths (what this
    function returned before it reported).
    """
    from flax import linen as nn  # flax is an optional dependency: imported where it is used
    from flax import nnx

    if isinstance(model, nn.Module):
        raise TypeError("use_fp8_dot_general: model must be a flax.nnx.Module, got the linen module "
                        f"{type(model).__name__}: for flax.linen use jax_fp8.flax_utils.fp8_model(module) "
                        "or `with jax_fp8.flax_utils.fp8_autocast(): ...`")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"use_fp8_dot_general: model must be a flax.nnx.Module, got {type(model).__name__}")
    _check_recipe(recipe, "use_fp8_dot_general")
    pick, mode = _where(where, "use_fp8_dot_general")
    dot_general = fp8_dot_general_for(recipe, mode)
    einsum_op = partial(jnp.einsum, _dot_general=dot_general)
    report = _new_report(recipe, where)
    for path, node in nnx.iter_graph(model):
        path = tuple(path)
        kind = f"nnx.{type(node).__name__}"
        if isinstance(node, nnx.MultiHeadAttention):
            report._add_attention(path)  # its projections are LinearGenerals of their own, met below
        elif isinstance(node, (nnx.Linear, nnx.LinearGeneral)):
            current, cls = node.dot_general, getattr(node, "dot_general_cls", None)
            why = None
            if cls is not None:
                why = f"has its own dot_general_cls ({_name(cls)})"
            elif current is not None and current is not lax.dot_general and not _is_fp8(current):
                why = f"has its own dot_general ({_name(current)})"
            _convert(report, node, path, kind, why, pick, "dot_general", dot_general)
        elif isinstance(node, nnx.Einsum):
            current = node.einsum_op
            why = (f"has its own einsum_op ({_name(current)})"
                   if current is not jnp.einsum and not _is_fp8_einsum(current) else None)
            _convert(report, node, path, kind, why, pick, "einsum_op", einsum_op)
        elif isinstance(node, nnx.Module):
            fields = _dot_general_like(vars(node), (nnx.Module, nn.Module))
            if fields:
                report._add(Layer(path, kind, _unknown_reason(kind, fields)), False)
    if log:
        logger.info("%s", report)
    return report
