"""How the primitives split under ``jax.jit`` over a mesh: sharded operands, no ``shard_map``.

Without a rule, XLA runs a custom call whole on every device: it gathers every operand to each one.
So each primitive with a partitioning rule is registered as a pair (:mod:`.partitioned`'s
:func:`~.partitioned.partitioned_primitive`, which applies the rule this module defines):
the primitive the API binds (abstract eval, batching), whose lowering is a
``jax.experimental.custom_partitioning`` of its local twin (``<name>_local``: the same arguments,
lowered to our FFI kernel or the reference), which is what each device runs on its shard.

The partitioner consults a primitive twice. While it propagates shardings it reads a Shardy rule
(:func:`sdy_rule`): which dims of the operands and results are one dimension of the op, a scale
grid's coarse dim (one entry per block) being a compound factor of its data's dim. Then it calls back
with the operands' shardings and :func:`choose_sharding` decides, per dim of the op: it stays sharded
when each shard holds whole blocks and every array's local shape tiles its global one (padded GEMM-ready scales
included); otherwise its mesh axes are dropped, XLA gathers that dim alone, and one warning says
which and why. A mesh axis that would shard two dims of one op stays on the first in the rule's
order (a GEMM keeps M, the activations' rows, and gathers the weight). A contracted dim that stays
sharded gives local partial products and a ``psum``.

Under a mesh with ``AxisType.Explicit`` axes the operands' shardings are known while tracing: the
same choice types the results (``jax.typeof`` shows them). The callbacks decode the operands'
shardings themselves: Shardy may split a mesh axis between the parts of a compound factor, which no
PartitionSpec names; such an operand is read as replicated (the choice takes it whole).

No input makes a rule fail the compile: the Shardy rule is checked as jax will check it, and a rule
or choice that fails (a bug of ours) gives way to whole operands with a :class:`PartitioningRuleWarning`
(tests/test_sharded_sweep.py asserts none fires). :func:`rows_view` and :func:`pad_end` are the
reshape and pad of the ops' wrappers that an Explicit type cannot always carry a split through: they
gather that split, with a warning, where jax would raise.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from .._compat import ShapedArray
from ..warn import ShardingWarning, warn


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dim of an operand or result: the op dim it spans (``label``; None: its own, never split),
    its ``size``, ``block``: op-dim elements per entry (1 for data, 32 or 128 along a scale grid), and
    ``pad``: the entries are padded up to a multiple of it. A padded dim whose shards would not tile
    it is held whole: each device slices its own entries from an operand, and gathers a result's
    (a scale grid: a few bytes), while the data stay split."""

    label: Optional[str]
    size: int
    block: int = 1
    pad: int = 1  # entries rounded up to a multiple of this (GEMM-ready scales: 4)


Axes = tuple  # tuple[str, ...]: the mesh axes that split one dim, major first


@dataclasses.dataclass(frozen=True)
class Rule:
    """How a primitive partitions.

    - ``labels``: its op dims, in precedence order (a mesh axis wanted by two stays on the first);
    - ``names``: each label in words, for warnings;
    - ``sizes(shapes, params)``: each op dim's size, from the operands' shapes;
    - ``arrays(sizes, params)``: the operands' and the results' :class:`Dim` layouts at these sizes
      (called with local sizes too: the shards' layouts);
    - ``why_not(label, local, sizes, params)``: why a shard of ``local`` entries along ``label`` cannot
      run (alignment beyond whole blocks), or None;
    - ``contracted``: labels whose split leaves partial results, summed (by default every result; a rule
      whose results keep some of these labels sums the others in its ``local``);
    - ``local(bind, reduce_axes, params)``: the per-device function, given the local twin's ``bind``
      (default: ``bind`` with ``params``);
    - ``pad_value``: what padded entries hold.
    """

    labels: tuple
    names: dict
    sizes: Callable
    arrays: Callable
    why_not: Callable = lambda label, local, sizes, params: None
    contracted: tuple = ()
    local: Optional[Callable] = None
    pad_value: float = 0.0


@dataclasses.dataclass(frozen=True)
class Whole:
    """A padded dim held whole (see :class:`Dim`): array ``index`` (operand or result), its ``dim``,
    the ``axes`` its op dim is split over, a shard's ``entries`` and its padded ``local`` size, and the
    padded global ``size``."""

    index: int
    dim: int
    axes: Axes
    entries: int
    local: int
    size: int


@dataclasses.dataclass(frozen=True)
class ShardingChoice:
    """What runs where: the specs the operands are taken in and the results come out in (per dim, a
    tuple of mesh axes or None), the axes to ``psum`` the local results over, the padded dims held
    whole (operands, results), and what was gathered, in words."""

    operands: list
    results: list
    reduce_axes: Axes
    whole_in: tuple
    whole_out: tuple
    gathered: list


def _axes(entry) -> Axes:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_axes(spec, ndim: int) -> tuple:
    """A PartitionSpec as one tuple of mesh axes per dim (empty: replicated)."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(_axes(e) for e in entries)


def _exact(d: Dim, sizes) -> bool:
    """The dim is exactly its op dim in blocks: no partial block, no padding."""
    s = sizes[d.label]
    return s % d.block == 0 and d.size * d.block == s


def _split_problem(rule, params, label, axes, mesh_sizes, sizes, arrays) -> Optional[str]:
    """Why ``label`` cannot be split over ``axes`` (None: it can)."""
    n = _shards(axes, mesh_sizes)
    s = sizes[label]
    if s % n:
        return f"its {s} entries do not split evenly over {n} shards"
    local = s // n
    local_arrays = rule.arrays({**sizes, label: local}, params)
    for g, loc in zip(itertools.chain(*arrays), itertools.chain(*local_arrays)):
        for gd, ld in zip(g, loc):
            if gd.label != label:
                continue
            if local % ld.block:
                return f"each shard's {local} is not a multiple of the {ld.block}-wide block"
            if ld.size * n != gd.size and gd.pad == 1:
                return f"a shard's padded layout ({ld.size} entries) does not tile the whole ({gd.size})"
    return rule.why_not(label, local, sizes, params)


def choose_sharding(rule: Rule, params: dict, mesh_sizes: dict, shapes, specs) -> ShardingChoice:
    """Decide which op dims stay split, given the operands' global ``shapes`` and ``specs`` (per dim, a
    tuple of mesh axes). A dim takes the axes of the first operand that splits it at full resolution."""
    sizes = rule.sizes(shapes, params)
    arrays = rule.arrays(sizes, params)
    operands, results = arrays
    chosen, used, gathered = {}, set(), []
    for label in rule.labels:
        want = next((axes for layout, spec in zip(operands, specs) for d, axes in zip(layout, spec)
                     if d.label == label and d.block == 1 and axes), ())
        if not want:
            continue
        free = tuple(a for a in want if a not in used)
        best, reason = (), None  # axes that another dim of the op holds are gathered as lax would: silently
        for i in range(len(free), 0, -1):  # the longest prefix that can be split
            problem = _split_problem(rule, params, label, free[:i], mesh_sizes, sizes, arrays)
            if problem is None:
                best = free[:i]
                break
            reason = reason or problem
        if best != free:
            gathered.append(f"{rule.names[label]} gathered over mesh axes {[a for a in free if a not in best]}: "
                            f"{reason}")
        chosen[label] = best
        used.update(best)  # axes dropped for alignment stay free: a later dim may take them

    local_arrays = rule.arrays({k: v // _shards(chosen.get(k, ()), mesh_sizes) for k, v in sizes.items()}, params)

    def whole(layouts, local_layouts):
        out = []
        for i, (g, loc) in enumerate(zip(layouts, local_layouts)):
            for j, (gd, ld) in enumerate(zip(g, loc)):
                axes = chosen.get(gd.label, ())
                if not axes:
                    continue
                n = _shards(axes, mesh_sizes)
                entries = sizes[gd.label] // n // gd.block
                # a shard's own padding (3 tiles padded to 4) sits mid-grid in the whole: not a tiling
                if ld.size != entries or ld.size * n != gd.size:
                    out.append(Whole(i, j, axes, entries, ld.size, gd.size))
        return tuple(out)

    def spec(i, layout, held):
        return [None if (i, j) in held else chosen.get(d.label) or None for j, d in enumerate(layout)]

    whole_in, whole_out = whole(operands, local_arrays[0]), whole(results, local_arrays[1])
    held_in, held_out = {(w.index, w.dim) for w in whole_in}, {(w.index, w.dim) for w in whole_out}
    reduce_axes = tuple(a for label in rule.contracted for a in chosen.get(label, ()))
    return ShardingChoice([spec(i, x, held_in) for i, x in enumerate(operands)],
                [spec(i, x, held_out) for i, x in enumerate(results)], reduce_axes, whole_in, whole_out, gathered)


def explicit_sharding(x):
    """The sharding that ``x``'s type names (``x``: a value, or its abstract value) when its mesh has
    Explicit axes; None elsewhere (Auto axes are decided when XLA compiles, shard_map's are manual)."""
    s = getattr(x if isinstance(x, ShapedArray) else jax.typeof(x), "sharding", None)
    explicit = isinstance(s, NamedSharding) and jax.sharding.AxisType.Explicit in tuple(s.mesh.axis_types)
    return s if explicit else None


def rows_view(x, shape: tuple):
    """``x`` reshaped to ``shape`` (its 2-D (rows, cols) view, or back; a GEMM's fold). On an Explicit
    mesh jax types the reshape, and rejects one whose split it cannot carry over (a split of a
    leading dim after the first is not a split of the folded rows): the leading dims are then
    gathered, with a ShardingWarning naming the split (an unchanged last dim keeps its own)."""
    try:
        return x.reshape(shape)
    except Exception:  # noqa: BLE001  (jax's ShardingTypeError; its class is private)
        s = None if isinstance(x, np.ndarray) else explicit_sharding(x)
        if s is None:
            raise
    spec = tuple(s.spec) + (None,) * (x.ndim - len(tuple(s.spec)))
    warn(f"jax_fp8: an array of shape {tuple(x.shape)} split as {s.spec} is reshaped to {tuple(shape)}, which cannot "
         f"keep that split (a split of a leading dim after the first is not a split of folded rows, nor the "
         f"reverse): its leading dims are gathered", ShardingWarning)
    out = PartitionSpec(*(None,) * (len(shape) - 1), spec[-1] if shape[-1] == x.shape[-1] else None)
    return lax.reshape(x, tuple(shape), out_sharding=NamedSharding(s.mesh, out))


def pad_end(x, shape: tuple, value=0):
    """``x`` padded with ``value`` at the end of each dim to ``shape``. On an Explicit mesh a split dim
    whose padded size its shards do not divide is gathered first (jax pads only even splits), with a
    ShardingWarning naming it."""
    widths = [(0, int(t) - n) for n, t in zip(x.shape, shape)]
    s = explicit_sharding(x)
    if s is not None:
        spec, sizes = spec_axes(s.spec, x.ndim), dict(s.mesh.shape)
        keep = [a if not a or not w or t % _shards(a, sizes) == 0 else ()
                for a, (_, w), t in zip(spec, widths, shape)]
        if keep != list(spec):
            warn(f"jax_fp8: an array of shape {tuple(x.shape)} split as {s.spec} is padded to {tuple(shape)}, "
                 f"which its shards do not divide: those dims are gathered", ShardingWarning)
            x = jax.sharding.reshard(x, named_sharding(s.mesh, keep))
    return jnp.pad(x, widths, constant_values=np.asarray(value, x.dtype))


def _shards(axes: Axes, mesh_sizes) -> int:
    return int(np.prod([mesh_sizes[a] for a in axes]))


def sdy_rule(rule: Rule, params: dict, shapes, mesh_sizes) -> tuple[str, dict]:
    """The Shardy rule (einsum-like string, factor sizes) of the op at these operand shapes: one factor
    per op dim; where a scale grid has one entry per block of c elements, the data's dim is the
    compound ``(Lb Lr)`` (blocks, c) and the grid's dim ``Lb``. Dims that are not exactly their op dim
    in blocks (partial blocks, padding) get factors of their own: nothing propagates through them; so
    do the grids whose block count a mesh axis neither divides nor is coprime with (Shardy would split
    that axis between ``Lb`` and ``Lr``, a sharding no PartitionSpec can name)."""
    sizes = rule.sizes(shapes, params)
    operands, results = rule.arrays(sizes, params)
    coarse = {}
    for d in itertools.chain(*operands, *results):
        blocks = sizes[d.label] // d.block if d.label is not None else 0
        if (d.label is not None and d.block > 1 and _exact(d, sizes) and blocks > 1  # Shardy: no size-1 factor
                and all(math.gcd(blocks, a) in (1, a) for a in mesh_sizes.values())):
            coarse.setdefault(d.label, d.block)
    devices = int(np.prod(list(mesh_sizes.values())))
    factor_sizes, fresh = {}, itertools.count()

    def name(d: Dim) -> str:
        c = coarse.get(d.label)
        # a padded grid links to its data only where no split could leave a shard padding mid-grid
        padded_per_shard = d.pad > 1 and d.size % (d.pad * devices)
        if d.label is None or not _exact(d, sizes) or d.block not in (1, c or 1) or padded_per_shard:
            return f"z{next(fresh)}"
        if c is None:
            return d.label
        if d.block == 1:
            factor_sizes[f"{d.label}r"] = c
            return f"({d.label}b {d.label}r)"
        return f"{d.label}b"

    def side(layouts):
        return ", ".join(" ".join(name(d) for d in layout) for layout in layouts)

    def factors(side_text):
        return set(side_text.replace("(", " ").replace(")", " ").replace(",", " ").replace("->", " ").split())

    ops, res = side(operands), side(results)
    text = f"{ops} -> {res}"
    used = factors(text)
    whole = set(text.replace(",", " ").split())  # factors that name a whole dim somewhere
    for label, c in coarse.items():
        # Shardy needs the size of every factor that names no whole dim: ``Lr`` always, ``Lb`` where
        # no grid links to it (each grid got a factor of its own: padded, partial, or another block)
        if f"{label}b" in used and f"{label}b" not in whole:
            factor_sizes[f"{label}b"] = sizes[label] // c
    # Shardy's reduction factors name no result's dim: a contracted label that one result keeps (a norm's
    # dx beside its column sums) is left to the rule's local function to reduce
    in_results = factors(res)
    reduction = tuple(f for label in rule.contracted for f in (label, f"{label}b", f"{label}r")
                      if f in used and f not in in_results)
    return text, dict(factor_sizes, reduction_factors=reduction)


def named_sharding(mesh, spec):
    """The NamedSharding of per-dim mesh axes (a spec as ``ShardingChoice`` holds them)."""
    return NamedSharding(mesh, PartitionSpec(*[None if not axes else axes[0] if len(axes) == 1 else axes
                                               for axes in spec]))
