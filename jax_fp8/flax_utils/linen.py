"""flax.linen: :func:`fp8_autocast`, the context under which every projection traced runs on the FP8
GEMM, and its ``nn.intercept_methods`` interceptor (``_LinenConverter``)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

from jax import lax

from ..warn import warn
from .dot_general import Recipe, Where, _check_recipe, _is_fp8, _where, fp8_dot_general_for
from .linen_calls import _IN_FLIGHT, _in_flight, _linen_attend, _linen_einsum
from .report import Fp8Report, Layer, _dot_general_like, _name, _new_report, _unknown_reason, logger


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
