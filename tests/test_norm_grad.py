"""``jf_norm_grad`` (the backward of RMSNorm and LayerNorm): the kernel against its contract
(``jax_fp8.producers.norm_grad``) evaluated on NumPy inputs, bit for bit; the contract against float64
math within a derived bound, and its ``jax.numpy`` evaluation under ``jit`` against NumPy's; the N-D
wrapper against the XLA backward the norms' VJPs run; ``vmap``, sharded ``jax.jit`` and the default
``jax.shard_map``; shape errors.

The sweep is generated: every row length of ``KS`` (residues against the row sums' 256 lanes and the
8-element vectors) meets every row count of ``MS`` (residues against the column sums' 64-row blocks), per
norm, with the x / dy / gamma dtypes cycled over the cases. Data is fresh per case: rows over many
binades with zeros, subnormals, huge values, +-inf and NaN planted (test_producers' inputs), the
statistics the forward computes from them.
"""
from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_fp8 import ShardingWarning, producers
from jax_fp8.primitives import norm_grad_p
from jax_fp8.quantization import norm_grad
from helpers import IN_DTYPES, assert_bits_equal, stable_seed
from test_producers import _gamma, _values

F32, BF16 = jnp.float32, jnp.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
U32 = 2.0 ** -24

NORMS = producers.NORMS
KS = (1, 7, 8, 100, 255, 256, 257, 512, 1000, 1024, 2048, 4096)  # 512..4096: common widths
MS = (1, 63, 64, 65, 129, 300)  # residues against the 64-row blocks of the column sums


def _sweep():
    """(norm, B, M, K, x dtype, dy dtype, gamma dtype) cases: every (K, M) pair per norm, dtypes cycled."""
    cases = []
    for norm in NORMS:
        for i, K in enumerate(KS):
            for j, M in enumerate(MS):
                n = i * len(MS) + j
                cases.append((norm, 1 + n % 2, M, K, IN_DTYPES[n % 3], IN_DTYPES[(n // 3) % 3], (F32, BF16)[(n // 9) % 2]))
    return cases


CASES = _sweep()


def _case_id(c):
    norm, B, M, K, xt, dt, gt = c
    return f"{norm}-{B}x{M}x{K}-x{jnp.dtype(xt).name}-dy{jnp.dtype(dt).name}-g{jnp.dtype(gt).name}"


def test_sweep_covers_every_combination():
    for norm in NORMS:
        mine = [c for c in CASES if c[0] == norm]
        assert {(c[3], c[2]) for c in mine} == {(k, m) for k in KS for m in MS}
        assert {jnp.dtype(c[4]) for c in mine} == {jnp.dtype(d) for d in IN_DTYPES} == {jnp.dtype(c[5]) for c in mine}
        assert {c[1] for c in mine} == {1, 2}


def _stats(norm, x, eps=1e-6):
    """The forward's statistics of x (NumPy: what the forward kernel stores)."""
    if norm == "rmsnorm":
        return producers.rms_norm_rstd(x, eps)
    return np.stack(producers.layer_norm_stats(x, eps), axis=-1)


def _case_inputs(case):
    norm, B, M, K, xt, dt, gt = case
    rng = np.random.default_rng(stable_seed("norm grad", case))
    x = _values(rng, (B, M, K), xt)
    return [x, _gamma(rng, K, gt), _stats(norm, x), _values(rng, (B, M, K), dt)]


def _bind(norm):
    return jax.jit(lambda *a: norm_grad_p.bind(*a, norm=norm))


def _want(norm, args):
    dx, *sums = producers.norm_grad(norm, *args)
    return dx, np.stack(sums)


# ---- 1. the kernel against the contract, bit for bit ---------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_contract(case):
    norm = case[0]
    args = _case_inputs(case)
    dx, sums = _bind(norm)(*args)
    want_dx, want_sums = _want(norm, args)
    assert dx.dtype == args[0].dtype and dx.shape == args[0].shape
    assert sums.dtype == np.float32 and sums.shape == (2 if norm == "layernorm" else 1, case[3])
    assert_bits_equal(dx, want_dx, f"{_case_id(case)} dx")
    assert_bits_equal(sums, want_sums, f"{_case_id(case)} column sums")
    # not degenerate: given rows to spare (a planted inf or NaN poisons its row), most dx values are finite
    # and nonzero
    if case[1] * case[2] >= 60 and case[3] > 1:  # (a LayerNorm of one column has dx = 0)
        finite = np.isfinite(np.asarray(want_dx, np.float32)) & (np.asarray(want_dx, np.float32) != 0)
        assert finite.sum() > finite.size // 3, (finite.sum(), finite.size)


def test_column_sums_are_the_documented_order():
    """The contract's column sums by hand: blocks of GRAD_ROWS rows of each batch entry from +0, then the
    blocks from +0 in order; another order gives other bits on this data."""
    rng = np.random.default_rng(stable_seed("column order"))
    B, M, K = 2, 150, 33
    t = (rng.standard_normal((B, M, K)) * np.exp2(rng.integers(-20, 20, (B, M, 1)))).astype(np.float32)
    total = np.zeros(K, np.float32)
    for b in range(B):
        for m0 in range(0, M, producers.GRAD_ROWS):
            part = np.zeros(K, np.float32)
            for r in range(m0, min(M, m0 + producers.GRAD_ROWS)):
                part = part + t[b, r]
            total = total + part
    assert_bits_equal(producers.column_sum(t), total, "column sums")
    flat = np.zeros(K, np.float32)
    for r in t.reshape(-1, K):
        flat = flat + r
    assert (flat != total).any()


# ---- 2. the contract: float64 math within its bound; jax.numpy under jit as NumPy ----------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("K", (100, 1024, 4096))
def test_contract_within_derived_bound(norm, K):
    """Against float64 math on the same float32 inputs and statistics. Each float32 op rounds once (relative
    error <= u); a sum of n terms in any order is within (n - 1) u sum|terms| (first order), n - 1 the most
    additions one term goes through: K / 256 + 8 for the row sums, 64 + blocks for the column sums. So
    |c - c64| <= (n + 2) u mean|terms| for c1, c2 (the products and the 1/K scale), and dx, whose rounded
    ops add 4 u on |dxhat| and |xhat c2|, is within rstd ((4 u (|dxhat| + |xhat c2|) + |xhat| dc2 + dc1)."""
    rng = np.random.default_rng(stable_seed("norm grad bound", norm, K))
    B, M = 2, 300
    x = (rng.standard_normal((B, M, K)) * 3 + (2 if norm == "layernorm" else 0)).astype(np.float32)
    dy = rng.standard_normal((B, M, K)).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    stats = _stats(norm, x)
    dx, dgamma, *dbeta = producers.norm_grad(norm, x, g, stats, dy)
    x64, dy64, g64, s64 = x.astype(np.float64), dy.astype(np.float64), g.astype(np.float64), stats.astype(np.float64)
    mean, rstd = (s64[..., 0:1], s64[..., 1:2]) if norm == "layernorm" else (0.0, s64[..., None])
    xhat = (x64 - mean) * rstd
    dxhat = dy64 * g64
    c1 = dxhat.mean(-1, keepdims=True) if norm == "layernorm" else 0.0
    c2 = (dxhat * xhat).mean(-1, keepdims=True)
    n_row = K / 256 + 8 + 2
    dc1 = n_row * U32 * np.abs(dxhat).mean(-1, keepdims=True) if norm == "layernorm" else 0.0
    dc2 = n_row * U32 * np.abs(dxhat * xhat).mean(-1, keepdims=True)
    bound = rstd * (4 * U32 * (np.abs(dxhat) + np.abs(xhat * c2)) + np.abs(xhat) * dc2 + dc1) * (1 + 1e-6)
    err = np.abs(dx.astype(np.float64) - rstd * (dxhat - c1 - xhat * c2))
    assert (err <= bound).all(), float((err / bound).max())
    assert err.max() > 0  # float32 math: not the float64 result
    n_col = producers.GRAD_ROWS + B * -(-M // producers.GRAD_ROWS) + 1
    for got, terms in zip([dgamma] + dbeta, [dy64 * xhat, dy64]):
        exact = terms.sum((0, 1))
        col_bound = n_col * U32 * np.abs(terms).sum((0, 1)) * (1 + 1e-6)
        assert (np.abs(got - exact) <= col_bound).all(), float((np.abs(got - exact) / col_bound).max())


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_jnp_contract_under_jit_matches_numpy(norm, dtype):
    """The contract where no kernel runs: jax.numpy under jit on XLA:CPU gives NumPy's bits (normal-range
    data: XLA's CPU runtime flushes subnormals)."""
    rng = np.random.default_rng(stable_seed("norm grad jnp", norm, dtype))
    B, M, K = 2, 130, 1000
    x = (rng.standard_normal((B, M, K)) * 2 + 1).astype(dtype)
    dy = rng.standard_normal((B, M, K)).astype(dtype)
    g = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    args = [x, g, _stats(norm, x), dy]
    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.jit(lambda *a: producers.norm_grad(norm, *a))(*args)
    for a, b in zip(got, producers.norm_grad(norm, *args)):
        assert_bits_equal(a, b, "jnp vs numpy")


# ---- 3. the N-D wrapper, against XLA's norm backward --------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_wrapper_takes_nd_inputs_and_agrees_with_xla(norm):
    """quantization.norm_grad on (..., K) inputs: the contract's bits on the rows, and within float32
    rounding of the XLA backward the VJPs of jf.rms_norm / jf.layer_norm run (fused._norm_grad)."""
    from jax_fp8.fused import _norm_grad

    rng = np.random.default_rng(stable_seed("norm wrapper", norm))
    x = (rng.standard_normal((3, 50, 384)) * 2).astype(BF16)
    g = (1 + 0.5 * rng.standard_normal(384)).astype(F32)
    dy = rng.standard_normal((3, 50, 384)).astype(BF16)
    stats = _stats(norm, np.asarray(x).reshape(1, 150, 384), 1e-5)
    stats_nd = stats.reshape((3, 50) + stats.shape[2:])
    got = jax.jit(partial(norm_grad, norm))(x, g, stats_nd, dy)
    want = producers.norm_grad(norm, np.asarray(x).reshape(1, 150, 384), g, stats, np.asarray(dy).reshape(1, 150, 384))
    assert len(got) == len(want) and got[0].shape == x.shape and got[0].dtype == x.dtype
    assert_bits_equal(np.asarray(got[0]).reshape(1, 150, 384), want[0], "dx")
    for a, b in zip(got[1:], want[1:]):
        assert_bits_equal(a, b, "column sums")
    xla = _norm_grad(norm, jnp.asarray(x), jnp.asarray(g), jnp.asarray(stats_nd), jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(xla[0], np.float32), rtol=2e-2, atol=2e-2)
    for a, b in zip(got[1:], [v for v in xla[1:] if v is not None]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3)


# ---- 4. vmap -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_vmap_equals_per_slice(norm):
    """Each mapped entry gets its own column sums, with gamma shared or mapped."""
    rng = np.random.default_rng(stable_seed("norm grad vmap", norm))
    V, B, M, K = 3, 1, 70, 160
    xs = [(rng.standard_normal((B, M, K)) * 2).astype(BF16) for _ in range(V)]
    gs = [(1 + rng.standard_normal(K)).astype(F32) for _ in range(V)]
    args = [[x, g, _stats(norm, x), (rng.standard_normal((B, M, K))).astype(BF16)] for x, g in zip(xs, gs)]
    stacked = [np.stack([a[i] for a in args]) for i in range(4)]
    fn = lambda *a: norm_grad_p.bind(*a, norm=norm)  # noqa: E731
    for gamma_axis in (None, 0):
        ins = list(stacked)
        if gamma_axis is None:
            ins[1] = gs[0]
        got = jax.jit(jax.vmap(fn, in_axes=(0, gamma_axis, 0, 0)))(*ins)
        for v in range(V):
            one = list(args[v])
            if gamma_axis is None:
                one[1] = gs[0]
            want = _want(norm, one)
            assert_bits_equal(got[0][v], want[0], f"dx {v}")
            assert_bits_equal(got[1][v], want[1], f"sums {v}")


# ---- 5. sharded jax.jit and jax.shard_map --------------------------------------------------------------
def _norm_inputs(norm, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((8, 96, 256)) * 2).astype(BF16)
    return [x, (1 + 0.5 * rng.standard_normal(256)).astype(F32), _stats(norm, np.asarray(x)),
            rng.standard_normal((8, 96, 256)).astype(BF16)]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("split", ["rows", "rows-plain-mesh", "rows-explicit", "last dim"])
def test_sharded_jit(norm, split):
    """Under jit on x, dy and the statistics split along their first dim, the rows stay split: dx bit for
    bit as unsharded, one all-reduce of the column sums, no gather; a split last dim is gathered with a
    warning saying why."""
    args = _norm_inputs(norm, stable_seed("norm grad sharded", norm, split))
    f = jax.jit(partial(norm_grad, norm))
    want = f(*args)
    devices = jax.devices("cpu")[:8]
    if split == "rows":
        mesh, spec = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=devices), P("data")
    elif split == "rows-plain-mesh":  # jax.sharding.Mesh as users build it
        mesh, spec = jax.sharding.Mesh(np.array(devices), ("data",)), P("data")
    elif split == "rows-explicit":
        mesh, spec = jax.make_mesh((2, 4), ("b", "data"), devices=devices), P(("b", "data"))
    else:
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=devices)
        spec = P("data", None, "model")
    stats_spec = P(*tuple(spec)[:2])
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, (spec, P(), stats_spec, spec))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(*sharded)
        hlo = f.lower(*sharded).compile().as_text()
    ours = [str(w.message) for w in caught if issubclass(w.category, ShardingWarning) and "jf_norm_grad" in str(w.message)]
    assert_bits_equal(got[0], want[0], "dx")
    for a, b in zip(got[1:], want[1:]):  # each device's rows' sums, then their psum: another order
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-3)
    if split == "last dim":
        assert ours and all("the norm reduces along it" in w for w in ours), ours
    else:
        assert not ours, ours
        assert "all-gather" not in hlo and "all-reduce" in hlo
        assert got[0].addressable_shards[0].data.shape[0] == 1


@pytest.mark.parametrize("norm", NORMS)
def test_default_shard_map(norm):
    """Inside the default jax.shard_map (check_vma on): each shard's dx is the unsharded dx's rows, and
    its column sums vary over the mesh axis (its own rows'), so out_specs=P() takes their psum."""
    args = _norm_inputs(norm, stable_seed("norm grad shard_map", norm))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:8])
    want = jax.jit(partial(norm_grad, norm))(*args)

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P("data"), P("data")),
             out_specs=(P("data"),) + (P(),) * (len(want) - 1))
    def body(x, g, stats, dy):
        dx, *sums = norm_grad(norm, x, g, stats, dy)
        return (dx, *(jax.lax.psum(v, "data") for v in sums))

    sharded = [jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim > 1 else P())) for a in args]
    got = jax.jit(body)(*sharded)
    assert_bits_equal(got[0], want[0], "dx")
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-3)


# ---- 6. shape errors -----------------------------------------------------------------------------------
def test_wrong_shapes_raise():
    x = jnp.zeros((1, 8, 128), F32)
    g, rstd = jnp.ones((128,), F32), jnp.ones((1, 8), F32)
    cases = [("rmsnorm", (x, jnp.ones((127,), F32), rstd, x), "gamma \\(127,\\)"),
             ("rmsnorm", (x, g, jnp.ones((1, 8, 2), F32), x), "statistics \\(1, 8\\)"),
             ("layernorm", (x, g, rstd, x), "statistics \\(1, 8, 2\\)"),
             ("rmsnorm", (x, g, rstd, jnp.zeros((1, 8, 64), F32)), "x and dy of one shape"),
             ("rmsnorm", (jnp.zeros((8, 128)), g, rstd, jnp.zeros((8, 128))), "\\(batch, rows, cols\\)")]
    for norm, args, match in cases:
        with pytest.raises(ValueError, match=match):
            _bind(norm)(*args)
    with pytest.raises(ValueError, match="norm must be one of"):
        _bind("batchnorm")(x, g, rstd, x)
