"""``jf_quantize_grouped`` (rows in ``lax.ragged_dot``'s groups, quantized with the columnwise 128-row
blocks restarting at every group start): the kernel against its contract
(``jax_fp8.contracts.quantize_grouped_usages``) evaluated on NumPy inputs, bit for bit; the contract
against the dense contract applied to each group's rows alone (the layout checked independently of
``jax_fp8.groups``); ``jit`` with one compile for every routing, ``vmap``, the default ``jax.shard_map``
and sharded ``jax.jit``; bad arguments. Long walks: inputs large enough that the CUDA kernels' CTAs each
take several work items, every usage alone and both, batches.

The sweep is generated: every row count of ``MS`` (residues against the 128-row blocks) meets every
width of ``KS`` (residues against the 1x128 blocks; the common widths) and every group pattern of
``PATTERNS`` (zeros, one group holding every row, sizes off the blocks, rows past the total, negative
sizes and sizes summing past M, many groups), the input dtype and the FP8 dtype cycled over the cases.
Data is fresh per case with zeros, subnormals, huge values, +-inf and NaN planted.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_fp8 import ShardingWarning, contracts, groups
from jax_fp8.primitives import quantize_grouped_p
from jax_fp8.quantization import quantize_grouped
from jax_fp8.scheme import GEMM_SCALE_PAD, Scheme
from helpers import FP8_DTYPES, IN_DTYPES, assert_bits_equal, random_input, stable_seed

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
#: the meshes' devices: conftest's 8 simulated CPU devices, also beside a (single) GPU
CPUS = jax.devices("cpu")[:8]
MS = (1, 127, 128, 129, 300, 513)
KS = (1, 100, 128, 130, 512, 1024)


def _pattern(name: str, M: int, rng) -> list:
    """Group sizes of a named pattern for M rows."""
    if name == "one":  # one group holds every row
        return [M]
    if name == "zeros":  # empty groups around the rows, some rows past the total
        return [0, M // 2, 0, 0, M // 3, 0]
    if name == "off_blocks":  # sizes that are no multiples of 128
        return [M // 5 + 1, 3 * M // 10, 1, M // 4]
    if name == "invalid":  # a negative size and sizes summing past M
        return [M // 3, -7, M, M]
    if name == "many":  # more groups than blocks, sizes 0..9
        return list(rng.integers(0, 10, 40))
    raise ValueError(name)


PATTERNS = ("one", "zeros", "off_blocks", "invalid", "many")


def _sweep():
    cases = []
    for i, M in enumerate(MS):
        for j, K in enumerate(KS):
            for p, pattern in enumerate(PATTERNS):
                n = (i * len(KS) + j) * len(PATTERNS) + p
                cases.append((M, K, pattern, IN_DTYPES[n % 3], FP8_DTYPES[(n // 3) % 2], bool((n // 6) % 2)))
    return cases


CASES = _sweep()


def _id(c):
    M, K, pattern, dt, fp8, pow2 = c
    return f"{M}x{K}-{pattern}-{jnp.dtype(dt).name}-{jnp.dtype(fp8).name}-pow2{int(pow2)}"


def _scheme(fp8, pow2=True, saturate_inf=False, rowwise=True, colwise=True):
    return Scheme("blockwise", fp8, rowwise=rowwise, colwise=colwise, block=(1, 128), pow2_scales=pow2,
                  layout="gemm_ready", saturate_inf=saturate_inf)


def _case_data(c):
    M, K, pattern, dt, fp8, pow2 = c
    rng = np.random.default_rng(stable_seed("quantize_grouped", c))
    x = random_input(rng, (M, K), dt)
    return x, np.asarray(_pattern(pattern, M, rng), np.int32)


def test_sweep_covers_every_combination():
    assert {(c[0], c[1], c[2]) for c in CASES} == {(m, k, p) for m in MS for k in KS for p in PATTERNS}
    assert {c[3] for c in CASES} == set(IN_DTYPES) and {c[4] for c in CASES} == set(FP8_DTYPES)


@pytest.mark.parametrize("c", CASES, ids=_id)
def test_kernel_matches_contract_bitwise(c):
    x, sizes = _case_data(c)
    scheme = _scheme(c[4], c[5], saturate_inf=bool(len(sizes) % 2))
    got = jax.jit(lambda x, s: quantize_grouped_p.bind(x[None], s[None], scheme=scheme))(x, sizes)
    want = contracts.quantize_grouped_usages(np.asarray(x), sizes, scheme=scheme)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g[0], w, f"output {i}")


def _dense(x, scheme):
    """The dense contract's (rowwise data, scales, colwise data, scales) of x alone, compact grids."""
    data_r, s_r, data_c, s_c = contracts.quantize_usages(x[None], scheme=scheme)
    M, K = x.shape
    return data_r[0], s_r[0][:, :M].T, data_c[0].T, s_c[0][:, :K]


@pytest.mark.parametrize("c", CASES[::4], ids=_id)
def test_contract_is_the_dense_contract_per_group(c):
    """Each group's rows quantized alone by the dense contract give the same bytes and scales, at the
    places the layout doc names: rows [start, end) of the rowwise data, columnwise columns from the
    group's start column (the groups before it, each rounded up to 16 columns), scale rows from the
    group's first slot; every other byte 0."""
    x, sizes = _case_data(c)
    x = np.asarray(x)
    M, K = x.shape
    scheme = _scheme(c[4], c[5])
    data_r, s_r, data_c, s_c = contracts.quantize_grouped_usages(x, sizes, scheme=scheme)
    data_c = data_c.T.copy()
    assert data_c.shape == (groups.col_count(M, len(sizes)), K)
    start, slot, col = 0, 0, 0
    for size in sizes:
        end = min(M, start + min(max(int(size), 0), M))
        if end > start:
            dr, sr, dc, sc = _dense(x[start:end], scheme)
            n = -(-(end - start) // 128)
            assert_bits_equal(data_r[start:end], dr, "rowwise data")
            assert_bits_equal(s_r[:, start:end].T, sr, "rowwise scales")
            assert_bits_equal(data_c[col:col + end - start], dc, "columnwise data")
            data_c[col:col + end - start] = 0  # checked: what is left must be 0
            assert_bits_equal(s_c[slot:slot + n, :K], sc, "columnwise scales")
            slot += n
            col += -(-(end - start) // 16) * 16
        start = end
    assert (data_r[start:] == 0).all() and (data_c == 0).all(), "rows in no group, columns of none: data 0"
    assert (s_r[:, start:] == GEMM_SCALE_PAD).all() and (s_c[slot:] == GEMM_SCALE_PAD).all()
    assert (s_c[:, K:] == GEMM_SCALE_PAD).all()
    assert s_c.shape[0] == groups.block_slots(M, len(sizes), 128) >= slot


@pytest.mark.parametrize("M,G", [(1, 1), (127, 1), (128, 2), (129, 3), (300, 40), (513, 7)])
def test_block_slots_bound_every_routing(M, G):
    """No group sizes need more slots than block_slots(M, G) or more columns than col_count(M, G) (each
    group's columns rounded up to 16), and the worst routing (G - 1 groups of one row, one of the rest)
    needs them all."""
    S, Mc = groups.block_slots(M, G, 128), groups.col_count(M, G)
    rng = np.random.default_rng(stable_seed("slots", M, G))
    worst = [1] * (G - 1) + [M - (G - 1)] if M >= G else [1] * M + [0] * (G - M)
    for sizes in [worst] + [list(rng.integers(-3, M + 1, G)) for _ in range(50)]:
        _, _, rows = groups.slot_blocks(np.asarray(sizes, np.int32), M, 128)
        starts, ends = groups.group_bounds(np.asarray(sizes, np.int32), M)
        assert rows.sum() == ends[-1] and (rows > 0).sum() == sum(-(-(e - s) // 128) for s, e in zip(starts, ends))
        assert len(rows) == S
        cols = sum(-(-(e - s) // 16) * 16 for s, e in zip(starts, ends))
        assert cols <= Mc and Mc % 16 == 0
        if sizes is worst:
            assert Mc == cols, (Mc, cols)
    _, _, rows = groups.slot_blocks(np.asarray(worst, np.int32), M, 128)
    assert (rows > 0).sum() == S


# Long walks (the CUDA kernels' CTAs take several items each: a one-wave grid has a few hundred CTAs),
# 16-bit inputs with K % 4 == 0 (vector loads), each usage alone and both, one matrix and a batch of two:
# generated as usage x input dtype x batch, each case its own rows (off the 128-row blocks) and routing.
USAGES = ("both", "rowwise", "colwise")
LONG = [(u, dt, B) for u in USAGES for dt in (jnp.bfloat16, jnp.float16) for B in (1, 2)]


@pytest.mark.parametrize("usage,dt,B", LONG, ids=lambda v: getattr(v, "__name__", str(v)))
def test_kernel_matches_contract_on_long_walks(usage, dt, B):
    rng = np.random.default_rng(stable_seed("quantize_grouped long", usage, jnp.dtype(dt).name, B))
    M, K = int(rng.integers(1500, 2048)), 4096
    x = random_input(rng, (B, M, K), dt)
    # per matrix: 8 or 40 groups, zeros among them, some rows past the total
    G = 8 if B == 1 else 40
    sizes = np.stack([np.diff(np.sort(np.r_[0, rng.integers(0, M - 50, G - 1), M - 50])) for _ in range(B)])
    sizes[:, 1] = 0
    scheme = _scheme(jnp.float8_e4m3fn, rowwise=usage != "colwise", colwise=usage != "rowwise")
    got = jax.jit(lambda x, s: quantize_grouped_p.bind(x, s, scheme=scheme))(x, sizes.astype(np.int32))
    for b in range(B):
        want = contracts.quantize_grouped_usages(np.asarray(x[b]), sizes[b].astype(np.int32), scheme=scheme)
        assert len(got) == len(want) == (2 if usage != "both" else 4)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bits_equal(g[b], w, f"matrix {b}, output {i}")


def test_one_compile_serves_every_routing():
    traces = []

    @jax.jit
    def f(x, s):
        traces.append(1)
        return quantize_grouped(x, s, _scheme(jnp.float8_e4m3fn))

    x = jnp.asarray(np.random.default_rng(0).standard_normal((300, 256)), jnp.float32)
    for sizes in ([300, 0], [100, 200], [0, 0], [1, 299]):
        s = jnp.asarray(sizes, jnp.int32)
        got = f(x, s)
        want = contracts.quantize_grouped_usages(np.asarray(x), np.asarray(s), scheme=_scheme(jnp.float8_e4m3fn))
        assert_bits_equal(got["colwise"][1], want[3], str(sizes))
    assert len(traces) == 1


def test_vmap_maps_x_and_the_sizes():
    rng = np.random.default_rng(1)
    x = random_input(rng, (3, 200, 130), jnp.float32)
    sizes = np.asarray([[200, 0], [50, 60], [0, 7]], np.int32)
    scheme = _scheme(jnp.float8_e4m3fn)
    f = lambda x, s: tuple(v for pair in quantize_grouped(x, s, scheme).values() for v in pair)  # noqa: E731
    for in_axes, s in (((0, 0), sizes), ((0, None), sizes[1])):
        got = jax.vmap(f, in_axes=in_axes)(x, s)
        for b in range(3):
            want = contracts.quantize_grouped_usages(np.asarray(x[b]), sizes[b] if in_axes[1] == 0 else s,
                                                     scheme=scheme)
            for g, w in zip(got, want):
                assert_bits_equal(g[b], w)


def test_default_shard_map_and_sharded_jit():
    mesh = jax.make_mesh((8,), ("d",), devices=CPUS)
    rng = np.random.default_rng(2)
    x = random_input(rng, (8, 136, 1024), jnp.float32)  # 128 columns a device: whole 1x128 blocks
    sizes = rng.integers(0, 60, (8, 3)).astype(np.int32)
    scheme = _scheme(jnp.float8_e4m3fn)
    flat = lambda x, s: [v for pair in quantize_grouped(x, s, scheme).values() for v in pair]  # noqa: E731
    want = [[np.asarray(w) for w in contracts.quantize_grouped_usages(np.asarray(x[b]), sizes[b], scheme=scheme)]
            for b in range(8)]
    # shard_map, default checks: each device its own tokens and its own routing
    per_device = jax.jit(jax.shard_map(lambda x, s: [v[None] for v in flat(x[0], s[0])], mesh=mesh,
                                       in_specs=(P("d"), P("d")), out_specs=P("d")))
    got = jax.device_get(per_device(*(jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x, sizes))))
    for b in range(8):
        for g, w in zip(got, want[b]):
            assert_bits_equal(g[b], w)
    # sharded jit (Explicit and Auto axes, and a plain Mesh): the last dim split stays split, the rows are
    # gathered with a warning; each mesh its own row count (so its own compile, whose partitioner warns)
    meshes = (mesh, jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,), devices=CPUS),
              jax.sharding.Mesh(np.asarray(CPUS), ("d",)))
    for b, (mesh, rows) in enumerate(zip(meshes, (136, 128, 120))):
        x_b = x[b, :rows]
        want = contracts.quantize_grouped_usages(np.asarray(x_b), sizes[b], scheme=scheme)
        s_b = jax.device_put(sizes[b], NamedSharding(mesh, P()))
        xs = jax.device_put(x_b, NamedSharding(mesh, P(None, "d")))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShardingWarning)
            got = jax.jit(flat)(xs, s_b)
        for g, w in zip(got, want):
            assert_bits_equal(g, w)
        xs = jax.device_put(x_b, NamedSharding(mesh, P("d", None)))
        with pytest.warns(ShardingWarning, match="rows"):
            got = jax.jit(flat)(xs, s_b)
        for g, w in zip(got, want):
            assert_bits_equal(g, w)


@pytest.mark.parametrize("bad", ["rank", "sizes_dtype", "sizes_batch", "scheme"])
def test_bad_arguments_raise_clear_errors(bad):
    x = jnp.zeros((2, 64, 128), jnp.float32)
    s = jnp.zeros((2, 3), jnp.int32)
    scheme = _scheme(jnp.float8_e4m3fn)
    args = dict(rank=(x[0], s), sizes_dtype=(x, s.astype(jnp.float32)), sizes_batch=(x, s[:1]), scheme=(x, s))[bad]
    if bad == "scheme":
        scheme = Scheme("blockwise", jnp.float8_e4m3fn, rowwise=True, colwise=True, block=(128, 128), layout="gemm_ready")
    with pytest.raises(ValueError, match="jf_quantize_grouped"):
        quantize_grouped_p.bind(*args, scheme=scheme)
