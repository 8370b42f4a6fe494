"""Flax helpers for :func:`jax_fp8.fp8_dot_general` (need flax; ``import jax_fp8`` never imports this).

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
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import Counter
from functools import partial
from typing import Any, Callable, Iterator, Optional, Union

import jax.numpy as jnp
from jax import lax

from ..gemm.crossover import layer_pays
from ..gemm import RECIPES, Float8BlockScaling, MXFP8BlockScaling, fp8_dot_general
from ..warn import warn

__all__ = ["use_fp8_dot_general", "fp8_dot_general_for", "fp8_model", "fp8_autocast", "Fp8Model", "Fp8Report",
           "Layer"]

#: ``where`` values that pick layers by measurement ("auto") or take all of them ("all").
WHERE = ("all", "auto")

Recipe = Optional[Union[Float8BlockScaling, MXFP8BlockScaling]]
#: ``where``: None / "all", "auto", or ``where(path, layer) -> bool``
Where = Optional[Union[str, Callable[[tuple, Any], bool]]]

logger = logging.getLogger("jax_fp8")

_OURS = "_jax_fp8_dot_general"  # marks the dot_generals made here (re-converting a layer rebinds them)
_IN_FLIGHT = "_jax_fp8_in_flight"  # marks the linen interceptor's per-call wrapper (see _LinenConverter)


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


def _name(obj: Any) -> str:
    if isinstance(obj, partial):
        return f"partial({_name(obj.func)})"
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _where(where: Where, caller: str) -> tuple[Optional[Callable], str]:
    """``(pick, mode)``: the callable that picks layers (None: all of them) and the dot_general's mode."""
    if where is None or (isinstance(where, str) and where in WHERE):
        return None, "auto" if where == "auto" else "all"
    if callable(where):
        return where, "all"
    raise ValueError(f"{caller}: where must be None, 'all', 'auto' or a callable (path, layer) -> bool, got {where!r}")


# ---- the report ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer the conversion saw: its ``path`` (attribute names / indices for nnx, the scope's names
    for linen: its parameters' path), its ``kind`` (e.g. ``"nn.DenseGeneral"``) and, for a layer left
    as it was, the ``reason``."""

    path: tuple
    kind: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{_path_str(self.path)} ({self.kind})" + (f": {self.reason}" if self.reason else "")


def _path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path) or "<the model itself>"


@dataclasses.dataclass(eq=False)
class Fp8Report:
    """What a conversion did: the layers now on ``fp8_dot_general`` (``converted``), those left as
    they were with the reason (``left``), and the attention layers whose q·k and p·v products stay in
    bf16 (``attention``: activation-by-activation products, not projections; their q/k/v/out
    projections are layers of their own). ``print(report)`` shows a summary.

    For compatibility with :func:`use_fp8_dot_general`'s former list of paths, the report is also a
    sequence of the converted layers' paths (``len``, iteration, indexing, ``==`` with a list).

    A linen report fills as the model is traced (``init``, ``apply``, each ``jit`` trace): it lists
    each layer once, by the path of its parameters; a layer under ``nn.scan`` counts once for its
    stacked parameters.
    """

    converted: list[Layer] = dataclasses.field(default_factory=list)
    left: list[Layer] = dataclasses.field(default_factory=list)
    attention: list[tuple] = dataclasses.field(default_factory=list)
    recipe: str = "Float8BlockScaling"
    where: str = "all"
    _seen: set = dataclasses.field(default_factory=set, repr=False)  # the paths in converted and left

    @property
    def paths(self) -> list[tuple]:
        """The converted layers' paths."""
        return [layer.path for layer in self.converted]

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.converted)

    def __getitem__(self, i):
        return self.paths[i]

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Fp8Report):
            fields = ("converted", "left", "attention", "recipe", "where")
            return all(getattr(self, f) == getattr(other, f) for f in fields)
        if isinstance(other, (list, tuple)):
            return self.paths == list(other)
        return NotImplemented

    __hash__ = None  # mutable (a linen report fills as the model is traced)

    def _add(self, layer: Layer, converted: bool) -> None:
        if layer.path not in self._seen:  # a layer traced again (init then apply, each jit trace): once
            self._seen.add(layer.path)
            (self.converted if converted else self.left).append(layer)

    def _add_attention(self, path: tuple) -> None:
        if path not in self.attention:
            self.attention.append(path)

    def __str__(self) -> str:
        kinds = Counter(layer.kind for layer in self.converted)
        lines = [f"jax_fp8: {len(self.converted)} layer{'s' if len(self.converted) != 1 else ''} on fp8_dot_general, "
                 f"{len(self.left)} left as they were (recipe {self.recipe}, where={self.where})"]
        if self.where == "auto":
            lines.append("  where='auto': each call runs in FP8 where this GPU's crossover table says it pays, "
                         "else as lax.dot_general")
        if kinds:
            lines.append("  on FP8: " + ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()))
        lines += [f"  left: {layer}" for layer in self.left]
        if self.attention:
            shown = ", ".join(_path_str(p) for p in self.attention[:3]) + (", ..." if len(self.attention) > 3 else "")
            lines.append(f"  kept in bf16: the q·k and p·v products of {len(self.attention)} attention layer"
                         f"{'s' if len(self.attention) != 1 else ''} ({shown}): activations by activations, "
                         "not projections")
        return "\n".join(lines)


def _new_report(recipe: Recipe, where: Where) -> Fp8Report:
    shown = "auto" if where == "auto" else "all" if where in (None, "all") else "a callable"
    return Fp8Report(recipe=type(recipe or Float8BlockScaling()).__name__, where=shown)


def _dot_general_like(attrs: dict, modules: tuple) -> list[str]:
    """The names in ``attrs`` of hooks like a ``dot_general`` or an einsum: callables (not None, not an
    einsum string) other than submodules (instances of ``modules``)."""
    return sorted(k for k, v in attrs.items() if not k.startswith("_") and ("dot_general" in k or "einsum" in k)
                  and callable(v) and not isinstance(v, modules))


def _unknown_reason(kind: str, fields: list[str]) -> str:
    return (f"a {kind} with {', '.join(fields)}, a type jax_fp8.flax_utils does not know: if it computes a "
            "projection, set that to jax_fp8.flax_utils.fp8_dot_general_for(...) yourself")


# ---- nnx ----------------------------------------------------------------------------------------
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
            if cls is not None:
                report._add(Layer(path, kind, f"has its own dot_general_cls ({_name(cls)})"), False)
            elif current is not None and current is not lax.dot_general and not _is_fp8(current):
                report._add(Layer(path, kind, f"has its own dot_general ({_name(current)})"), False)
            elif pick is not None and not pick(path, node):
                report._add(Layer(path, kind, "excluded by where"), False)
            else:
                node.dot_general = dot_general
                report._add(Layer(path, kind), True)
        elif isinstance(node, nnx.Einsum):
            current = node.einsum_op
            if current is not jnp.einsum and not _is_fp8_einsum(current):
                report._add(Layer(path, kind, f"has its own einsum_op ({_name(current)})"), False)
            elif pick is not None and not pick(path, node):
                report._add(Layer(path, kind, "excluded by where"), False)
            else:
                node.einsum_op = einsum_op
                report._add(Layer(path, kind), True)
        elif isinstance(node, nnx.Module):
            fields = _dot_general_like(vars(node), (nnx.Module, nn.Module))
            if fields:
                report._add(Layer(path, kind, _unknown_reason(kind, fields)), False)
    if log:
        logger.info("%s", report)
    return report


# ---- linen --------------------------------------------------------------------------------------
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


class _LinenConverter:
    """The ``nn.intercept_methods`` interceptor of :func:`fp8_autocast`.

    ``Dense`` / ``DenseGeneral``: the module's ``dot_general`` is set, for the duration of its own call,
    to (a call-counting wrapper of) the FP8 one and flax's ``__call__`` runs as it is; the module object
    is the one this ``init`` / ``apply`` bound, so nothing outlives the call. The lifted copies that
    ``nn.remat`` / ``nn.scan`` make during the call carry the wrapper and are let through.
    ``Einsum`` and ``Embed.attend`` have no ``dot_general`` field: their call is computed here with it
    (``_linen_einsum``, ``_linen_attend``), so interceptors entered inside this one do not see them.
    """

    def __init__(self, dot_general: Callable, pick: Optional[Callable], report: Fp8Report):
        from flax import linen as nn

        self.nn, self.dot_general, self.pick, self.report = nn, dot_general, pick, report
        self.calls = 0  # the module methods intercepted

    def __call__(self, next_fun, args, kwargs, context):
        nn, module, method = self.nn, context.module, context.method_name
        self.calls += 1
        scope = getattr(module, "scope", None)
        if scope is None:  # an unbound module's method: nothing to convert
            return next_fun(*args, **kwargs)
        path = tuple(scope.path)
        kind = f"nn.{type(module).__name__}"
        if isinstance(module, (nn.Dense, nn.DenseGeneral)) and method == "__call__":
            return self._dense(module, path, kind, next_fun, args, kwargs)
        if isinstance(module, nn.Einsum) and method == "__call__":
            return self._computed_here(_linen_einsum, module, path, kind, next_fun, args, kwargs)
        if isinstance(module, nn.Embed) and method == "attend":
            return self._computed_here(_linen_attend, module, path, f"{kind}.attend", next_fun, args, kwargs)
        if isinstance(module, nn.MultiHeadDotProductAttention):
            if method == "__call__":
                self.report._add_attention(path)  # q/k/v/out: DenseGenerals, intercepted on their own
        elif method == "__call__":
            fields = _dot_general_like({f.name: getattr(module, f.name, None) for f in dataclasses.fields(module)},
                                       (nn.Module,))
            if fields:
                self.report._add(Layer(path, kind, _unknown_reason(kind, fields)), False)
        return next_fun(*args, **kwargs)

    def _excluded(self, module, path: tuple, kind: str) -> bool:
        if self.pick is not None and not self.pick(path, module):
            self.report._add(Layer(path, kind, "excluded by where"), False)
            return True
        return False

    def _dense(self, module, path, kind, next_fun, args, kwargs):
        current = module.dot_general
        if getattr(current, _IN_FLIGHT, False):  # a lifted copy made inside our own call of this layer
            return next_fun(*args, **kwargs)
        if module.dot_general_cls is not None:
            self.report._add(Layer(path, kind, f"has its own dot_general_cls ({_name(module.dot_general_cls)})"), False)
            return next_fun(*args, **kwargs)
        if current is not None and current is not lax.dot_general and not _is_fp8(current):
            self.report._add(Layer(path, kind, f"has its own dot_general ({_name(current)})"), False)
            return next_fun(*args, **kwargs)
        if self._excluded(module, path, kind):
            return next_fun(*args, **kwargs)
        calls: list = []
        # A linen module is a frozen dataclass: its field is set around the call and put back after it.
        object.__setattr__(module, "dot_general", _in_flight(self.dot_general, calls))
        try:
            out = next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "dot_general", current)
        self._record(path, kind, calls)
        return out

    def _computed_here(self, fn, module, path, kind, next_fun, args, kwargs):
        if self._excluded(module, path, kind):
            return next_fun(*args, **kwargs)
        calls: list = []
        out = fn(module, _in_flight(self.dot_general, calls), *args, **kwargs)
        self._record(path, kind, calls)
        return out

    def _record(self, path, kind, calls) -> None:
        if calls:
            self.report._add(Layer(path, kind), True)
        else:
            self.report._add(Layer(path, kind, "its call never reached dot_general (a subclass computing its "
                                               "product another way?)"), False)


@contextlib.contextmanager
def fp8_autocast(recipe: Recipe = None, *, where: Where = None, report: Optional[Fp8Report] = None,
                 log: bool = False) -> Iterator[Fp8Report]:
    """Within this context, every flax.linen projection *traced* runs on :func:`jax_fp8.fp8_dot_general`:
    ``nn.Dense`` and ``nn.DenseGeneral`` (the query/key/value/out inside
    ``nn.MultiHeadDotProductAttention`` included), ``nn.Einsum`` and ``nn.Embed.attend``. Parameters
    are untouched (same tree, same values). Yields an :class:`Fp8Report` that fills as modules are
    traced::

        with fp8_autocast() as report:
            variables = model.init(key, x)
            loss, grads = jax.jit(jax.value_and_grad(loss_fn))(variables, x)   # traced here
        print(report)

    The interceptor acts when a module's method is *traced*: a function jitted and traced outside the
    context keeps what it traced (jit's cache does not know the context; a context in which no module
    was traced warns so). Trace inside it, or use :func:`fp8_model`, whose ``init`` / ``apply`` enter it
    themselves. ``nn.jit``, ``nn.remat``,
    ``nn.scan``, ``nn.vmap`` and ``jax.grad`` / ``jax.jit`` around ``apply`` all trace inside.

    Layers left as they were, listed in the report with the reason: one with its own ``dot_general``
    or ``dot_general_cls`` (``fp8_dot_general`` itself is replaced, rebinding ``recipe``), one ``where``
    excludes, a module of another type with a ``dot_general``-like field, a layer whose call never
    reached its ``dot_general``. The attention's q·k and p·v products stay in bf16.

    Args:
      recipe: as :func:`use_fp8_dot_general`'s.
      where: None / ``"all"``, ``"auto"`` or ``where(path, module) -> bool``, as
        :func:`use_fp8_dot_general`'s; ``path`` is the module's scope path (its parameters' path), e.g.
        ``("decoder", "logitdense")``.
      report: an :class:`Fp8Report` to add to (default: a new one).
      log: log the report when the context exits (logger ``"jax_fp8"``, level INFO).
    """
    with _autocast(recipe, where, report, "fp8_autocast") as (report, converter):
        yield report
    if not converter.calls:
        warn("fp8_autocast: no flax.linen module was traced inside the context, so nothing ran on FP8 "
             "(a function jitted and traced before it keeps what it traced: trace it inside, or use "
             "jax_fp8.flax_utils.fp8_model(module).apply)")
    if log:
        logger.info("%s", report)


@contextlib.contextmanager
def _autocast(recipe: Recipe, where: Where, report: Optional[Fp8Report], caller: str):
    from flax import linen as nn

    _check_recipe(recipe, caller)
    pick, mode = _where(where, caller)
    report = _new_report(recipe, where) if report is None else report
    converter = _LinenConverter(fp8_dot_general_for(recipe, mode), pick, report)
    with nn.intercept_methods(converter):
        yield report, converter


class Fp8Model:
    """A flax.linen module whose ``init``, ``apply`` and ``init_with_output`` run under
    :func:`fp8_autocast` (made by :func:`fp8_model`). Takes what the module's take and returns what
    they return; other attributes are the module's. ``report`` is the :class:`Fp8Report` of every trace
    so far."""

    def __init__(self, module: Any, recipe: Recipe, where: Where, log: bool):
        self.module, self.recipe, self.where, self.log = module, recipe, where, log
        self.report = _new_report(recipe, where)

    def _run(self, fn: Callable, args, kwargs):
        before = (len(self.report.converted), len(self.report.left))
        with _autocast(self.recipe, self.where, self.report, "fp8_model"):
            out = fn(*args, **kwargs)
        if self.log and (len(self.report.converted), len(self.report.left)) != before:
            logger.info("%s", self.report)
        return out

    def init(self, *args, **kwargs):
        """``module.init(*args, **kwargs)`` on FP8 (the same parameters as the module's own ``init``)."""
        return self._run(self.module.init, args, kwargs)

    def init_with_output(self, *args, **kwargs):
        """``module.init_with_output(*args, **kwargs)`` on FP8."""
        return self._run(self.module.init_with_output, args, kwargs)

    def apply(self, *args, **kwargs):
        """``module.apply(*args, **kwargs)`` on FP8."""
        return self._run(self.module.apply, args, kwargs)

    def __getattr__(self, name: str):
        if name == "module":  # not set yet (e.g. while unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"Fp8Model({self.module!r}, recipe={self.report.recipe}, where={self.report.where})"


def fp8_model(module: Any, recipe: Recipe = None, *, where: Where = None, log: bool = False) -> Fp8Model:
    """A flax.linen ``module`` (an existing model, unchanged) whose every projection runs on
    :func:`jax_fp8.fp8_dot_general`: the returned :class:`Fp8Model`'s ``init`` / ``apply`` are the
    module's under :func:`fp8_autocast` (which says what is converted), e.g.::

        fp8 = fp8_model(TransformerLM(config))
        variables = fp8.init(key, tokens)                  # the same tree as TransformerLM's own init
        state = TrainState.create(apply_fn=fp8.apply, params=variables["params"], tx=optax.adamw(1e-3))
        ...                                                # jit, grad, a mesh: as in bf16
        print(fp8.report)                                  # 13 layers on fp8_dot_general, ...

    Args:
      module: a ``flax.linen.Module``.
      recipe, where: as :func:`use_fp8_dot_general`'s; ``where(path, module)`` gets the module's scope
        path (its parameters' path).
      log: log the report each time a trace adds to it (logger ``"jax_fp8"``, level INFO).
    """
    from flax import linen as nn
    from flax import nnx

    if isinstance(module, nnx.Module):
        raise TypeError("fp8_model: module must be a flax.linen.Module, got the nnx module "
                        f"{type(module).__name__}: for nnx use jax_fp8.flax_utils.use_fp8_dot_general(model)")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fp8_model: module must be a flax.linen.Module, got {type(module).__name__}")
    _check_recipe(recipe, "fp8_model")
    _where(where, "fp8_model")
    return Fp8Model(module, recipe, where, log)
