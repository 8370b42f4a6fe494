"""What a conversion reports: :class:`Fp8Report` (the layers converted, those left and why, the
attention kept in bf16) of :class:`Layer` entries, and the reasons given for a layer left as it was."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from functools import partial
from typing import Any, Iterator

from ..gemm import Float8BlockScaling
from .dot_general import Recipe, Where

logger = logging.getLogger("jax_fp8")


def _name(obj: Any) -> str:
    if isinstance(obj, partial):
        return f"partial({_name(obj.func)})"
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


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
