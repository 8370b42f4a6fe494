"""flax.linen: :func:`fp8_model` wraps a module so that its ``init`` / ``apply`` run under
:func:`~jax_fp8.flax_utils.linen.fp8_autocast` (:class:`Fp8Model`)."""
from __future__ import annotations

from typing import Any, Callable

from .dot_general import Recipe, Where, _check_recipe, _where
from .linen import _autocast
from .report import _new_report, logger


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
