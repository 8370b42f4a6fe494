"""``fp8_dot_general`` on the FP8 GEMM: forward, its training VJP, transformations, pre-quantized
operands and fallbacks. The error bounds and helpers are test_gemm.py's (its docstring derives them)."""
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import gemm as G
from jax import shard_map
from helpers import assert_bits_equal, deq, on_cpu, stable_seed
from test_gemm import (B1, B2, BF16, E4M3, E5M2, F16, F32, KN, NK, TINY, TINY_OUT, U_ACC, U_FP32, U_OUT,  # noqa: F401
                       assert_within, check_gemm, data, f64, gemm_bound, one_warning, strict)

# ---- fp8_dot_general: forward --------------------------------------------------------------------
DOT_SHAPES = [((1, 256), 128), ((37, 300), 50), ((2, 3, 40, 130), 136), ((256, 384), 256)]


def jit_dot(x, w, dn, **kw):
    return jax.jit(partial(jf.fp8_dot_general, dimension_numbers=dn, **kw))(x, w)


def _w(rng, K, N, kn, dtype=F32):
    return data(rng, (K, N) if kn else (N, K), dtype)


def _wq(w, kn):
    """W's fprop operand values (N, K) from an independent 128x128 quantization."""
    q = jf.quantize_blockwise(w, block=B2)
    return deq(q).T if kn else deq(q)


@pytest.mark.parametrize("xshape,N", DOT_SHAPES, ids=str)
@pytest.mark.parametrize("kn", [True, False], ids=["KN", "NK"])
def test_dot_general_forward(xshape, N, kn, strict):
    rng = np.random.default_rng(stable_seed(xshape, N, kn))
    x, w = data(rng, xshape, BF16, outliers=True), _w(rng, xshape[-1], N, kn)
    dn = (((len(xshape) - 1,), (0 if kn else 1,)), ((), ()))
    y = jit_dot(x, w, dn)
    assert y.shape == (*xshape[:-1], N) and y.dtype == F32
    check_gemm(y.reshape(-1, N), deq(jf.quantize_blockwise(x)), _wq(w, kn), F32)
    y16 = jit_dot(x, w.astype(BF16), dn)  # bf16 x bf16 -> bf16, as lax.dot_general
    assert y16.dtype == BF16
    check_gemm(y16.reshape(-1, N), deq(jf.quantize_blockwise(x)), _wq(w.astype(BF16), kn), BF16)
    yh = jit_dot(x, w, dn, preferred_element_type=jnp.float16)  # not a GEMM dtype: fp32 then cast
    assert yh.dtype == F16


def test_dense_and_einsum_drop_in(strict):
    """flax.linen.Dense calls dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
    precision=...); jnp.einsum takes it as _dot_general. Both reach the FP8 GEMM, unwarned."""
    rng = np.random.default_rng(4)
    x, kernel = data(rng, (2, 24, 256), BF16), data(rng, (256, 136), BF16)

    def dense(inputs, kernel, dot_general=jf.fp8_dot_general):
        return dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=None)

    y = jax.jit(dense)(x, kernel)
    assert y.shape == (2, 24, 136) and y.dtype == BF16
    check_gemm(y.reshape(-1, 136), deq(jf.quantize_blockwise(x)), _wq(kernel, True), BF16)
    e5 = partial(jf.fp8_dot_general, recipe=jf.Float8BlockScaling(grad_dtype=E5M2))
    for spec, w in (("btk,kn->btn", kernel), ("btk,nk->btn", kernel.T)):
        for dg in (jf.fp8_dot_general, e5):
            ye = jnp.einsum(spec, x, w, _dot_general=dg)
            assert_bits_equal(ye, y, spec)
    ye = jnp.einsum("kn,btk->btn", kernel, x, _dot_general=jf.fp8_dot_general)  # weight first: same call
    assert_bits_equal(ye, y, "kn,btk")
    gx = jax.jit(jax.grad(lambda x: jnp.einsum("btk,kn->btn", x, kernel, _dot_general=jf.fp8_dot_general)
                  .astype(F32).sum()))(x)
    assert gx.shape == x.shape and gx.dtype == BF16


# ---- fp8_dot_general: the VJP ----------------------------------------------------------------------
VJP_CASES = [((37, 300), 50, F32, E4M3), ((2, 20, 130), 136, BF16, E5M2), ((1, 256), 64, F32, E4M3),
             ((200, 160), 24, F16, E5M2)]


def _fwd_bwd(f):
    """(y, dx, dW) of f at (x, w) with cotangent g."""
    def run(x, w, g):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))
    return run


def _vjp_setup(xshape, N, kn, x_dtype, grad_dtype, seed):
    rng = np.random.default_rng(seed)
    x, w = data(rng, xshape, x_dtype, spread=3), data(rng, (xshape[-1], N) if kn else (N, xshape[-1]), F32, spread=3)
    recipe = jf.Float8BlockScaling(grad_dtype=grad_dtype)
    dn = (((len(xshape) - 1,), (0 if kn else 1,)), ((), ()))
    f = lambda x, w: jf.fp8_dot_general(x, w, dn, recipe=recipe)  # noqa: E731
    g = data(rng, (*xshape[:-1], N), jnp.result_type(x_dtype, F32), spread=3)
    return x, w, g, f, recipe, dn


@pytest.mark.parametrize("xshape,N,x_dtype,grad_dtype", VJP_CASES, ids=str)
@pytest.mark.parametrize("kn", [True, False], ids=["KN", "NK"])
def test_vjp_against_grad_of_dequantized(xshape, N, x_dtype, grad_dtype, kn, strict):
    x, w, g, f, recipe, dn = _vjp_setup(xshape, N, kn, x_dtype, grad_dtype, stable_seed(xshape, N, kn))
    y, dx, dw = jax.jit(_fwd_bwd(f))(x, w, g)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dx.shape == x.shape and dw.shape == w.shape
    assert_bits_equal(y, f(x, w), "primal call == forward of the VJP")
    # independent quantizations of the same operands (the FP8 path's values)
    xq = jf.quantize_blockwise(x, colwise=True)
    gq = jf.quantize_blockwise(g, dtype=grad_dtype, colwise=True)
    Xr, Xc, Gr, Gc, G64 = deq(xq), deq(xq, "colwise"), deq(gq), deq(gq, "colwise"), f64(g).reshape(-1, N)
    Wnk = _wq(w, kn)  # (N, K)
    check_gemm(y.reshape(-1, N), Xr, Wnk, y.dtype, what="fprop")
    # jax.vjp of the same product on the dequantized operands, fp32 HIGHEST, unquantized cotangent
    wt = jnp.asarray(Wnk.T if kn else Wnk, F32)
    ref = lambda X, W: lax.dot_general(X, W, dn, precision=lax.Precision.HIGHEST)  # noqa: E731
    _, ref_vjp = jax.vjp(ref, jnp.asarray(Xr.reshape(xshape), F32), wt)
    rdx, rdw = (f64(v) for v in ref_vjp(jnp.asarray(g, F32)))
    # dx = dy · W (M, K): ours uses Q(dy) rowwise
    _, b_ours = gemm_bound(Gr, Wnk.T, x.dtype)
    _, b_ref = gemm_bound(G64, Wnk.T, F32, u=U_FP32)
    assert_within(dx.reshape(-1, xshape[-1]), rdx.reshape(-1, xshape[-1]),
                  b_ours + np.abs(Gr - G64) @ np.abs(Wnk) + b_ref, "dx")
    # dW (N, K) = dyᵀ · x: ours uses the columnwise usages of dy and x; jax's the rowwise x
    _, b_ours = gemm_bound(Gc.T, Xc.T, w.dtype)
    _, b_ref = gemm_bound(G64.T, Xr.T, F32, u=U_FP32)
    b_dw = b_ours + np.abs(Gc - G64).T @ np.abs(Xc) + np.abs(G64).T @ np.abs(Xc - Xr) + b_ref
    assert_within(dw if not kn else dw.T, rdw if not kn else rdw.T, b_dw, "dW")


def accumulation_bound(a, b, out_dtype, u=U_ACC):
    """(exact a·bᵀ, elementwise bound on |GEMM - exact|) for fp64 a (R, n), b (C, n), contracted over n.

    Accumulation: the GEMM multiplies the FP8 data (products of two 4-bit significands: exact in fp32),
    sums them per 128-wide block of n, scales each block's partial sum (two roundings at most: the
    product of the two scales and its product with the sum; none for the recipe's power-of-2 scales)
    and adds the ceil(n / 128) partials, all in fp32 (zero padding adds exactly). That is at most
    m = n - 1 + 2 ceil(n / 128) <= 2n roundings of unit roundoff u on the way to any output, each of a
    partial sum or product bounded by S = |a|·|b|ᵀ, whatever the order of the sums (blocked, split-K,
    FMA or not): |err| <= gamma_m · S, gamma_m = m u / (1 - m u) (Higham, Accuracy and Stability of
    Numerical Algorithms, §3.1). The factor 2 in m = 2n is that safe upper count; the term m · 2^-126
    covers partial sums flushed to zero below fp32's normal range (XLA's CPU runtime). u = 2^-24 (fp32)
    on CPU; on a GPU the module's u for the FP8 tensor cores' narrower in-MMA sums.

    Output: rounding the fp32 result to ``out_dtype`` (bf16) adds at most half an ulp, u_out relative
    to |fl(r)| <= |r| + acc (u_out = 2^-8 for bf16; f32 needs none, the term 2^-24 (|r| + acc) only
    loosens the bound by one more rounding), plus half the output's smallest spacing."""
    n = a.shape[1]
    exact, S = a @ b.T, np.abs(a) @ np.abs(b).T
    m = 2 * max(n, 1)
    acc = m * u / (1 - m * u) * S + m * TINY
    out_dtype = jnp.dtype(out_dtype)
    return exact, acc + U_OUT[out_dtype] * (np.abs(exact) + acc) + TINY_OUT[out_dtype]


def _ref64(v, block, dtype, recipe, usage="rowwise"):
    """fp64 (rows, cols) values of ``v``'s 2-D view quantized by the jax.numpy reference (evaluated in
    NumPy) in ``block`` blocks with the recipe's options, its ``usage`` dequantized in NumPy. The
    recipe's ``saturate_inf=False`` changes only blocks holding an infinity: the data here are finite."""
    v = np.asarray(v).reshape(-1, v.shape[-1])
    q = on_cpu(jf.reference.quantize_blockwise, v, block=block, dtype=dtype, pow2_scales=recipe.pow2_scales,
               amax_epsilon=recipe.amax_epsilon, colwise=usage == "colwise")
    return deq(q, usage)


def _wide(rng, shape, dtype):
    """Normal values with rows and columns each scaled by 2**[-6, 6): a block along either dim spans
    ~2^12, so its small entries fall into FP8's subnormal range, where rowwise (1x128) and columnwise
    (128x1) quantizations differ (with power-of-2 scales they agree on every normal value): a GEMM
    reading the wrong usage falls outside the fp32 bounds."""
    v = rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 6, size=shape[:-1] + (1,))
    v = v * 2.0 ** rng.integers(-6, 6, size=shape[-1])
    return jnp.asarray(v.astype(np.float32)).astype(dtype)


#: (x shape, N, operand and output dtype, grad_dtype): M, K and N off the 128 grid (partial blocks and
#: tiles), an aligned case, and a (B, S, K) x with S % 128 == 0 (the stacked GEMMs on several devices)
FP64_CASES = [((37, 300), 50, F32, E4M3), ((130, 257), 129, BF16, E5M2), ((2, 20, 130), 136, BF16, E4M3),
              ((256, 384), 256, F32, E5M2), ((2, 128, 272), 48, BF16, E4M3)]


@pytest.mark.parametrize("xshape,N,dtype,grad_dtype", FP64_CASES, ids=str)
@pytest.mark.parametrize("kn", [True, False], ids=["KN", "NK"])
def test_vjp_against_fp64_of_independent_quantizations(xshape, N, dtype, grad_dtype, kn, strict):
    """y, dx and dW of fp8_dot_general (jax.vjp and jax.grad, jitted) against fp64 products of x, W and
    dy quantized independently by the jax.numpy reference with the recipe's blocks (module docstring of
    jax_fp8/gemm.py): fprop y = x̃ · W̃ᵀ (x 1x128 rowwise), dgrad dx = d̃y · W̃ (dy 1x128 rowwise, the same
    128x128 tiles of W), wgrad dW = d̃yᵀ · x̃ (the 128x1 columnwise usages of dy and x), each within
    :func:`accumulation_bound` of its contraction."""
    rng = np.random.default_rng(stable_seed("vjp fp64", xshape, N, dtype, grad_dtype, kn))
    K = xshape[-1]
    x, w, g = (_wide(rng, s, dtype) for s in (xshape, (K, N) if kn else (N, K), (*xshape[:-1], N)))
    recipe = jf.Float8BlockScaling(grad_dtype=grad_dtype)
    dn = (((len(xshape) - 1,), (0 if kn else 1,)), ((), ()))
    f = lambda x, w: jf.fp8_dot_general(x, w, dn, recipe=recipe)  # noqa: E731
    y, dx, dw = jax.jit(_fwd_bwd(f))(x, w, g)
    assert y.dtype == dx.dtype == dw.dtype == dtype and dx.shape == x.shape and dw.shape == w.shape
    gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(F32) * g.astype(F32)), argnums=(0, 1)))(x, w)
    assert_bits_equal(gx, dx, "jax.grad dx == jax.vjp dx")
    assert_bits_equal(gw, dw, "jax.grad dW == jax.vjp dW")

    Xr, Xc = _ref64(x, B1, E4M3, recipe), _ref64(x, B1, E4M3, recipe, "colwise")  # (M, K) each
    Wt = _ref64(w, B2, E4M3, recipe)  # W's own shape: the tiles of both orientations
    Wnk = Wt.T if kn else Wt  # (N, K)
    Gr, Gc = _ref64(g, B1, grad_dtype, recipe), _ref64(g, B1, grad_dtype, recipe, "colwise")  # (M, N) each
    assert_three_gemms_within((y, dx, dw), (Xr, Xc), (Wnk, Wnk), (Gr, Gc), dtype, kn)


def assert_three_gemms_within(outs, xs, ws, gs, dtype, kn):
    """y, dx and dW of one linear layer, each within :func:`accumulation_bound` of the fp64 product of
    independently quantized operands: ``xs`` = (x rowwise, x columnwise) (M, K), ``ws`` = (W as read
    over K, W as read over N), both as (N, K), ``gs`` = (dy rowwise, dy columnwise) (M, N); ``kn``: W
    is (K, N), so dW is checked transposed."""
    (y, dx, dw), (Xr, Xc), (W_fprop, W_dgrad), (Gr, Gc) = outs, xs, ws, gs
    (M, K), N = Xr.shape, W_fprop.shape[0]
    exact, bound = accumulation_bound(Xr, W_fprop, dtype)  # fprop (M, N), over K
    assert_within(y.reshape(M, N), exact, bound, "fprop y")
    exact, bound = accumulation_bound(Gr, W_dgrad.T, dtype)  # dgrad (M, K), over N
    assert_within(dx.reshape(M, K), exact, bound, "dgrad dx")
    exact, bound = accumulation_bound(Gc.T, Xc.T, dtype)  # wgrad (N, K), over M
    assert_within(dw.T if kn else dw, exact, bound, "wgrad dW")


def test_each_tensor_quantized_once():
    """Forward + backward: one quantize of x, of W and of dy, and three FP8 GEMMs."""
    x, w, g, f, *_ = _vjp_setup((64, 256), 128, True, BF16, E4M3, 5)
    jaxpr = str(jax.make_jaxpr(lambda x, w, g: jax.vjp(f, x, w)[1](g))(x, w, g))
    assert jaxpr.count("jf_quantize[") == 3 and jaxpr.count("jf_fp8_gemm[") == 3, jaxpr
    assert "jf_dequantize" not in jaxpr and "dot_general" not in jaxpr


# ---- transformations -----------------------------------------------------------------------------
def _loss(f):
    return lambda x, w, g: (f(x, w).astype(F32) * g).sum()


def test_jit_and_remat_equal_eager(strict):
    x, w, g, f, *_ = _vjp_setup((2, 24, 256), 136, True, BF16, E4M3, 6)
    grad = jax.grad(_loss(f), argnums=(0, 1))
    eager = grad(x, w, g)
    for name, fn in (("jit", jax.jit(grad)), ("remat", jax.grad(jax.checkpoint(_loss(f)), argnums=(0, 1))),
                     ("jit remat", jax.jit(jax.grad(_loss(jax.checkpoint(f)), argnums=(0, 1))))):
        for a, b in zip(fn(x, w, g), eager):
            assert_bits_equal(a, b, name)


def test_vmap_over_leading_dims(strict):
    """vmap over examples: each example's output and gradients within the bounds of its own GEMMs."""
    x, w, g, f, *_ = _vjp_setup((3, 24, 256), 136, True, BF16, E4M3, 7)
    fe = lambda xi, w: jf.fp8_dot_general(xi, w, KN)  # noqa: E731
    y, dx, dw = jax.jit(lambda x, w, g: (jax.vmap(fe, (0, None))(x, w),
                                         *jax.grad(_loss(jax.vmap(fe, (0, None))), argnums=(0, 1))(x, w, g)))(x, w, g)
    Wnk = _wq(w, True)
    dw_sum = np.zeros(w.shape)
    dw_bound = np.zeros(w.shape)
    for i in range(3):
        xq = jf.quantize_blockwise(x[i], colwise=True)
        gq = jf.quantize_blockwise(g[i], colwise=True)
        check_gemm(y[i], deq(xq), Wnk, F32, what=f"y[{i}]")
        check_gemm(dx[i], deq(gq), Wnk.T, BF16, what=f"dx[{i}]")
        exact, bound = gemm_bound(deq(xq, "colwise").T, deq(gq, "colwise").T, F32)  # dW_i (K, N)
        dw_sum, dw_bound = dw_sum + exact, dw_bound + bound + 3 * 2.0**-24 * np.abs(exact)
    assert_within(dw, dw_sum, dw_bound, "dW summed over the vmapped examples")


@pytest.mark.parametrize("in_axes", [(0, None), (0, 0), (None, 0)], ids=str)
def test_vmap_over_no_entries(in_axes):
    """A batch of no entries (either operand, or both): empty results and gradients of lax.dot_general's
    shapes and dtypes, as jax.vmap of lax.dot_general gives them."""
    x, w = jnp.zeros((24, 256), BF16), jnp.zeros((256, 136), BF16)
    x, w = (jnp.zeros((0, *v.shape), v.dtype) if a == 0 else v for v, a in zip((x, w), in_axes))

    def run(dot):
        f = jax.vmap(lambda a, b: dot(a, b, KN), in_axes)
        return f(x, w), jax.grad(lambda a, b: f(a, b).astype(F32).sum(), argnums=(0, 1))(x, w)

    got, want = run(jf.fp8_dot_general), run(lax.dot_general)
    assert [(v.shape, v.dtype) for v in jax.tree.leaves(got)] == [(v.shape, v.dtype) for v in jax.tree.leaves(want)]


def test_shard_map_equals_per_shard(strict):
    """Inside jax.shard_map with its default checks (rows of x on 4 devices, W replicated): y and dx
    are each shard's own FP8 linear layer; dW, the cotangent of a replicated W, is replicated and is
    the sum of the shards' wgrads (JAX inserts that psum, as for lax.dot_general)."""
    n, (x, w, g, f, *_) = 4, _vjp_setup((64, 256), 136, False, BF16, E4M3, 8)
    mesh = Mesh(np.array(jax.devices("cpu")[:n]), ("data",))

    def step(x, w, g):
        y, vjp = jax.vjp(f, x, w)
        return y, *vjp(g)

    y, dx, dw = jax.jit(shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                  out_specs=(P("data"), P("data"), P())))(x, w, g)
    def local(x, w, g):  # one shard's layer, by itself, on a CPU device like the mesh's
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))

    cpu, rows = jax.devices("cpu")[0], x.shape[0] // n
    parts = [jax.jit(local)(*jax.device_put((x[i * rows:(i + 1) * rows], w, g[i * rows:(i + 1) * rows]), cpu))
             for i in range(n)]
    assert_bits_equal(y, jnp.concatenate([p[0] for p in parts]), "y")
    assert_bits_equal(dx, jnp.concatenate([p[1] for p in parts]), "dx")
    dws = [f64(p[2]) for p in parts]
    assert_within(dw, sum(dws), n * 2.0**-24 * sum(np.abs(d) for d in dws), "dW psum")


# ---- pre-quantized operands ----------------------------------------------------------------------
def test_prequantized_operands_used_as_they_are(strict):
    rng = np.random.default_rng(9)
    x, w = data(rng, (40, 272), BF16), data(rng, (272, 56), F32)
    dot = jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN))
    grad = jax.jit(jax.grad(_loss(dot), argnums=(0, 1)))
    y = dot(x, w)
    dx_ref, dw_ref = grad(x, w, y)
    for layout in ("compact", "gemm_ready"):
        wq = jf.quantize_blockwise(w, block=B2, layout=layout)  # rowwise only: tiles give both orientations
        xq = jf.quantize_blockwise(x, colwise=True, layout=layout)
        assert_bits_equal(dot(x, wq), y, f"W pre-quantized {layout}")
        assert_bits_equal(dot(xq, w), y, f"x pre-quantized {layout}")
        assert_bits_equal(dot(xq, wq), y, f"both pre-quantized {layout}")
        dx = jax.jit(jax.grad(_loss(dot)))(x, wq, y)
        dw = jax.jit(jax.grad(_loss(dot), argnums=1))(xq, w, y)
        assert_bits_equal(dx, dx_ref, "dx with a pre-quantized W")
        assert_bits_equal(dw, dw_ref, "dW with a pre-quantized x")


# ---- fallbacks: one warning each, a correct answer ------------------------------------------------
def _qdq(x, block):
    return jf.quantize_dequantize(x, "blockwise", block=block)


FALLBACKS = {
    # name: (lhs shape, rhs shape, dimension_numbers, warning text)
    "batch dims": ((3, 16, 128), (3, 128, 24), (((2,), (1,)), ((0,), (0,))), "batch dimensions"),
    "rhs free dims apart": ((16, 128), (4, 128, 6), (((1,), (1,)), ((), ())), "not two adjacent groups"),
    "lhs contraction not last": ((128, 16), (128, 24), (((0,), (0,)), ((), ())), "not its trailing dims"),
    "contractions transposed": ((4, 8, 16), (16, 8, 3), (((1, 2), (1, 0)), ((), ())), "in a different order"),
    "outer product": ((4, 8), (3, 5), (((), ()), ((), ())), "no contracting dimensions"),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_fallback_dimension_numbers(name):
    ls, rs, dn, match = FALLBACKS[name]
    rng = np.random.default_rng(stable_seed(name))
    x, w = data(rng, ls, F32), data(rng, rs, F32)
    loss = _loss(lambda x, w: jf.fp8_dot_general(x, w, dn))
    y, wn = one_warning(lambda: jf.fp8_dot_general(x, w, dn), match)
    assert f"lhs float32[{','.join(map(str, ls))}], rhs float32[{','.join(map(str, rs))}]" in str(wn.message)
    assert "computing lax.dot_general of the lhs quantize-dequantized (1x128 blocks) and the rhs " \
           "quantize-dequantized (128x128 tiles)" in str(wn.message)
    assert_bits_equal(y, lax.dot_general(_qdq(x, B1), _qdq(w, B2), dn), name)
    (dx, dw), _ = one_warning(lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, jnp.ones_like(y)), match)
    assert dx.shape == x.shape and dw.shape == w.shape  # straight-through: the gradients of the dot
    with warnings.catch_warnings(record=True) as rec:  # Python's default filter: once per call site
        warnings.simplefilter("default")
        for _ in range(3):
            jf.fp8_dot_general(x, w, dn)
    assert len([r for r in rec if issubclass(r.category, jf.Fp8GemmFallbackWarning)]) == 1


def test_fallback_operand_kinds():
    rng = np.random.default_rng(10)
    x, w = data(rng, (16, 128), F32), data(rng, (128, 24), F32)
    mx = jf.quantize_mxfp8(x)
    y, _ = one_warning(lambda: jf.fp8_dot_general(mx, w, KN), "MXFP8")
    assert_bits_equal(y, lax.dot_general(jf.dequantize(mx), _qdq(w, B2), KN), "mxfp8 lhs")
    xi = jnp.arange(16 * 128, dtype=jnp.int32).reshape(16, 128) % 7
    y, _ = one_warning(lambda: jf.fp8_dot_general(xi, w, KN), "dtype int32")
    assert_bits_equal(y, lax.dot_general(xi, _qdq(w, B2), KN, preferred_element_type=F32), "int lhs")
    sh = jax.sharding.NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x", None))
    x64 = data(rng, (64, 128), F32)  # 8 rows a device: cuBLASLt's alignment
    with warnings.catch_warnings():  # out_sharding: the FP8 GEMM still, its result placed as asked
        warnings.simplefilter("error")
        y = jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN, out_sharding=sh))(x64, w)
    assert_bits_equal(y, jf.fp8_dot_general(x64, w, KN), "out_sharding")
    assert y.sharding.is_equivalent_to(sh, y.ndim), y.sharding
    w_row = jf.quantize_blockwise(w)  # (K, N) 1x128 rowwise: blocks along N, but fprop contracts over K
    y, _ = one_warning(lambda: jf.fp8_dot_general(x, w_row, KN), "lacks the usage the forward GEMM")
    assert_bits_equal(y, lax.dot_general(_qdq(x, B1), jf.dequantize(w_row), KN), "unusable pre-quantized rhs")


def test_fallback_per_gemm_keeps_the_rest_in_fp8():
    """GEMMs the FP8 path cannot take (here: shapes too small to pad cheaply; a pre-quantized W without
    its dgrad orientation; 2D x 2D; E5M2 x E5M2) run the reference math on the same quantized operands,
    with one warning per call naming them, and gradients still within the bounds."""
    rng = np.random.default_rng(11)
    x, w = data(rng, (1, 5), F32), data(rng, (5, 1), F32)  # 1x1x5: fprop, dgrad and wgrad all fall back
    loss = _loss(lambda x, w: jf.fp8_dot_general(x, w, KN))
    y, wn = one_warning(lambda: jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN))(x, w), "fprop:")
    assert "dgrad:" in str(wn.message) and "wgrad:" in str(wn.message) and wn.filename == __file__
    check_gemm(y, deq(jf.quantize_blockwise(x)), _wq(w, True), F32)
    (dx, dw), _ = one_warning(lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, jnp.ones_like(y)), "wgrad:")
    gq = jf.quantize_blockwise(jnp.ones_like(y), colwise=True)
    check_gemm(dx, deq(gq), _wq(w, True).T, F32, what="dx")
    check_gemm(dw, deq(jf.quantize_blockwise(x, colwise=True), "colwise").T, deq(gq, "colwise").T, F32, what="dW")

    x, w = data(rng, (32, 256), BF16), data(rng, (64, 256), F32)  # W (N, K) 1x128 rowwise only
    wq = jf.quantize_blockwise(w)
    _, wn = one_warning(lambda: jax.jit(lambda x, w: jf.fp8_dot_general(x, w, NK))(x, wq),
                        "dgrad: a pre-quantized operand lacks")
    assert "fprop" not in str(wn.message)
    g = data(rng, (32, 64), F32)
    dx, _ = one_warning(lambda: jax.jit(jax.grad(_loss(lambda x, w: jf.fp8_dot_general(x, w, NK))))(x, wq, g),
                        "dgrad")
    check_gemm(dx, deq(jf.quantize_blockwise(g)), deq(wq).T, BF16, what="dx, dense dgrad")

    xt = jf.quantize_blockwise(x, block=B2)  # 128x128 x and the recipe's 128x128 W: fprop 2D x 2D
    y, _ = one_warning(lambda: jax.jit(lambda x, w: jf.fp8_dot_general(x, w, NK))(xt, w),
                       "fprop: cublaslt: 128x128 blocks on both")
    check_gemm(y, deq(xt), _wq(w, False), F32)
    x5 = jf.quantize_blockwise(x, dtype=E5M2)  # pre-quantized E5M2 x and W: fprop E5M2 x E5M2
    w5 = jf.quantize_blockwise(w, dtype=E5M2, colwise=True)
    y, _ = one_warning(lambda: jax.jit(lambda x, w: jf.fp8_dot_general(x, w, NK))(x5, w5), "E5M2 on both")
    check_gemm(y, deq(x5), deq(w5), F32)


def test_no_warning_on_supported_and_empty(strict):
    rng = np.random.default_rng(12)
    x, w = data(rng, (0, 64), F32), data(rng, (64, 24), F32)
    assert jf.fp8_dot_general(x, w, KN).shape == (0, 24)
    y = jf.fp8_dot_general(data(rng, (5, 0), F32), data(rng, (0, 3), F32), KN)
    assert y.shape == (5, 3) and not y.any()
    dx = jax.grad(lambda x: jf.fp8_dot_general(x, data(rng, (0, 3), F32), KN).sum())(data(rng, (5, 0), F32))
    assert dx.shape == (5, 0)


def test_argument_errors():
    x, w = jnp.ones((8, 128)), jnp.ones((128, 16))
    with pytest.raises(TypeError, match="recipe must be a Float8BlockScaling"):
        jf.fp8_dot_general(x, w, KN, recipe="deepseek")
    with pytest.raises(TypeError, match="contracting dimensions to have the same shape"):  # lax's error
        jf.fp8_dot_general(x, jnp.ones((64, 16)), KN)
    with pytest.raises(TypeError, match="grad_dtype"):
        jf.Float8BlockScaling(grad_dtype=jnp.float32)
    with pytest.raises(ValueError, match="amax_epsilon"):
        jf.Float8BlockScaling(amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="a must be a GemmOperand, BlockwiseTensor or MXFP8Tensor"):
        G.fp8_gemm(x, jf.quantize_blockwise(x))
    with pytest.raises(ValueError, match="no rowwise usage"):
        G.fp8_gemm(jf.quantize_blockwise(x, rowwise=False, colwise=True), jf.quantize_blockwise(x))
    assert hash(jf.Float8BlockScaling(grad_dtype=E5M2)) == hash(jf.Float8BlockScaling(grad_dtype=E5M2))
