"""The GEMM plan: what an FP8 product runs, decided once from static facts (shapes, dimension
numbers, operand kinds, recipe) before anything is traced.

- :func:`plan_gemm`: one GEMM ``a · bᵀ`` (a (M, K), b (N, K)): the backend and kernel that run it (the
  one :mod:`jax_fp8.gemm.table` measured fastest on this GPU, else the first of
  :data:`jax_fp8.gemm.backends.BACKENDS` that takes its format and shape, on its own choice of kernel)
  and the padded sizes, or why none does (then the reference math computes it, on the same quantized
  operands).
- :func:`fold_dot_general`: whether a ``dot_general``'s operands are the GEMM's 2-D problem by reshapes
  alone (several contracting dims folded into one K, an N-D weight's free dims into N), and how.
- :func:`plan_dot_general`: one ``fp8_dot_general`` call: either why it runs as ``lax.dot_general``
  of quantize-dequantized operands, or its fold and its three GEMMs (fprop; dgrad where x gets a gradient; wgrad
  where W does), each with its operands' orientation and its :class:`GemmPlan`. The VJP executes it;
  the warnings read it; the primitive's lowering asks the planned backend whether it runs there.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from ..arrays import view_2d
from ..formats import BLOCKWISE, FLOAT8_BLOCK, FP8_DTYPES, HIGH_DTYPES, MXFP8, format_of_block
from ..primitives.partitioning import rows_view
from ..scheme import check_block
from ..tensors import QUANTIZED_TENSORS, BlockwiseTensor, MXFP8Tensor
from . import backends, table
from .contract import BLOCK_1D, BLOCK_2D, MX_BLOCK_1D, GemmBackend

E4M3 = FP8_DTYPES[0]


def usage_read(contract: str) -> str:
    """The usage a GEMM reads of a tensor contracted over its 2-D view's ``contract`` ('last' or
    'first') dim: the rowwise one (blocks along the last dim), or the columnwise one."""
    return "rowwise" if contract == "last" else "colwise"


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """One GEMM ``a · bᵀ`` with a (M, K) and b (N, K), both contracted over K: its blocks and FP8
    dtypes, the ``backend`` that runs it at ``padded`` sizes (>= M, N, K: zero rows / columns
    appended, the output sliced), or ``reason``: why no backend takes it (then ``backend`` is None and
    the reference math computes it, fp32 per K block, on the same quantized operands)."""

    M: int
    N: int
    K: int
    a_block: tuple = BLOCK_1D
    b_block: tuple = BLOCK_2D
    a_dtype: Any = E4M3
    b_dtype: Any = E4M3
    backend: Optional[GemmBackend] = None
    padded: Optional[tuple] = None
    reason: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def empty(self) -> bool:
        """Nothing to multiply (a zero dim)."""
        return min(self.M, self.N, self.K) <= 0

    @property
    def aligned(self) -> bool:
        """The backend takes the problem with no padding."""
        return self.padded == (self.M, self.N, self.K)


def plan_gemm(M: int, N: int, K: int, a_block=BLOCK_1D, b_block=BLOCK_2D, a_dtype=E4M3, b_dtype=E4M3,
              reason: Optional[str] = None, backend: Optional[GemmBackend] = None) -> GemmPlan:
    """The plan of ``a`` (M, K) x ``b`` (N, K)ᵀ with these blocks ((1, 128) or (128, 128): Float8
    blockwise; (1, 32) on both: MXFP8) and FP8 dtypes: the backend and kernel
    :func:`jax_fp8.gemm.table.choose` names for this GPU when it takes the problem and runs here; else
    the first backend of :data:`jax_fp8.gemm.backends.BACKENDS` that takes the format and the problem and
    runs on this machine (else the first that takes it: it then computes the reference, with a warning);
    or why none takes it (``reason`` given: no backend is asked, e.g. an operand exists only as values).
    ``backend``: this one (with its options) and no other (``implementation=``, or to compare backends)."""
    a_block, b_block = _check_blocks(a_block, b_block)
    args = dict(M=int(M), N=int(N), K=int(K), a_block=a_block, b_block=b_block, a_dtype=jnp.dtype(a_dtype),
                b_dtype=jnp.dtype(b_dtype))
    if reason is None and min(M, N, K) <= 0:
        reason = f"an empty GEMM ({M}x{N}x{K})"
    if reason is not None:
        return GemmPlan(**args, reason=reason)
    taken, why = [], []
    fmt = format_of_block(a_block)
    if backend is backends.REFERENCE:  # at the sizes of the plan's own choice: the same bits where that
        chosen = plan_gemm(**args)     # computes the reference too (its lowering off its GPU)
        padded = chosen.padded if chosen.ok else (args["M"], args["N"], args["K"])
        return GemmPlan(**args, backend=backend, padded=padded)
    candidates = tuple(b for b in backends.BACKENDS if b.takes(fmt)) if backend is None else (backend,)
    if backend is not None and not backend.takes(fmt):
        return GemmPlan(**args, reason=f"{backend.name} takes {' and '.join(f.name for f in backend.formats)} operands, not {fmt.name}")
    for each in candidates:
        padded, no = each.sizes(args["M"], args["N"], args["K"], a_block, b_block, args["a_dtype"], args["b_dtype"])
        if no is None:
            taken.append(GemmPlan(**args, backend=each, padded=tuple(padded)))
        else:
            why.append(no if len(candidates) == 1 else f"{each.name}: {no}")
    if not taken:
        return GemmPlan(**args, reason="; ".join(why))
    if backend is not None:
        return taken[0]
    measured = _measured(taken)
    if measured is not None:
        return measured
    return next((p for p in taken if _runs_here(p.backend)), taken[0])


def _measured(taken: list) -> Optional[GemmPlan]:
    """The plan of ``taken`` whose backend the GEMM table names for this GPU, with the table's options;
    None without a row, or where that backend does not take the problem or run here."""
    p = taken[0]
    if format_of_block(p.a_block) is not BLOCKWISE:  # the table measured Float8 blockwise kernels
        return None
    pick = table.choose(p.M, p.N, p.K, p.a_block, p.b_block)
    if pick is None:
        return None
    name, options = pick
    plan = next((t for t in taken if t.backend.name == name and _runs_here(t.backend)), None)
    return None if plan is None else dataclasses.replace(plan, backend=plan.backend.with_options(**options))


@functools.lru_cache(maxsize=None)
def _runs_here(backend: GemmBackend) -> bool:
    """Whether ``backend``'s kernel runs on one of this machine's platforms (asked once per backend)."""
    return backend.unavailable_here() is None


# ---- fp8_dot_general ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Operand:
    """One side of a GEMM: ``tensor`` ('x', 'w' or 'dy') contracted over the ``contract`` ('last' or
    'first') dim of its 2-D view (for W: its (N, K) or (K, N) array as given)."""

    tensor: str
    contract: str


@dataclasses.dataclass(frozen=True)
class Step:
    """One of the GEMMs of a linear layer: ``name`` ('fprop', 'dgrad' or 'wgrad'), ``a · bᵀ``."""

    name: str
    a: Operand
    b: Operand
    gemm: GemmPlan


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What the plan knows of an operand: its block and FP8 dtype, and for a pre-quantized tensor
    the usages it holds (None: quantized by the call, every usage)."""

    block: tuple
    dtype: Any
    usages: Optional[frozenset] = None

    def lacks(self, contract: str) -> bool:
        """A pre-quantized tensor without the usage this contraction reads (128x128 tiles serve both)."""
        return self.usages is not None and self.block != BLOCK_2D and usage_read(contract) not in self.usages


@dataclasses.dataclass(frozen=True)
class DotPlan:
    """What one ``fp8_dot_general`` call runs. ``fallback``: why it runs as ``lax.dot_general`` (no steps
    then); else its ``fold`` (the operands as the 2-D problem x (M, K) · W, W (K, N) when ``rhs_kn`` else
    (N, K); reshapes only, :func:`fold_dot_general`) and its ``steps`` (fprop, dgrad where the lhs gets a
    gradient, wgrad where the rhs does). ``stacked``: the lhs runs as (B, S, K) sequences (see
    ``fp8_dot_general``)."""

    fallback: Optional[str] = None
    fold: Optional[Fold] = None
    steps: tuple = ()
    stacked: bool = False

    @property
    def M(self) -> int:
        return self.fold.M if self.fold is not None else 0

    @property
    def N(self) -> int:
        return self.fold.N if self.fold is not None else 0

    @property
    def K(self) -> int:
        return self.fold.K if self.fold is not None else 0

    @property
    def rhs_kn(self) -> bool:
        return self.fold is not None and self.fold.rhs_kn

    @property
    def empty(self) -> bool:
        """Nothing to multiply (a zero dim): ``lax.dot_general`` gives the zeros, no warning."""
        return self.fallback is None and self.M * self.N * self.K == 0

    def step(self, name: str) -> Optional[Step]:
        return next((s for s in self.steps if s.name == name), None)

    @property
    def backward(self) -> tuple:
        """The backward's steps: dgrad and wgrad, those that run."""
        return self.steps[1:]

    def reasons(self) -> list[str]:
        """Each GEMM the reference math computes, and why."""
        return [f"{s.name}: {s.gemm.reason}" for s in self.steps if not s.gemm.ok]


def dimension_numbers_tuple(dimension_numbers) -> tuple:
    """Dimension numbers as lax takes them (ints or sequences of ints) as ``((lhs contracting, rhs
    contracting), (lhs batch, rhs batch))``, each a tuple of ints."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in np.atleast_1d(v)) for v in (lc, rc, lb, rb))
    return (lc, rc), (lb, rb)


@dataclasses.dataclass(frozen=True)
class Fold:
    """One ``dot_general(lhs, rhs, dimension_numbers)`` as the GEMM's 2-D problem, by reshapes alone (no
    transpose, no copy): the lhs as (M, K), its free dims folded into M and its contracting dims (its
    trailing ones) into K; the rhs as (K, N) when ``rhs_kn`` (its contracting dims come first) else
    (N, K), its contracting dims folded into K and its free dims into N; the (M, N) product reshaped to
    ``out_shape``, ``lax.dot_general``'s. Dims are indices into the operands, in order; ``lhs_contract``
    ascending, ``rhs_contract`` paired with it. A weight's 128x128 tiles are those of this 2-D view
    (a (d, heads, head_dim) kernel: tiles of (d, heads * head_dim))."""

    lhs_shape: tuple
    rhs_shape: tuple
    lhs_free: tuple
    lhs_contract: tuple
    rhs_contract: tuple
    rhs_free: tuple
    rhs_kn: bool
    out_shape: tuple

    def sizes(self, lhs_shape=None, rhs_shape=None) -> tuple[int, int, int]:
        """(M, K, N) of this fold for these shapes of the operands (default: the ones it was made for;
        e.g. one device's shares of them)."""
        ls = self.lhs_shape if lhs_shape is None else tuple(lhs_shape)
        rs = self.rhs_shape if rhs_shape is None else tuple(rhs_shape)
        prod = lambda shape, dims: int(np.prod([shape[d] for d in dims], dtype=np.int64))  # noqa: E731
        return prod(ls, self.lhs_free), prod(ls, self.lhs_contract), prod(rs, self.rhs_free)

    @property
    def M(self) -> int:
        return self.sizes()[0]

    @property
    def K(self) -> int:
        return self.sizes()[1]

    @property
    def N(self) -> int:
        return self.sizes()[2]

    @property
    def lhs_view(self) -> tuple:
        """The lhs with its contracting dims folded into K: (*free dims, K) (stacked sequences: the last
        free dim is S)."""
        return (*(self.lhs_shape[d] for d in self.lhs_free), self.K)

    @property
    def rhs_view(self) -> tuple:
        """The rhs as the GEMM's 2-D weight: (K, N) when ``rhs_kn`` else (N, K)."""
        return (self.K, self.N) if self.rhs_kn else (self.N, self.K)

    # The reshapes, each merging (or splitting) one group of adjacent dims: the reshapes whose sharding
    # jax's Explicit types infer (one that merges two groups at once needs its out_sharding spelled out).
    def fold_lhs(self, x, stacked: bool = False):
        """``x`` (the lhs array) as the GEMM's lhs: (M, K), or (B, S, K) sequences when ``stacked``."""
        view = self.lhs_view
        return _reshapes(x, view, (-1, *view[-2:]) if stacked else (self.M, self.K))

    def fold_rhs(self, w):
        """``w`` (the rhs array) as the GEMM's 2-D weight, :attr:`rhs_view`."""
        free = tuple(self.rhs_shape[d] for d in self.rhs_free)
        return _reshapes(w, (self.K, *free) if self.rhs_kn else (*free, self.K), self.rhs_view)

    def unfold_out(self, y):
        """The GEMM's (M, N) product (or (B, S, N), stacked) as ``lax.dot_general``'s output."""
        return _reshapes(y, (*self.lhs_view[:-1], self.N), self.out_shape)


def _reshapes(x, *shapes):
    """``x`` reshaped to each of ``shapes`` in turn (skipping those it already has); where an Explicit
    sharding type cannot carry a split through a reshape, the leading dims are gathered (rows_view)."""
    for shape in shapes:
        if tuple(x.shape) != tuple(shape):
            x = rows_view(x, tuple(shape))
    return x


def fold_dot_general(lhs_shape, rhs_shape, dimension_numbers) -> tuple[Optional[Fold], Optional[str]]:
    """``(fold, None)`` where ``dot_general(lhs, rhs, dimension_numbers)`` folds to the GEMM's 2-D problem
    by reshapes alone (:class:`Fold`), else ``(None, why not)``. For valid dimension numbers (lax's checks
    come first). The rules, in which a dim of size 1 does not count (it moves no element):

    - at least one contracting dim (no contraction is an outer product, not a GEMM);
    - batch dims of size 1 only (lax puts them first in the output: ones);
    - the lhs's contracting dims are its trailing dims (its free dims, leading, fold into M);
    - the contracting dims pair up in the same order on both sides (lhs (2, 3) with rhs (0, 1), not
      (1, 0)): one K index then means the same element pair on both sides;
    - the rhs's contracting dims are adjacent and so are its free dims (contracting first: (K, N), e.g.
      flax's (d, heads, head_dim); or last: (N, K), e.g. (heads, head_dim, d) contracted over d).
    """
    lshape, rshape = tuple(int(d) for d in lhs_shape), tuple(int(d) for d in rhs_shape)
    (lc, rc), (lb, rb) = dimension_numbers_tuple(dimension_numbers)
    if any(lshape[d] != 1 for d in lb) or any(rshape[d] != 1 for d in rb):
        return None, (f"batch dimensions (lhs {lb}, rhs {rb}; the GEMM has none, it takes batch dimensions of "
                      "size 1 only)")
    if not lc:
        return None, "no contracting dimensions (an outer product, not a GEMM)"
    lfree = tuple(d for d in range(len(lshape)) if d not in lc and d not in lb)
    rfree = tuple(d for d in range(len(rshape)) if d not in rc and d not in rb)
    pairs = sorted(zip(lc, rc))
    sig_l = [d for d in range(len(lshape)) if lshape[d] != 1]
    sig_r = [d for d in range(len(rshape)) if rshape[d] != 1]
    sig_pairs = [(a, b) for a, b in pairs if lshape[a] != 1]
    kl, kr = [a for a, _ in sig_pairs], [b for _, b in sig_pairs]
    if sig_l[len(sig_l) - len(kl):] != kl:
        return None, (f"the lhs's contracting dims {lc} are not its trailing dims (the GEMM folds the lhs to (M, K) "
                      "by a reshape: free dims first, then the contracting ones)")
    if kr != sorted(kr):
        return None, (f"the contracting dims pair lhs {lc} with rhs {rc} in a different order on each side "
                      "(folding them into one K would need a transpose)")
    if sig_r[:len(kr)] == kr:
        rhs_kn = True
    elif sig_r[len(sig_r) - len(kr):] == kr:
        rhs_kn = False
    else:
        return None, (f"the rhs's contracting dims {rc} and its free dims {rfree} are not two adjacent groups "
                      "(the GEMM folds the rhs to (K, N) or (N, K) by a reshape)")
    out_shape = (*(lshape[d] for d in lb), *(lshape[d] for d in lfree), *(rshape[d] for d in rfree))
    return Fold(lshape, rshape, lfree, tuple(a for a, _ in pairs), tuple(b for _, b in pairs), rfree, rhs_kn,
                out_shape), None


def _why_not_fp8(lhs, rhs, out_dtype, mx: bool) -> Optional[str]:
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if isinstance(x, MXFP8Tensor) and not mx:
            return f"an MXFP8 {name} with the Float8 blockwise recipe (recipe=jax_fp8.MXFP8BlockScaling() takes it)"
        if isinstance(x, BlockwiseTensor) and mx:
            return f"a Float8 blockwise {name} with the MXFP8 recipe (recipe=jax_fp8.Float8BlockScaling() takes it)"
        if not isinstance(x, QUANTIZED_TENSORS) and jnp.dtype(x.dtype) not in HIGH_DTYPES:
            return f"an {name} of dtype {x.dtype} (FP8 quantizes float32, bfloat16, float16)"
    if out_dtype not in HIGH_DTYPES:  # its gradient could not be quantized either
        return f"preferred_element_type {out_dtype} (the GEMM gives float32, bfloat16 or float16)"
    return None


def _block_of(scheme) -> tuple:
    return scheme.block


def _kind(x, scheme) -> _Kind:
    """A pre-quantized tensor as its scheme says; else as the recipe's ``scheme`` for its role."""
    if isinstance(x, QUANTIZED_TENSORS):
        return _Kind(_block_of(x.scheme), x.scheme.dtype, frozenset(x.usage_blocks()))
    return _Kind(_block_of(scheme), scheme.dtype)


def _check_blocks(a_block, b_block) -> tuple[tuple, tuple]:
    """Both (1, 32) (MXFP8), or each (1, 128) or (128, 128) (Float8 blockwise)."""
    if MX_BLOCK_1D in (tuple(a_block), tuple(b_block)):
        if tuple(a_block) != tuple(b_block):
            raise ValueError(f"plan_gemm: an MXFP8 operand with a Float8 blockwise one ({a_block} and {b_block} "
                             "blocks)")
        return MX_BLOCK_1D, MX_BLOCK_1D
    return check_block(a_block, "plan_gemm: a_block"), check_block(b_block, "plan_gemm: b_block")


def _step(name: str, a: Operand, b: Operand, mnk: tuple, kinds: dict, backend: Optional[GemmBackend]) -> Step:
    ka, kb = kinds[a.tensor], kinds[b.tensor]
    lacks = ka.lacks(a.contract) or kb.lacks(b.contract)
    reason = ("a pre-quantized operand lacks the usage this GEMM contracts (1x128 blocks along the other dim)"
              if lacks else None)
    plan = plan_gemm(*mnk, ka.block, kb.block, ka.dtype, kb.dtype, reason=reason, backend=backend)
    if backend is not None and reason is None and not plan.ok:
        raise ValueError(f"fp8_dot_general: implementation={backend.name!r} cannot take the {name} GEMM "
                         f"({'x'.join(map(str, mnk))}): {plan.reason}")
    return Step(name, a, b, plan)


def plan_dot_general(lhs, rhs, dimension_numbers, out_dtype, recipe, sequences_may_split: bool = False,
                     backend: Optional[GemmBackend] = None) -> DotPlan:
    """The plan of ``fp8_dot_general(lhs, rhs, dimension_numbers, ...)`` with ``recipe`` (a
    ``Float8BlockScaling`` or ``MXFP8BlockScaling``): lhs and rhs arrays (or their abstract values) or
    quantized tensors of the recipe's format, whose shapes, dtypes and (pre-quantized) usages decide.
    ``sequences_may_split``: the lhs's sequences may be split over devices (stack them when every GEMM
    takes them unpadded under the ``jf_fp8_gemm`` primitive). ``backend``: every GEMM on it (the
    ``implementation=`` of ``fp8_dot_general``; ValueError where it cannot take one), else the plan's
    choice per GEMM."""
    fold, why = fold_dot_general(lhs.shape, rhs.shape, dimension_numbers)
    mx = recipe.scheme("lhs").format is MXFP8
    why = why or _why_not_fp8(lhs, rhs, out_dtype, mx) or _why_not_folded(lhs, rhs, fold)
    if why is not None:
        return DotPlan(fallback=why)
    M, N, K, rhs_kn = fold.M, fold.N, fold.K, fold.rhs_kn
    schemes = {role: recipe.scheme(role) for role in ("lhs", "rhs", "grad")}
    kinds = {"x": _kind(lhs, schemes["lhs"]), "w": _kind(rhs, schemes["rhs"]), "dy": _kind(None, schemes["grad"])}
    w_fprop, w_dgrad = ("first", "last") if rhs_kn else ("last", "first")  # W's K, then its N
    if kinds["x"].lacks("last") or kinds["w"].lacks(w_fprop):
        return DotPlan(fallback="a pre-quantized operand lacks the usage the forward GEMM contracts (its blocks "
                                "along it)")
    if M * N * K == 0:  # nothing to multiply
        return DotPlan(fold=fold)
    x_first, dy_first = Operand("x", "first"), Operand("dy", "first")
    steps = [_step("fprop", Operand("x", "last"), Operand("w", w_fprop), (M, N, K), kinds, backend)]
    # pre-quantized tensors get no gradient
    if not isinstance(lhs, QUANTIZED_TENSORS):  # dx (M, K) = dy (M, N) · [W as (K, N)]ᵀ, over N
        steps.append(_step("dgrad", Operand("dy", "last"), Operand("w", w_dgrad), (M, K, N), kinds, backend))
    if not isinstance(rhs, QUANTIZED_TENSORS):  # dW = dyᵀ · x over M, in W's orientation
        steps.append(_step("wgrad", x_first, dy_first, (K, N, M), kinds, backend) if rhs_kn
                     else _step("wgrad", dy_first, x_first, (N, K, M), kinds, backend))
    # stacked sequences take no padding: every GEMM must take them as they are
    view = fold.lhs_view
    stacked = (sequences_may_split and not mx and len(view) >= 3 and not isinstance(lhs, QUANTIZED_TENSORS)
               and view[-2] % FLOAT8_BLOCK == 0
               and all(s.gemm.ok and s.gemm.aligned and s.gemm.backend.lowerings for s in steps))
    return DotPlan(fold=fold, steps=tuple(steps), stacked=stacked)


def _why_not_folded(lhs, rhs, fold: Fold) -> Optional[str]:
    """A pre-quantized operand is used through its own 2-D view (prod(shape[:-1]), shape[-1]), its blocks
    laid over that view: it must be the fold's view of it (no reshape can move its blocks)."""
    for name, x, view in (("lhs", lhs, (fold.M, fold.K)), ("rhs", rhs, fold.rhs_view)):
        if isinstance(x, QUANTIZED_TENSORS) and view_2d(tuple(x.shape)) != view:
            return (f"a pre-quantized {name} of shape {tuple(x.shape)}, whose blocks lie on its 2-D view "
                    f"{view_2d(tuple(x.shape))}, not on the folded {view} the GEMM needs")
    return None
