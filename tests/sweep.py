"""Generated sharded-``jit`` programs: every jax_fp8 op on every kind of mesh, sharding and shape.

Test helper (tests/test_sharded_sweep.py runs it). A :class:`Case` is one program: an op (quantize
in each format, usage and layout, with a dequantize of each usage; ``fp8_dot_general`` forward or
gradient), a mesh (shape and how it was built: ``Mesh(...)``, ``jax.make_mesh`` with Auto axes, or
with its default axis types, Explicit on jax 0.12, also inside ``jax.set_mesh``), a sharding of the operands (replicated, data
parallel, column / row tensor parallel, FSDP, FSDP + TP, sequence-split 3-D activations) and a shape.

Shapes are drawn, not picked: a size is ``128 * c + 32 * o`` (``c`` blocks of 128 and ``o`` extra
32-wide columns: a partial block) or one of :data:`ODD` (not a multiple of 32); :func:`fixed_sample`
walks ``c`` through every residue modulo the mesh's size (8 or 6: the block counts that Shardy's
factors and the shard counts divide, or not) for each dim of each op family, so the common widths
(512, 1024, 2048, 4096: c = 4, 8, 16, 32) are among them by construction. :func:`case_strategy`
draws the same space for hypothesis.

:func:`run_case` compiles the program on sharded inputs (``device_put``; a dim its shards cannot
split evenly is split inside the jit by a sharding constraint, as an intermediate is) and checks that
it compiles, raises nothing (a rule that cannot split a dim gathers it, with a ShardingWarning) and
returns the values of the same program on one device: the quantized tensors and their dequantized
values bit for bit, a product within the bound of a reassociated fp32 sum (bit for bit unsplit).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import PartitioningRuleWarning
from jax_fp8.primitives.partitioning import spec_axes
from helpers import assert_bits_equal, assert_tensors_equal, random_input, stable_seed

_CPU = jax.devices("cpu")[0]

#: mesh name: (shape, axis names)
MESHES = {
    "8": ((8,), ("data",)),
    "4x2": ((4, 2), ("data", "model")),
    "2x4": ((2, 4), ("data", "model")),
    "2x2x2": ((2, 2, 2), ("data", "fsdp", "model")),
    "6": ((6,), ("data",)),
    "3x2": ((3, 2), ("data", "model")),
}
#: Mesh(...); jax.make_mesh with Auto axes; with its default axis types (Explicit on jax 0.12); the
#: same inside ``with jax.set_mesh(mesh)`` (jit traced, compiled and run there)
CONSTRUCTIONS = ("Mesh", "make_mesh_auto", "make_mesh", "set_mesh")
EXPLICIT = ("make_mesh", "set_mesh")

#: quantize ops: format name -> its call; each with every usage set and layout
FORMATS = {
    "mxfp8": lambda x, rowwise, colwise, layout: jf.quantize_mxfp8(x, rowwise=rowwise, colwise=colwise, layout=layout),
    "1x128": lambda x, rowwise, colwise, layout: jf.quantize_blockwise(x, (1, 128), rowwise=rowwise, colwise=colwise,
                                                                       layout=layout),
    "128x128": lambda x, rowwise, colwise, layout: jf.quantize_blockwise(x, (128, 128), rowwise=rowwise,
                                                                         colwise=colwise, layout=layout),
}
USAGES = {"rowwise": (True, False), "colwise": (False, True), "both": (True, True)}
LAYOUTS = ("compact", "gemm_ready")
QUANTIZE_OPS = tuple(f"quantize {f} {u} {layout}" for f in FORMATS for u in USAGES for layout in LAYOUTS)
DOT_OPS = ("dot", "dot grad")

#: sharding kinds of each family. Quantize: its input x (rows, cols) or (batch, sequence, cols).
#: Dot: x and the weight (K, N), flax's kernel.
QUANTIZE_SHARDINGS = ("replicated", "rows", "cols", "rows+cols", "sequence")
DOT_SHARDINGS = ("replicated", "data", "tp-col", "tp-row", "fsdp", "fsdp+tp", "sequence")

#: sizes that are not multiples of 32 (nor of the blocks)
ODD = (96 + 4, 200, 1000)
MAX_ELEMENTS = 1 << 22  # an operand's elements
MAX_MACS = 1 << 29  # a product's multiply-adds (x3 with its gradient)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # one of QUANTIZE_OPS or DOT_OPS
    mesh: str  # a key of MESHES
    construction: str  # one of CONSTRUCTIONS
    sharding: str  # one of the family's shardings
    x_shape: tuple  # (M, K), or (B, S, K) for "sequence"
    n: int = 0  # the dot's N

    @property
    def family(self) -> str:
        return "dot" if self.op in DOT_OPS else "quantize"

    def __str__(self):
        shape = "x".join(map(str, self.x_shape)) + (f" N={self.n}" if self.n else "")
        return f"{self.op} | {self.sharding} on {self.mesh} ({self.construction}) | {shape}"


# ---- the specs of each sharding kind -----------------------------------------------------------------
def specs(case: Case) -> tuple:
    """(x's spec, the weight's spec or None): mesh axes per dim. Data parallel and FSDP split the rows
    over every mesh axis but the last ("model"), which tensor parallelism takes; on a one-axis mesh
    that one axis plays both parts."""
    names = MESHES[case.mesh][1]
    tp = names[-1]
    batch = names[:-1] or names  # the data-parallel axes
    one = lambda axes: axes[0] if len(axes) == 1 else tuple(axes)  # noqa: E731
    if case.family == "quantize":
        return {
            "replicated": (P(), None),
            "rows": (P(one(names), None), None),
            "cols": (P(None, tp), None),
            "rows+cols": (P(one(batch), tp) if len(names) > 1 else P(None, tp), None),
            "sequence": (P(None, names[0], None) if len(names) == 1 else P(names[0], one(names[1:]), None), None),
        }[case.sharding]
    lone = len(names) == 1
    return {
        "replicated": (P(), P()),
        "data": (P(one(names), None), P()),
        "tp-col": (P(None if lone else one(batch), None), P(None, tp)),
        "tp-row": (P(None if lone else one(batch), tp), P(tp, None)),
        "fsdp": (P(one(names), None), P(one(names), None)),
        "fsdp+tp": (P(one(batch), None), P(one(batch), None) if lone else P(one(batch), tp)),
        "sequence": (P(None, names[0], None) if lone else P(names[0], one(names[1:-1] or names[1:]), None),
                     P(None, tp) if len(names) > 2 else P()),
    }[case.sharding]


def _shards(spec, ndim: int, mesh_shape: dict) -> tuple:
    """How many shards each of ``ndim`` dims is split into."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    axes = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
    return tuple(int(np.prod([mesh_shape[a] for a in a_])) for a_ in axes)


def shard_counts(case: Case) -> dict:
    """Shards per dim role ('rows', 'k', 'n', 'batch', 'seq'): over x's and the weight's specs."""
    x_spec, w_spec = specs(case)
    mesh_shape = dict(zip(MESHES[case.mesh][1], MESHES[case.mesh][0]))
    x = _shards(x_spec, len(case.x_shape), mesh_shape)
    counts = dict(zip(("batch", "seq", "k"), x)) if len(case.x_shape) == 3 else dict(zip(("rows", "k"), x))
    if w_spec is not None:
        wk, wn = _shards(w_spec, 2, mesh_shape)
        counts["k"] = max(counts["k"], wk)
        counts["n"] = wn
    return counts


def roles(case_op: str, sharding: str) -> tuple:
    """The sized dims of a case: x's (rows, k) or (batch, seq, k), and the dot's n."""
    x = ("batch", "seq", "k") if sharding == "sequence" else ("rows", "k")
    return x + (("n",) if case_op in DOT_OPS else ())


# ---- sizes --------------------------------------------------------------------------------------
COMMON = (512, 1024, 2048, 4096, 8192)  # model widths: every one is some case's width


def size_of(c: int, o: int) -> int:
    """``c`` blocks of 128 and ``o`` more 32-wide columns (-1: one of ODD, picked by c)."""
    return ODD[c % len(ODD)] if o < 0 else 128 * c + 32 * o


def _fits(case: Case) -> bool:
    x = math.prod(case.x_shape)
    k = case.x_shape[-1]
    return x <= MAX_ELEMENTS and (not case.n or (x * case.n <= MAX_MACS and k * case.n <= MAX_ELEMENTS))


def _make(op, mesh, construction, sharding, sizes: dict) -> Case:
    x_shape = tuple(sizes[r] for r in roles(op, sharding) if r != "n")
    return Case(op, mesh, construction, sharding, x_shape, sizes.get("n", 0))


def _even(case: Case) -> bool:
    """Every split dim splits evenly (device_put can place it; an Explicit mesh needs it)."""
    counts = shard_counts(case)
    sizes = dict(zip(roles(case.op, case.sharding), (*case.x_shape, case.n)))
    return all(sizes[r] % counts.get(r, 1) == 0 for r in sizes)


def _within_budget(case: Case) -> Case:
    """``case`` with dims shrunk to the size budget: the batch of sequences first, then the largest dim
    that is not a COMMON width and can shrink (else the largest that can), by whole residue periods of
    the mesh's size where it can (_smaller)."""
    L = math.prod(MESHES[case.mesh][0])
    sizes = dict(zip(roles(case.op, case.sharding), (*case.x_shape, case.n)))
    while not _fits(case):
        if sizes.get("batch", 1) > 1:
            sizes["batch"] //= 2
        else:
            dims = sorted((r for r in sizes if r != "batch"), key=lambda r: (sizes[r] not in COMMON, sizes[r]))
            role = next(r for r in reversed(dims) if _smaller(sizes[r], L) < sizes[r])  # one that can shrink
            sizes[role] = _smaller(sizes[role], L)
        case = _make(case.op, case.mesh, case.construction, case.sharding, sizes)
    return case


def _placeable(case: Case) -> Case:
    """``case``, with its split dims rounded up to their shard counts on an Explicit mesh (which
    places only even splits; elsewhere an uneven split is made inside the jit)."""
    if case.construction not in EXPLICIT:
        return case
    counts = shard_counts(case)
    sizes = dict(zip(roles(case.op, case.sharding), (*case.x_shape, case.n)))
    return _make(case.op, case.mesh, case.construction, case.sharding,
                 {r: -(-v // counts.get(r, 1)) * counts.get(r, 1) for r, v in sizes.items()})


def _smaller(size: int, L: int) -> int:
    """A smaller size: whole residue periods of 128 * L off (the block count's residue kept), else half."""
    return size - 128 * L if size > 128 * L + 128 else max(size // 2 // 32 * 32, 32)


def _first_round_size(j: int, r: int, L: int, q: int) -> int:
    """Dim ``r``'s size in case ``j`` < L of a group: block count ``(j + 3r) % L`` (each dim its own
    phase, so the dims' residues do not move together) plus ``q`` periods, and 0-3 extra 32-wide
    columns (a partial block)."""
    return size_of((j + 3 * r) % L + L * q or L, (j + r) % 4)


def _later_size(j: int, r: int, L: int, q: int) -> int:
    """Dim ``r``'s size in case ``j`` >= L: an ODD size, a COMMON width or another residue, in turn."""
    pick = (j + r) % 3
    if pick == 0:
        return ODD[(j // 3 + r) % len(ODD)]
    if pick == 1:
        return COMMON[(j // 3 + r) % len(COMMON)]
    return _first_round_size(j, r, L, q)


def fixed_sample() -> list[Case]:
    """The cases the test suite runs: every quantize op with every quantize sharding, and every dot
    sharding on every mesh (forward and gradient taking turns, each on every mesh; the sequence
    sharding twice, once each). Cases are grouped by family, mesh size L (8 or 6) and the op's dims;
    in a group's first L cases each dim's block count walks every residue modulo L, then ODD sizes,
    COMMON widths and more residues take turns; a batch of sequences counts 1 to L. Dims shrink to the
    size budget (:func:`_within_budget`); the mesh constructions take turns within each family's
    sharding (:func:`_placeable`)."""
    rng = np.random.default_rng(stable_seed("sharded sweep sample"))
    meshes = list(MESHES)
    plan = [(op, s, meshes[i % len(meshes)]) for i, (op, s) in
            enumerate((op, s) for op in QUANTIZE_OPS for s in QUANTIZE_SHARDINGS)]
    dots = [s for s in DOT_SHARDINGS for _ in meshes] + ["sequence"] * len(meshes)
    plan += [(DOT_OPS[(i + i // len(meshes)) % 2], s, meshes[i % len(meshes)]) for i, s in enumerate(dots)]
    cases, turn = [], {}  # turn: per group (and per family and sharding), how many cases it has had
    for op, sharding, mesh in plan:
        family, L, names = ("dot" if op in DOT_OPS else "quantize"), math.prod(MESHES[mesh][0]), roles(op, sharding)
        j = turn[family, L, names] = turn.get((family, L, names), -1) + 1
        q = int(rng.integers(0, 2)) if family == "quantize" else 0
        size = _first_round_size if j < L else _later_size
        sizes = {role: ((j + r) % L or L) if role == "batch" else size(j, r, L, q) for r, role in enumerate(names)}
        k = turn[family, sharding] = turn.get((family, sharding), -1) + 1
        cases.append(_placeable(_within_budget(_make(op, mesh, CONSTRUCTIONS[k % len(CONSTRUCTIONS)], sharding,
                                                     sizes))))
    return cases


def case_strategy():
    """A hypothesis strategy over the same space: any op, mesh, construction and sharding, each dim
    ``128 * c + 32 * o`` (c < 66: up to 8192 and beyond) or ODD, a batch of 1 to 16 sequences; shrunk
    to the size budget as the fixed sample's."""
    from hypothesis import strategies as st

    size = st.one_of(st.builds(size_of, st.integers(0, 65), st.integers(0, 3)).filter(bool),
                     st.sampled_from(ODD))

    @st.composite
    def cases(draw):
        op = draw(st.sampled_from(QUANTIZE_OPS + DOT_OPS))
        sharding = draw(st.sampled_from(DOT_SHARDINGS if op in DOT_OPS else QUANTIZE_SHARDINGS))
        sizes = {role: draw(st.integers(1, 16) if role == "batch" else size) for role in roles(op, sharding)}
        case = _make(op, draw(st.sampled_from(list(MESHES))), draw(st.sampled_from(CONSTRUCTIONS)), sharding, sizes)
        return _placeable(_within_budget(case))

    return cases()


# ---- running a case -------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def make_mesh(name: str, construction: str):
    shape, names = MESHES[name]
    devices = jax.devices("cpu")[:math.prod(shape)]
    if construction == "Mesh":
        return Mesh(np.array(devices).reshape(shape), names)
    if construction == "make_mesh_auto":
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
    return jax.make_mesh(shape, names, devices=devices)  # make_mesh, set_mesh


def _placer(mesh, spec, shape):
    """(how to pass an operand in, what the jit does to it first): ``device_put`` with ``spec`` where
    its shards split evenly; else passed replicated and constrained to ``spec`` inside the jit (an
    uneven split, which XLA pads), as an intermediate of a user's program may be."""
    sharding = NamedSharding(mesh, spec)
    counts = _shards(spec, len(shape), dict(mesh.shape))
    if all(n % c == 0 for n, c in zip(shape, counts)):
        return sharding, lambda v: v
    return NamedSharding(mesh, P()), lambda v: jax.lax.with_sharding_constraint(v, sharding)


def _program(case: Case, specials: bool):
    """(fn of the operands, the operands as arrays): the op, with its dequantizes or its loss; the
    quantize's input with special values (zeros, subnormals, huge, inf, NaN) where ``specials``."""
    seed = stable_seed("sweep", str(case))
    rng = np.random.default_rng(seed)
    x = random_input(rng, case.x_shape, jnp.bfloat16, specials=specials and case.family == "quantize")
    if case.family == "quantize":
        _, fmt, usage, layout = case.op.split()
        rowwise, colwise = USAGES[usage]

        def quant(x):
            q = FORMATS[fmt](x, rowwise, colwise, layout)
            return q, tuple(jf.dequantize(q, usage=u) for u in q.usage_blocks())

        return quant, (x,)
    w = (rng.standard_normal((case.x_shape[-1], case.n)) / 32).astype(jnp.bfloat16)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if case.op == "dot":
        return (lambda x, w: jf.fp8_dot_general(x, w, dims)), (x, w)
    c = rng.standard_normal((*case.x_shape[:-1], case.n)).astype(np.float32)

    def loss(x, w, c):  # a fixed output gradient c: a split K may change y's last bit, not dy
        return jnp.sum(jf.fp8_dot_general(x, w, dims).astype(jnp.float32) * c)

    return jax.grad(loss, argnums=(0, 1)), (x, w, c)


def _positive_zeros(a):
    """``a`` with -0 as +0 (of any float dtype; by bits, so NaN payloads stay)."""
    a = np.asarray(a)
    if a.dtype.kind not in "fV" and "float" not in a.dtype.name:
        return a
    b = a.view(f"uint{8 * a.dtype.itemsize}")
    sign = b.dtype.type(1 << (8 * a.dtype.itemsize - 1))
    return np.where(b == sign, b.dtype.type(0), b).view(a.dtype)


def _y_spec(x_spec, w_spec, ndim: int):
    """The spec of y = x @ W (and of its gradient): x's leading dims, W's N where that axis is free."""
    lead = (tuple(x_spec) + (None,) * ndim)[:ndim - 1]
    n = (tuple(w_spec) + (None, None))[1]
    used = {a for e in lead if e is not None for a in ((e,) if isinstance(e, str) else e)}
    return P(*lead, n if n is not None and not ({n} if isinstance(n, str) else set(n)) & used else None)


def _split(case: Case) -> bool:
    """Whether the shardings split any dim: each device's GEMM then has other sizes than the one
    device's, and XLA's CPU dot (inside the reference GEMM's 128-wide K blocks) may sum in another
    order at other sizes, as a GPU GEMM may pick another tiling; a split contraction sums partial
    products across devices too."""
    return any(n > 1 for n in shard_counts(case).values())


def run_case(case: Case) -> list:
    """Compile and run ``case`` sharded and on one device; assert the values agree (bits, or within
    reassociation where a contraction is split) and that no partitioning rule failed. Returns the
    warnings the sharded compile raised."""
    from test_sharded_jit import assert_close_reassociated

    # XLA gathers an uneven split through an all-reduce sum, which flushes subnormals and turns -0
    # into +0 (plain jnp code too): there the inputs are normal numbers and zeros compare by value
    uneven = not _even(case)
    fn, args = _program(case, specials=not uneven)
    mesh = make_mesh(case.mesh, case.construction)
    x_spec, w_spec = specs(case)
    arg_specs = [x_spec] if w_spec is None else [x_spec, w_spec, _y_spec(x_spec, w_spec, len(case.x_shape))]
    placed = [_placer(mesh, s, a.shape) for s, a in zip(arg_specs, args)]

    def sharded(*vals):
        return fn(*(pre(v) for (_, pre), v in zip(placed, vals)))

    inputs = [jax.device_put(a, s) for (s, _), a in zip(placed, args)]
    context = jax.set_mesh(mesh) if case.construction == "set_mesh" else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, context:
        warnings.simplefilter("always")
        got = jax.jit(sharded).lower(*inputs).compile()(*inputs)
    failed = [str(w.message) for w in caught if issubclass(w.category, PartitioningRuleWarning)]
    assert not failed, f"{case}: a partitioning rule failed: {failed}"
    want = jax.jit(fn)(*jax.device_put(args, _CPU))
    if case.family == "quantize":
        if uneven:
            got, want = jax.tree.map(_positive_zeros, (got, want))
        assert_tensors_equal(got[0], want[0])
        for u, a, b in zip(want[0].usage_blocks(), got[1], want[1]):
            assert_bits_equal(a, b, f"{case}: dequantize {u}")
        return caught
    results = {"y": (got, want)} if case.op == "dot" else {"dx": (got[0], want[0]), "dw": (got[1], want[1])}
    for what, (a, b) in results.items():
        if _split(case):
            assert_close_reassociated(np.asarray(a), np.asarray(b), f"{case}: {what}")
        else:
            assert_bits_equal(a, b, f"{case}: {what}")
    if case.construction in EXPLICIT:  # typed as lax's: y as lax.dot_general's, the gradients as their operands
        with context:
            want_types = [_lax_type(*inputs[:2])] if case.op == "dot" else [a.sharding for a in inputs[:2]]
        for what, a, t in zip(results, got if case.op != "dot" else [got], want_types):
            if t is not None:
                assert spec_axes(a.sharding.spec, a.ndim) == spec_axes(t.spec, a.ndim), (str(case), what, a.sharding, t)
    return caught


def _lax_type(x, w):
    """The sharding jax types ``lax.dot_general(x, w)`` with (None where lax asks for an out_sharding)."""
    typed = []
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    try:
        jax.jit(lambda x, w: typed.append(jax.typeof(jax.lax.dot_general(x, w, dims)).sharding)).trace(x, w)
    except Exception:  # noqa: BLE001  (lax's ShardingTypeError)
        return None
    return typed[0]
