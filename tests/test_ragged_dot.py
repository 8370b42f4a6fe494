"""``fp8_ragged_dot`` (a drop-in ``lax.ragged_dot`` with an FP8 VJP).

Numbers: forward, dgrad and wgrad against fp64 products of operands quantized independently here, per
group, by the dense quantize (``jf.quantize``, compact layout, the recipe's options) and dequantized in
NumPy (``helpers.deq``): x rowwise (1x128), each expert's weight in 128x128 tiles, dy rowwise, and for
the weight gradient each group's rows of x and dy alone in 128x1 blocks (blocks that restart at the
group's start). Each within the accumulation and output-rounding bound of its own GEMM
(``test_gemm.gemm_bound``, module doc there); rows in no group exactly 0, as ``lax.ragged_dot`` gives.

The sweep is generated: row counts against the 128-row blocks, widths K and N against the 1x128 blocks
and 128x128 tiles, and group patterns (one group, empty groups, sizes off the blocks, rows past the
total, negative sizes and sums past M, G up to 256), the dtypes cycled. Then ``jit`` (one compile for
every routing), ``vmap``, the default ``jax.shard_map`` (expert weights replicated: their gradient
psummed), sharded ``jax.jit``, the fallback and bad arguments.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from helpers import assert_bits_equal, deq, stable_seed
from test_gemm import assert_within, data, gemm_bound

F32, BF16 = jnp.float32, jnp.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
#: the meshes' devices: conftest's 8 simulated CPU devices, also beside a (single) GPU
CPUS = jax.devices("cpu")[:8]
MS = (1, 127, 129, 300)
KNS = ((64, 100), (128, 128), (200, 256), (512, 130))
#: group patterns; those of 5 groups share one compile per shape (the sizes are arguments)
PATTERNS = ("single", "one", "zeros", "off_blocks", "invalid", "many")
#: the common model widths (1024 to 4096, each as K and as N) at one row count, two patterns: the sweep
#: above takes every residue against the blocks, these the widths users run
WIDE_KNS = ((1024, 4096), (4096, 1024), (2048, 2048))
WIDE = [(129, K, N, p, (F32, BF16)[i % 2], BF16) for i, (K, N) in enumerate(WIDE_KNS) for p in ("zeros", "off_blocks")]


def _sizes(pattern: str, M: int, rng) -> list:
    if pattern == "single":  # G = 1
        return [M]
    if pattern == "one":  # one of 5 groups holds every row
        return [0, 0, M, 0, 0]
    if pattern == "zeros":  # empty groups, rows past the total
        return [0, M // 2, 0, M // 3, 0]
    if pattern == "off_blocks":
        return [M // 5 + 1, 3 * M // 10, 1, 0, M - (M // 5 + 1) - 3 * M // 10 - 1]
    if pattern == "invalid":  # a negative size, then sizes past M
        return [M // 3, -5, M, M, 1]
    if pattern == "many":  # G = 256, most of them empty
        sizes = np.zeros(256, np.int64)
        sizes[rng.choice(256, min(M, 20), replace=False)] = rng.integers(1, 20, min(M, 20))
        return list(sizes)
    raise ValueError(pattern)


def _sweep():
    """Every (M, (K, N), pattern), but 256 groups ("many", a compile of its own) once per M and per (K, N);
    the dtypes cycled over the shapes (the patterns of a shape share them)."""
    cases = []
    for i, M in enumerate(MS):
        for j, (K, N) in enumerate(KNS):
            n = i * len(KNS) + j
            cases += [(M, K, N, p, (F32, BF16)[n % 2], (F32, BF16)[(n // 2) % 2]) for p in PATTERNS
                      if p != "many" or i == j]
    return cases


CASES = _sweep() + WIDE


def _id(c):
    M, K, N, pattern, xt, wt = c
    return f"{M}x{K}x{N}-{pattern}-x{jnp.dtype(xt).name}-w{jnp.dtype(wt).name}"


def _bounds(sizes, M):
    start = 0
    for s in sizes:
        end = min(M, start + min(max(int(s), 0), M))
        yield start, end
        start = end


def _q(v, recipe, role, usage):
    """fp64 values of ``v`` quantized alone by the dense contract (in NumPy) with the recipe's role scheme,
    compact, one usage."""
    scheme = dataclasses.replace(recipe.scheme(role), layout="compact")
    return deq(jf.reference.quantize(np.asarray(v), scheme), usage)


def _step(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: jf.fp8_ragged_dot(x, w, sizes), x, w)
    return y, *vjp(dy)


_run = jax.jit(_step)


def test_sweep_covers_every_combination():
    few = [p for p in PATTERNS if p != "many"]
    swept = [c for c in CASES if c not in WIDE]
    assert {(c[0], c[1], c[2], c[3]) for c in swept if c[3] != "many"} == {(m, k, n, p) for m in MS for k, n in KNS
                                                                           for p in few}
    assert {w for c in WIDE for w in c[1:3]} == {1024, 2048, 4096}
    many = [(c[0], (c[1], c[2])) for c in swept if c[3] == "many"]
    assert {m for m, _ in many} == set(MS) and {kn for _, kn in many} == set(KNS)


@pytest.mark.parametrize("c", CASES, ids=_id)
def test_forward_and_gradients_within_the_bound(c):
    _check_within_the_bound(c, _run)


#: cases for each grouped-kernel configuration: every pattern but one across the shapes
CONFIG_CASES = [c for c in CASES if c[0] in (129, 300) and c[1] <= 512 and c[3] in ("off_blocks", "zeros", "many")][::3]


def _with_grouped_options(monkeypatch, options):
    """Makes the GEMM table's ragged rows choose ``options`` for every grouped GEMM on this device; returns
    a fresh jitted step (lowered with them)."""
    from jax_fp8.gemm import table

    kind = table.local_device_kind()
    monkeypatch.setitem(table.TABLE, kind, {**table.TABLE.get(kind, {}),
                                            **{k: [((1, 1, 1), "cutlass", options)] for k in ("ragged_m", "ragged_k")}})
    return jax.jit(_step)


@pytest.mark.parametrize("options", [{"config": 1}, {"config": 1, "raster": 2}, {"config": 0, "raster": 2},
                                     {"config": 2}, {"config": 3}], ids=str)
def test_every_grouped_configuration_within_the_bound(monkeypatch, options):
    """The sweep's bound on the grouped kernels' other configurations and scheduler options (chosen by the
    GEMM table's ragged rows; on the CPU the reference runs whatever they say)."""
    run = _with_grouped_options(monkeypatch, options)
    assert len(CONFIG_CASES) >= 4
    for c in CONFIG_CASES:
        _check_within_the_bound(c, run)


def test_ordered_grouped_kernels_have_the_cooperative_bits(monkeypatch):
    """The "_ordered" grouped kernels (csrc/cutlass_ordered.cuh) reorder only when the two consumer warp
    groups issue their WGMMAs: forward, dgrad and wgrad with the bits of the cooperative kernels of the
    same tile and cluster."""
    from jax_fp8.gemm.backends import cutlass

    why = cutlass.CUTLASS.unavailable("cuda") if jax.default_backend() == "gpu" else "no GPU backend"
    if why is not None:
        pytest.skip(f"CUTLASS's grouped kernels do not run here: {why}")
    # the configuration cases, and one whose CTAs walk several tiles (4096 rows in 5 groups x 1024 columns:
    # about 270 tiles of the forward, the wgrad's (5, 512, 1024) out 160)
    cases = CONFIG_CASES + [(4096, 512, 1024, "off_blocks", F32, BF16)]
    problems = [_operands(c, "ragged ordered") for c in cases]
    results = {}
    for config in ("128x128x128_c1x2_coop", "128x128x128_c1x2_coop_ordered"):  # the table is read when lowering
        index = cutlass.RAGGED_CONFIGS.index(config)
        run = _with_grouped_options(monkeypatch, {"config": index})
        with warnings.catch_warnings():
            warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)
            assert f"config = {index} : i64" in run.lower(*problems[0]).as_text(), f"not lowered with {config}"
            results[config] = [run(*p) for p in problems]
    for c, want, got in zip(cases, *results.values()):
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            assert_bits_equal(a, b, f"{_id(c)}: {name}")


def _operands(c, salt: str):
    """(x, w, group sizes, dy) of case ``c``, fresh from a seed of the case and ``salt``."""
    M, K, N, pattern, xt, wt = c
    rng = np.random.default_rng(stable_seed(salt, c))
    sizes = np.asarray(_sizes(pattern, M, rng), np.int32)
    out = jnp.result_type(xt, wt)
    return data(rng, (M, K), xt), data(rng, (len(sizes), K, N), wt), sizes, data(rng, (M, N), F32).astype(out)


def _check_within_the_bound(c, run):
    M, K, N, pattern, xt, wt = c
    x, w, sizes, dy = _operands(c, "ragged")
    out = jnp.result_type(xt, wt)
    recipe = jf.Float8BlockScaling()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)  # on an H100/H200: CUTLASS's grouped kernels
        y, dx, dw = run(x, w, sizes, dy)
    assert y.dtype == out and dx.dtype == xt and dw.dtype == wt
    x, w, dy = np.asarray(x), np.asarray(w), np.asarray(dy)  # sliced per group below: in NumPy, no compiles
    x_rows, dy_rows = _q(x, recipe, "lhs", "rowwise"), _q(dy, recipe, "grad", "rowwise")
    y, dx, dw = (np.asarray(v.astype(F32), np.float64) for v in (y, dx, dw))
    end = 0
    for g, (start, end) in enumerate(_bounds(sizes, M)):
        if end > start:
            wg = _q(w[g], recipe, "rhs", "rowwise")  # (K, N), 128x128 tiles
            exact, bound = gemm_bound(x_rows[start:end], wg.T, out)
            assert_within(y[start:end], exact, bound, f"fprop group {g}")
            exact, bound = gemm_bound(dy_rows[start:end], wg, xt)
            assert_within(dx[start:end], exact, bound, f"dgrad group {g}")
            xc = _q(x[start:end], recipe, "lhs", "colwise")  # the group's rows alone: blocks from its start
            dyc = _q(dy[start:end], recipe, "grad", "colwise")
            exact, bound = gemm_bound(xc.T, dyc.T, wt)
            assert_within(dw[g], exact, bound, f"wgrad group {g}")
        else:
            assert (dw[g] == 0).all(), f"empty group {g}: no gradient"
    assert (y[end:] == 0).all() and (dx[end:] == 0).all(), "rows in no group"


def test_close_to_lax_ragged_dot():
    """Against lax.ragged_dot of the unquantized operands: the FP8 error, a few percent of the scale."""
    rng = np.random.default_rng(stable_seed("ragged vs lax"))
    x, w = data(rng, (512, 256), F32, spread=1), data(rng, (4, 256, 384), F32, spread=1)
    sizes = jnp.asarray([100, 0, 300, 80], jnp.int32)
    y, yr = jf.fp8_ragged_dot(x, w, sizes), lax.ragged_dot(x, w, sizes, precision=lax.Precision.HIGHEST)
    assert float(jnp.abs(y - yr).max()) < 0.15 * float(jnp.abs(yr).max())
    assert float(jnp.abs(y - yr).mean()) < 0.05 * float(jnp.abs(yr).mean())  # E4M3: 3.7% measured


def test_one_compile_serves_every_routing():
    traces = []

    @jax.jit
    def step(x, w, sizes):
        traces.append(1)
        return jax.grad(lambda x, w: jf.fp8_ragged_dot(x, w, sizes).sum(), (0, 1))(x, w)

    rng = np.random.default_rng(0)
    x, w = data(rng, (256, 128), F32), data(rng, (3, 128, 128), F32)
    for sizes in ([256, 0, 0], [100, 100, 56], [0, 0, 10], [1, 2, 3]):
        dx, dw = step(x, w, jnp.asarray(sizes, jnp.int32))
        assert (np.asarray(dx)[sum(sizes):] == 0).all()
        assert all((np.asarray(dw[g]) == 0).all() == (s == 0) for g, s in enumerate(sizes))
    assert len(traces) == 1


def test_vmap_gives_each_entry_its_own_product():
    rng = np.random.default_rng(1)
    x, w = data(rng, (3, 130, 128), F32), data(rng, (3, 2, 128, 64), F32)
    sizes = jnp.asarray([[130, 0], [60, 70], [0, 5]], jnp.int32)
    grad = jax.grad(lambda x, w, s: jf.fp8_ragged_dot(x, w, s).sum(), (0, 1))
    got = jax.jit(jax.vmap(jf.fp8_ragged_dot))(x, w, sizes)
    grads = jax.jit(jax.vmap(grad))(x, w, sizes)
    one, one_grad = jax.jit(jf.fp8_ragged_dot), jax.jit(grad)
    for b in range(3):
        np.testing.assert_array_equal(got[b], one(x[b], w[b], sizes[b]))
        for g, h in zip(grads, one_grad(x[b], w[b], sizes[b])):
            np.testing.assert_array_equal(g[b], h)


def test_default_shard_map_expert_weights_replicated():
    """Each device its own tokens and routing, the experts' weights replicated: the weight gradient is
    the psum of the devices' (typed so by the default shard_map, no 8x), the rest per device."""
    mesh = jax.make_mesh((8,), ("d",), devices=CPUS)
    rng = np.random.default_rng(2)
    x, w = data(rng, (8 * 64, 128), F32), data(rng, (4, 128, 128), F32)
    sizes = rng.integers(0, 20, (8, 4)).astype(np.int32)

    def loss(x, w, s):
        return (jf.fp8_ragged_dot(x, w, s) ** 2).sum()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=(P("d"), P()))
    def grads(x, w, s):
        return jax.grad(loss, (0, 1))(x, w, s[0])  # w's cast to varying transposes to the psum

    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    dx, dw = grads(put(x, P("d")), put(w, P()), put(sizes, P("d")))
    want_dx, want_dw = [], 0
    one = jax.jit(jax.grad(loss, (0, 1)))  # one device's gradients: one compile for the 8
    with jax.default_device(CPUS[0]):  # the mesh's kind of device (a GPU's GEMM sums in another order)
        for d in range(8):
            gx, gw = one(x[64 * d:64 * (d + 1)], w, sizes[d])
            want_dx.append(gx)
            want_dw = want_dw + gw
    np.testing.assert_array_equal(np.asarray(dx), np.concatenate(want_dx))
    np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-6, atol=1e-6)


#: one jit for the cases below: the unsharded program compiles once for the four (their data differs)
_loss_and_grads = jax.jit(jax.value_and_grad(lambda x, w, s: (jf.fp8_ragged_dot(x, w, s) ** 2).sum(), (0, 1)))


@pytest.mark.parametrize("construction", ["make_mesh", "Mesh", "explicit"])
@pytest.mark.parametrize("spec", ["rows", "experts", "both"])
def test_sharded_jit_gives_the_unsharded_result(spec, construction):
    """On Auto axes (jax.make_mesh's, or a plain Mesh) and on Explicit ones, where lax.ragged_dot itself
    fails in jax 0.10 (it asks for an out_sharding): the unsharded results, the gradients typed as their
    operands."""
    axis = AxisType.Explicit if construction == "explicit" else AxisType.Auto
    mesh = (jax.sharding.Mesh(np.asarray(CPUS), ("d",)) if construction == "Mesh" else
            jax.make_mesh((8,), ("d",), axis_types=(axis,), devices=CPUS))
    rng = np.random.default_rng(stable_seed("ragged sharded", spec, construction))
    x, w = data(rng, (256, 128), F32, spread=1), data(rng, (8, 128, 256), F32, spread=1)
    sizes = rng.integers(0, 40, 8).astype(np.int32)
    with jax.default_device(CPUS[0]):  # the mesh's kind of device (a GPU's GEMM sums in another order)
        want = _loss_and_grads(x, w, sizes)
    x_spec, w_spec = dict(rows=(P("d"), P()), experts=(P(), P("d")), both=(P("d"), P("d")))[spec]
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = put(x, x_spec), put(w, w_spec), put(sizes, P())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jf.ShardingWarning)  # the grouped quantize gathers split rows
        compiled = _loss_and_grads.lower(*args).compile()  # one compile: run it, read its HLO
    got = compiled(*args)
    if construction == "explicit":
        assert [jax.typeof(v).sharding.spec for v in got[1]] == [jax.typeof(a).sharding.spec for a in args[:2]]
    # the same products; XLA may split a partitioned fp32 sum differently (a few ulps of the largest terms)
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        h = np.asarray(h)
        np.testing.assert_allclose(np.asarray(g), h, rtol=1e-5, atol=1e-5 * float(np.abs(h).max()))
    if spec == "experts":  # expert parallel: no device gathers another's expert weights (or their FP8 forms)
        hlo = compiled.as_text()
        gathered = [math.prod(int(d) for d in dims.split(",") if d) for dims in
                    re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", hlo)]
        assert max(gathered, default=0) < 128 * 256, gathered  # one expert's (K, N) weight: 128 x 256
        # each device its experts' rows: the forward's and dgrad's outputs summed over the devices
        reduced = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-reduce\(", hlo)
        assert {"256,256", "256,128"} <= set(reduced), reduced


#: meshes of the sharded-jit sweep: (shape, axis names); sizes 8 and 6, whose shard counts the widths'
#: block counts divide or not
SWEEP_MESHES = {"8": ((8,), ("a",)), "4x2": ((4, 2), ("a", "b")), "6": ((6,), ("a",)), "3x2": ((3, 2), ("a", "b"))}
#: (x, w) specs by the first and last axis: rows, experts (expert parallel), the contraction K, the
#: weights' columns N (tensor parallel), and mixes
SWEEP_SPECS = {"replicated": lambda a, b: (P(), P()), "rows": lambda a, b: (P(a), P()),
               "experts": lambda a, b: (P(), P(a)), "both": lambda a, b: (P(a), P(a)),
               "K": lambda a, b: (P(None, b), P(None, b)), "N": lambda a, b: (P(), P(None, None, b)),
               "rows+N": lambda a, b: (P(a), P(None, None, b)),
               "experts+N": lambda a, b: (P(), P(a, None, b if b != a else None))}  # one axis: experts alone
#: Mesh(...) and make_mesh with Auto axes (operands placed with device_put, a split they cannot take
#: made inside the jit by a sharding constraint); make_mesh with Explicit axes, used as it is or inside
#: jax.set_mesh (there lax.ragged_dot itself cannot type its result), operands it cannot split replicated
SWEEP_CONSTRUCTIONS = ("Mesh", "auto", "explicit", "set_mesh")


def _sharded_sweep():
    """One case for each (mesh, spec), the constructions cycled: K = 128 c + 32 o and N alike (o = 0 or 1:
    a partial block), where c walks every residue modulo the mesh's size over its specs (0 as the size
    itself or twice it, so the common widths 512, 1024, 2048 come by construction); rows and group counts
    cycled, G dividing the mesh's first axis or not."""
    cases = []
    for i, (m, (shape, _)) in enumerate(SWEEP_MESHES.items()):
        L = math.prod(shape)
        for j, spec in enumerate(SWEEP_SPECS):
            rK, rN = (i + j) % L, (5 * j + i + 1) % L  # the widths of residue 0 whole
            K = 128 * (rK or L * (1 + i % 2)) + 32 * (rK > 0 and (i + j) % 3 == 2)
            N = 128 * (rN or 2 * L) + 32 * (rN > 0 and (i + j) % 4 == 3)
            M = (256, 300, 512, 129)[j % 4] if K * N <= 1 << 20 else 130
            cases.append((m, spec, SWEEP_CONSTRUCTIONS[(i + j) % 4], M, K, N, (4, 6, 8, 3)[(j + L) % 4]))
    return cases


SHARDED_SWEEP = _sharded_sweep()


def test_sharded_sweep_covers_every_class():
    for m, (shape, _) in SWEEP_MESHES.items():
        L, mine = math.prod(shape), [c for c in SHARDED_SWEEP if c[0] == m]
        assert {c[1] for c in mine} == set(SWEEP_SPECS)
        assert {c[4] // 128 % L for c in mine} == set(range(L)) == {c[5] // 128 % L for c in mine}
        assert {c[2] for c in mine} == set(SWEEP_CONSTRUCTIONS)
    widths = {w for c in SHARDED_SWEEP for w in c[4:6]}
    assert {512, 1024, 2048} <= widths and any(w % 128 for w in widths)


@pytest.mark.parametrize("case", SHARDED_SWEEP, ids=lambda c: "-".join(map(str, c)))
def test_sharded_jit_sweep(case):
    """Forward and both gradients of a sharded program equal the one-device program's (within a
    reassociated fp32 sum), on every kind of mesh, the result's rows split by ``out_sharding`` where they
    can be; on Explicit meshes each gradient typed as its operand and the result as ``out_sharding`` asks."""
    m, spec, construction, M, K, N, G = case
    shape, names = SWEEP_MESHES[m]
    devices = CPUS[:math.prod(shape)]
    explicit = construction in ("explicit", "set_mesh")
    mesh = (jax.sharding.Mesh(np.asarray(devices).reshape(shape), names) if construction == "Mesh" else
            jax.make_mesh(shape, names, axis_types=(AxisType.Explicit if explicit else AxisType.Auto,) * len(shape),
                          devices=devices))
    rng = np.random.default_rng(stable_seed("ragged sharded sweep", case))
    x, w = data(rng, (M, K), F32, spread=1), data(rng, (G, K, N), F32, spread=1)
    sizes = rng.multinomial(M - int(rng.integers(0, 3)), np.ones(G) / G).astype(np.int32)
    with jax.default_device(CPUS[0]):
        want = _loss_and_grads(x, w, sizes)
    x_spec, w_spec = SWEEP_SPECS[spec](names[0], names[-1])
    fits = lambda a, sp: all(d is None or a.shape[i] % mesh.shape[d] == 0 for i, d in enumerate(sp))  # noqa: E731
    put = lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp if fits(a, sp) else P()))  # noqa: E731
    args = put(x, x_spec), put(w, w_spec), put(sizes, P())
    out_spec = P(names[0] if M % mesh.shape[names[0]] == 0 else None)  # the result's rows split where they can
    out_sharding = NamedSharding(mesh, out_spec)  # outside set_mesh: a constraint on Auto axes, a type on Explicit

    def program(x, w, s):
        if not explicit:  # the split an operand's shards cannot take, made as an intermediate's
            x, w = (lax.with_sharding_constraint(v, NamedSharding(mesh, sp)) for v, sp in ((x, x_spec), (w, w_spec)))

        def loss(x, w):
            y = jf.fp8_ragged_dot(x, w, s, out_sharding=out_spec if construction == "set_mesh" else out_sharding)
            if explicit:
                assert _padded(jax.typeof(y).sharding.spec, 2) == _padded(out_spec, 2)
            return (y ** 2).sum()
        return jax.value_and_grad(loss, (0, 1))(x, w)

    with warnings.catch_warnings(), (jax.set_mesh(mesh) if construction == "set_mesh" else contextlib.nullcontext()):
        warnings.simplefilter("ignore", jf.ShardingWarning)  # a rule that cannot split a dim gathers it
        compiled = jax.jit(program).lower(*args).compile()  # one compile: run it, read its HLO
        got = compiled(*args)
    if explicit:
        assert [_padded(jax.typeof(v).sharding.spec, v.ndim) for v in got[1]] == \
            [_padded(jax.typeof(a).sharding.spec, a.ndim) for a in args[:2]]
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        h = np.asarray(h)
        np.testing.assert_allclose(np.asarray(g), h, rtol=1e-5, atol=1e-5 * float(np.abs(h).max()))
    if w_spec and w_spec[0] is not None and fits(w, w_spec):  # expert parallel: no device gathers every
        # expert's weight (or its FP8 data): no all-gather result of G experts holding a whole expert or more
        gathered = [[int(d) for d in dims.split(",")] for dims in
                    re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather\(", compiled.as_text())]
        assert not [g for g in gathered if len(g) == 3 and g[0] == G and g[1] * g[2] >= K * N], gathered


def _padded(spec, ndim: int) -> tuple:
    """A PartitionSpec as a tuple of ``ndim`` entries (trailing Nones spelled out)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("axis", [AxisType.Explicit, AxisType.Auto])
def test_out_sharding_on_either_path(axis, fallback):
    """``out_sharding`` on the FP8 path and on the fallback alike: the result's type on an Explicit mesh
    (lax takes it there), its placement on an Auto one (where lax rejects it)."""
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(axis,) * 2, devices=CPUS)
    rng = np.random.default_rng(stable_seed("ragged out_sharding", str(axis), fallback))
    x, w = data(rng, (64, 128), F32), data(rng, (2, 128, 32), F32)
    sizes = np.array([30, 34], np.int32)
    kw = {"recipe": jf.MXFP8BlockScaling()} if fallback else {}
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", jf.Fp8GemmFallbackWarning)
        warnings.simplefilter("ignore", jf.ShardingWarning)  # 16-column shards: the rules gather them
        args = [jax.device_put(v, P()) for v in (x, w, sizes)]
        y = jax.jit(lambda x, w, s: jf.fp8_ragged_dot(x, w, s, out_sharding=P("a", "b"), **kw))(*args)
    assert y.sharding.spec == P("a", "b")
    if axis == AxisType.Explicit:
        assert _padded(jax.typeof(y).sharding.spec, 2) == ("a", "b")


def test_fallback_warns_once_and_says_why():
    rng = np.random.default_rng(3)
    x, w = data(rng, (64, 128), F32), data(rng, (2, 128, 32), F32)
    sizes = jnp.asarray([30, 34], jnp.int32)
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="MXFP8BlockScaling") as rec:
        y = jf.fp8_ragged_dot(x, w, sizes, recipe=jf.MXFP8BlockScaling())
    assert len(rec) == 1 and y.shape == (64, 32)
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="not float32"):
        jf.fp8_ragged_dot(x.astype(jnp.int8), w, sizes)


@pytest.mark.parametrize("bad", ["lhs_rank", "rhs_groups", "sizes_rank", "sizes_float", "lhs_none", "sizes_none",
                                 "lhs_list", "sizes_list"])
def test_bad_arguments_raise_what_lax_raises(bad):
    x, w, s = jnp.ones((10, 4)), jnp.ones((3, 4, 5)), jnp.asarray([3, 3, 4], jnp.int32)
    args = dict(lhs_rank=(x[0], w, s), rhs_groups=(x, w[:2], s), sizes_rank=(x, w, s[None]),
                sizes_float=(x, w, s.astype(F32)), lhs_none=(None, w, s), sizes_none=(x, w, None),
                lhs_list=(np.asarray(x).tolist(), w, s), sizes_list=(x, w, [3, 3, 4]))[bad]
    with pytest.raises(Exception) as want:
        lax.ragged_dot(*args)
    with pytest.raises(type(want.value), match=str(want.value)[:30].replace("(", r"\(").replace(")", r"\)")):
        jf.fp8_ragged_dot(*args)


def test_any_integer_group_sizes_as_lax():
    x, w = jnp.ones((10, 128)), jnp.ones((3, 128, 16))
    got = jf.fp8_ragged_dot(x, w, np.asarray([3, 3, 4], np.int64))
    np.testing.assert_array_equal(got, jf.fp8_ragged_dot(x, w, jnp.asarray([3, 3, 4], jnp.int32)))


F16 = jnp.float16


@pytest.mark.parametrize("xt,wt,pref", [(F16, F16, None), (F32, F32, F16), (F16, F32, F16), (F32, F16, None)],
                         ids=lambda v: "none" if v is None else jnp.dtype(v).name)
def test_float16_results_are_the_float32_ones_rounded(xt, wt, pref):
    """Results of lax.ragged_dot's dtype where the kernels give float32 or bfloat16 only: a float16 result
    (and float16 gradients) is the float32 one rounded, bit for bit, forward and backward. (The float32
    results are held to the bound by the sweep.)"""
    rng = np.random.default_rng(stable_seed("ragged f16", jnp.dtype(xt).name, jnp.dtype(wt).name, str(pref)))
    M, K, N, sizes = 300, 256, 136, jnp.asarray([100, 0, 150, 20], jnp.int32)  # 30 rows past the total
    x, w = data(rng, (M, K), xt, spread=2), data(rng, (4, K, N), wt, spread=2)
    out = jax.eval_shape(lambda a, b: lax.ragged_dot(a, b, sizes, preferred_element_type=pref), x, w).dtype
    dy = data(rng, (M, N), F32, spread=2).astype(out)

    def step(dy, pref):
        y, vjp = jax.vjp(lambda a, b: jf.fp8_ragged_dot(a, b, sizes, preferred_element_type=pref), x, w)
        return y, *vjp(dy)

    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)
        got, want = jax.jit(step, static_argnums=1)(dy, pref), jax.jit(step, static_argnums=1)(dy.astype(F32), F32)
    assert [v.dtype for v in got] == [out, xt, wt]
    for name, g, v in zip(("y", "dx", "dw"), got, want):
        assert_bits_equal(g, v.astype(g.dtype), name)


def test_result_dtypes_the_grouped_gemm_cannot_give_fall_back():
    x, w, sizes = jnp.ones((8, 128)), jnp.ones((2, 128, 16)), jnp.asarray([4, 4], jnp.int32)
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="result dtype int32") as rec:
        y = jf.fp8_ragged_dot(x, w, sizes, preferred_element_type=jnp.int32)
    assert len(rec) == 1 and y.dtype == jnp.int32 and y.shape == (8, 16)


def test_wide_group_sizes_count_rows_not_their_low_bits():
    """Sizes of dtypes wider than int32 are cut to [0, M] before they are used as int32: 2**32 - 1 rows is
    every row (as lax.ragged_dot has it), not -1."""
    rng = np.random.default_rng(stable_seed("ragged wide sizes"))
    x, w = data(rng, (300, 128), F32), data(rng, (3, 128, 16), F32)
    want = jf.fp8_ragged_dot(x, w, jnp.asarray([300, 0, 0], jnp.int32))
    assert_bits_equal(jf.fp8_ragged_dot(x, w, jnp.asarray([2**32 - 1, 0, 0], jnp.uint32)), want, "uint32")
    with jax.enable_x64(True):
        for sizes in ([2**31, 0, 0], [2**32 + 10, 5, 0]):
            assert_bits_equal(jf.fp8_ragged_dot(x, w, jnp.asarray(sizes, jnp.int64)), want, str(sizes))
        got = jf.fp8_ragged_dot(x, w, jnp.asarray([-(2**32) + 5, 300, 0], jnp.int64))  # negative: 0 rows
        assert_bits_equal(got, jf.fp8_ragged_dot(x, w, jnp.asarray([0, 300, 0], jnp.int32)), "negative int64")


def test_numpy_operands_take_jax_dtypes():
    """float64 NumPy operands without x64 are float32 to jax, as to lax.ragged_dot: the FP8 path, no warning."""
    rng = np.random.default_rng(stable_seed("ragged numpy"))
    x, w, sizes = rng.standard_normal((64, 128)), rng.standard_normal((2, 128, 16)), np.asarray([30, 34])
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)
        got = jf.fp8_ragged_dot(x, w, sizes)
    assert_bits_equal(got, jf.fp8_ragged_dot(jnp.asarray(x, F32), jnp.asarray(w, F32), jnp.asarray(sizes)))


def test_vmap_over_no_entries():
    """A batch of no entries: an empty result of lax.ragged_dot's shape (every operand batched, or the rhs)."""
    x, sizes = jnp.zeros((8, 128)), jnp.asarray([4, 4], jnp.int32)
    y = jax.vmap(jf.fp8_ragged_dot)(jnp.zeros((0, 8, 128)), jnp.zeros((0, 2, 128, 16)), jnp.zeros((0, 2), jnp.int32))
    assert y.shape == (0, 8, 16) and y.dtype == F32
    y = jax.vmap(jf.fp8_ragged_dot, in_axes=(None, 0, None))(x, jnp.zeros((0, 2, 128, 16)), sizes)
    assert y.shape == (0, 8, 16)


def test_a_derivative_of_a_derivative_says_what_is_supported():
    x, w, sizes = jnp.ones((8, 128)), jnp.ones((2, 128, 16)), jnp.asarray([4, 4], jnp.int32)
    inner = jax.grad(lambda a: (jf.fp8_ragged_dot(a, w, sizes) ** 2).sum())
    with pytest.raises(TypeError, match=r"fp8_ragged_dot: .*jax\.grad of jax\.grad"):
        jax.grad(lambda a: inner(a).sum())(x)


def test_the_grouped_kernels_say_what_they_cannot_take(monkeypatch):
    """Where CUTLASS's grouped kernels cannot run a call, the reason names the rule it breaks (the lowering
    then runs the reference, with one Fp8GemmFallbackWarning saying so)."""
    from jax_fp8.gemm.backends import cutlass

    monkeypatch.setattr(cutlass, "unavailable", lambda *a, **k: "no CUDA device")  # the dense kernels' reason
    assert cutlass.ragged_unavailable("m", [], jnp.bfloat16) == "no CUDA device"
    monkeypatch.setattr(cutlass, "unavailable", lambda *a, **k: None)
    monkeypatch.setattr(cutlass, "_MODULE", (type("M", (), {"ragged_configs": cutlass.RAGGED_CONFIGS}), 0, ()))
    f8 = lambda *shape, dt=jnp.float8_e4m3fn: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    f32 = jax.ShapeDtypeStruct((1,), jnp.float32)
    cases = [("m", (f8(64, 128), f32, f8(2, 32, 128)), jnp.bfloat16, None),
             ("m", (f8(64, 120), f32, f8(2, 32, 120)), jnp.bfloat16, "K = 120 is not a multiple of 16"),
             ("m", (f8(64, 128), f32, f8(2, 36, 128)), jnp.bfloat16, "N = 36 is not a multiple of 8"),
             ("m", (f8(64, 128), f32, f8(2, 36, 128)), jnp.float32, None),
             ("k", (f8(130, 96), f32, f8(64, 96)), jnp.float32, "R = 130 is not a multiple of 4"),
             ("m", (f8(64, 128, dt=jnp.float8_e5m2), f32, f8(2, 32, 128)), jnp.bfloat16, "float8_e4m3fn")]
    for kind, avals, out, want in cases:
        why = cutlass.ragged_unavailable(kind, avals, out)
        assert why == want if want is None else want in why, (kind, avals, why)

def test_the_grouped_kernels_options_come_from_the_table(monkeypatch):
    """The grouped kernels' options: the defaults where the GPU's table has no grouped rows, else the row
    nearest to one group's mean problem for its kind; an option out of range raises, naming it."""
    from jax_fp8.gemm import table
    from jax_fp8.gemm.backends import cutlass

    monkeypatch.setitem(table.TABLE, "GPU X", {
        "ragged_m": [((512, 2048, 7168), "cutlass", {"config": 2}),
                     ((2048, 2048, 7168), "cutlass", {"config": 1, "raster": 2})],
        "ragged_k": [((7168, 2048, 512), "cutlass", {"raster": 2}),
                     ((7168, 2048, 2048), "cutlass", {"config": 2})]})
    assert cutlass.ragged_options("m", 16384, 2048, 7168, 8, device_kind="GPU Y") == cutlass.DEFAULT_RAGGED_OPTIONS
    # the same rows in all: 2048 rows per group at 8 groups, 512 at 32
    assert cutlass.ragged_options("m", 16384, 2048, 7168, 8, device_kind="GPU X") == {"config": 1, "raster": 2}
    assert cutlass.ragged_options("m", 16384, 2048, 7168, 32, device_kind="GPU X") == {"config": 2, "raster": 0}
    assert cutlass.ragged_options("k", 7168, 2048, 16384, 8, device_kind="GPU X") == {"config": 2, "raster": 0}
    assert cutlass.ragged_options("k", 7168, 2048, 16384, 32, device_kind="GPU X") == {"config": 0, "raster": 2}
    assert cutlass.ragged_options("k", 7168, 2048, 16383, 32, device_kind="GPU X") == {"config": 0, "raster": 2}
    for bad, match in [({"config": len(cutlass.RAGGED_CONFIGS)}, "config must be in"), ({"swizzle": 8}, "unknown options"),
                       ({"raster": 5}, "raster must be"), ({"cluster": 2}, "unknown options")]:
        monkeypatch.setitem(table.TABLE, "GPU Z", {"ragged_m": [((1, 1, 1), "cutlass", bad)]})
        with pytest.raises(ValueError, match=match):
            cutlass.ragged_options("m", 128, 128, 128, device_kind="GPU Z")
    table.load({"device_kind": "GPU W", "rows": {"ragged_k": [[[1, 2, 3], "cutlass", {"config": 1}]]}})
    try:
        assert cutlass.ragged_options("k", 1, 2, 3, device_kind="GPU W")["config"] == 1
    finally:
        del table.TABLE["GPU W"]


@pytest.mark.parametrize("offset,Gl", [(0, 5), (1, 3), (3, 2), (4, 3), (-1, 2), (5, 2)])
def test_group_offset_takes_a_shards_groups(offset, Gl):
    """``jf_fp8_ragged_gemm`` over the Gl groups from ``group_offset`` (an expert-parallel shard's experts)
    gives the whole call's rows of those groups, the others exactly 0: the same products, summed in an
    order ``lax.ragged_dot`` may choose per grouping (jax 0.12's differs by an ulp), so within twice the
    GEMM bound of each group (each side within it of the exact product); and the whole call's weight
    gradients of those groups (groups past G: 0) bit for bit (one product per block slot either way)."""
    from jax_fp8.gemm.ragged_primitive import ragged_gemm
    from jax_fp8.quantization import quantize_each, quantize_grouped

    rng = np.random.default_rng(stable_seed("group offset", offset, Gl))
    M, K, N, G = 300, 256, 128, 5
    sizes = jnp.asarray([70, 0, 129, 1, 90], jnp.int32)
    x, dy, w = (data(rng, shape, F32) for shape in ((M, K), (M, N), (G, K, N)))
    recipe = jf.Float8BlockScaling()
    xq, dyq = quantize_grouped(x, sizes, recipe.scheme("lhs")), quantize_grouped(dy, sizes, recipe.scheme("grad"))
    wd, ws = quantize_each(w, recipe.scheme("rhs", rowwise=False))["colwise"]
    picks = np.clip(offset + np.arange(Gl), 0, G - 1)  # a shard's experts (past G: any weight, never read)
    local = np.arange(Gl) + offset
    rows = np.repeat(np.arange(G), np.asarray(sizes))
    mine = np.isin(np.pad(rows, (0, M - len(rows)), constant_values=G), local)[:, None]
    fwd = lambda b, s, o, gl: ragged_gemm(*xq["rowwise"], b, s, sizes, o, kind="m", out_dtype=F32)  # noqa: E731
    got, whole = (np.asarray(v, np.float64) for v in (fwd(wd[picks], ws[picks], offset, Gl), fwd(wd, ws, 0, G)))
    assert (got[~mine[:, 0]] == 0).all(), "rows of other shards' groups"
    x_rows = _q(x, recipe, "lhs", "rowwise")
    for g, (start, end) in enumerate(_bounds(np.asarray(sizes), M)):
        if g in local and end > start:
            _, bound = gemm_bound(x_rows[start:end], _q(w[g], recipe, "rhs", "rowwise").T, F32)
            assert_within(got[start:end], whole[start:end], 2 * bound, f"M-grouped, group {g}")
    dw = lambda o, gl: ragged_gemm(*xq["colwise"], *dyq["colwise"], sizes, o, kind="k", rows=M,  # noqa: E731
                                   groups_out=gl, out_dtype=F32)
    whole = np.asarray(dw(0, G))
    want = np.where(((local >= 0) & (local < G))[:, None, None], whole[np.clip(local, 0, G - 1)], 0)
    assert_bits_equal(np.asarray(dw(offset, Gl)), want, "K-grouped")
