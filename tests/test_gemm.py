"""FP8 GEMM (``jf_fp8_gemm``, ``fp8_gemm``); the bounds and helpers that test_dot_general_vjp.py
(``fp8_dot_general`` with its training VJP) and test_gemm_range.py use too.

Error bound (checked everywhere a GEMM result is compared with exact arithmetic). Let ã (M, K), b̃ (N, K)
be the DEQUANTIZED operands (``jf.dequantize``, exact fp64 copies) and r = ã·b̃ᵀ (+ c) exactly, S = |ã|·|b̃|ᵀ
(+ |c|). The GEMM forms each product and sum in floating point with unit roundoff u; whatever the
summation order (blocked, split-K, FMA or not), the standard bound for a length-K dot product with n = K + 1
rounded operations (K products and sums, one more with c) is

    |fl(r) - r| <= gamma_n · S + n · 2^-126,      gamma_n = n·u / (1 - n·u)

(the last term covers products and partial sums flushed to zero below fp32's normal range, as XLA's CPU
runtime does). Rounding the fp32 result to the output dtype adds half an ulp of it, at most u_out·|fl(r)|
<= u_out·(|r| + gamma_n·S) (u_out = 2^-8 for bf16, 2^-11 fp16, 2^-24 fp32), plus half the output's
smallest spacing. u = 2^-24 (fp32 accumulation) on CPU, and wherever the reference lowering runs. On a
GPU, FP8 tensor cores add products inside an MMA with fewer bits than fp32 (DeepSeek-V3 §3.3.2 measured
about 14 on H800; cuBLASLt promotes the partial sums to fp32 registers): there the bound takes
u = 2^-13, and n counts what the hardware adds: each MMA instruction sums 32 products (zeros past K)
and the accumulator, so n = 33·ceil(K/32) + 1 (a short contraction, such as a small group's weight
gradient, still pays a whole instruction's alignment). Still ~2^-8 of S at K = 256, far below the O(1)
error of a wrong scale or orientation.

Gradients (test_dot_general_vjp.py) are checked two ways. Against fp64 products of operands quantized independently here (the
jax.numpy reference, with the recipe's blocks and options: x 1x128 rowwise and 128x1 columnwise, W
128x128 tiles, dy 1x128 rowwise and 128x1 columnwise) and dequantized in NumPy (helpers.deq): fprop,
dgrad and wgrad each within the accumulation and output rounding of its own GEMM
(:func:`accumulation_bound`). And against ``jax.vjp`` of the same product on the dequantized operands
(fp32, HIGHEST) with the unquantized cotangent: the difference is bounded by the GEMM bound of each side
plus the propagated quantization differences, computed exactly (|Q(dy) - dy|·|W̃| etc.), by the
triangle inequality.
"""
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_fp8 as jf
from jax_fp8 import gemm as G
from jax_fp8.gemm.plan import plan_gemm
from jax_fp8.gemm.backends import cublaslt
from jax_fp8.gemm.backends.cublaslt import CUBLASLT
from jax_fp8.gemm.primitive import fp8_gemm_bind
from helpers import assert_bits_equal, deq, stable_seed

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F32, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)
U_FP32 = 2.0**-24  # fp32 accumulation (the CPU, the reference lowering)
U_ACC = U_FP32 if jax.default_backend() == "cpu" else 2.0**-13
U_OUT = {BF16: 2.0**-8, F16: 2.0**-11, F32: U_FP32}
TINY_OUT = {BF16: 2.0**-126, F16: 2.0**-25, F32: 2.0**-126}
TINY = 2.0**-126
B1, B2 = (1, 128), (128, 128)
NK, KN = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))


# ---- bound helpers --------------------------------------------------------------------------------
def f64(a):
    return np.asarray(jax.device_get(a)).astype(np.float64)


def gemm_bound(a, b, out_dtype, c=None, u=U_ACC):
    """(exact a·bᵀ (+ c), elementwise bound on |GEMM - exact|) for fp64 a (M, K), b (N, K) (module doc)."""
    K = a.shape[1]
    # a GPU's FP8 MMA sums 32 products and its accumulator per instruction, zero-padded: 33 terms each
    n = K + 1 if u == U_FP32 else 33 * -(-K // 32) + 1
    exact, S = a @ b.T, np.abs(a) @ np.abs(b).T
    if c is not None:
        exact, S, n = exact + c, S + np.abs(c), n + 1
    acc = n * u / (1 - n * u) * S + n * TINY
    out_dtype = jnp.dtype(out_dtype)
    return exact, acc + U_OUT[out_dtype] * (np.abs(exact) + acc) + TINY_OUT[out_dtype]


def assert_within(got, exact, bound, what=""):
    got = f64(got)
    assert got.shape == exact.shape, (what, got.shape, exact.shape)
    err = np.abs(got - exact)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside the bound; worst err/bound "
                           f"{np.nanmax(err / bound):.3g} at {np.unravel_index(np.nanargmax(err / bound), err.shape)}")


def check_gemm(out, a, b, out_dtype, c=None, what=""):
    exact, bound = gemm_bound(a, b, out_dtype, c)
    assert jnp.dtype(out.dtype) == jnp.dtype(out_dtype), (what, out.dtype)
    assert_within(out, exact, bound, what)


def data(rng, shape, dtype, outliers=False, spread=12):
    """Normal values, rows scaled by 2**[-spread, spread); ``outliers``: ~0.5% of entries x 1e2..1e4."""
    x = rng.standard_normal(shape)
    if x.ndim:
        x *= 2.0 ** rng.integers(-spread, spread, size=x.shape[:-1] + (1,))
    if outliers:
        flat = x.reshape(-1)
        idx = rng.integers(0, flat.size, max(1, flat.size // 200))
        flat[idx] *= 10.0 ** rng.uniform(2, 4, idx.size) * rng.choice([-1, 1], idx.size)
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


@pytest.fixture
def strict():
    """Fail on any fallback warning inside the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)
        yield


def one_warning(fn, match):
    """fn() emits exactly one Fp8GemmFallbackWarning, attributed to its call site here (this file)."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    ours = [r for r in rec if issubclass(r.category, jf.Fp8GemmFallbackWarning)]
    assert len(ours) == 1, [str(r.message) for r in ours]
    assert match in str(ours[0].message), str(ours[0].message)
    return out, ours[0]


# ---- plan_gemm (cuBLASLt's rules) and the primitive's contract ----------------------------------------
def test_plan_gemm_rules():
    p = plan_gemm(4096, 4096, 4096)
    assert p.ok and p.backend is CUBLASLT and p.padded == (4096, 4096, 4096)
    p = plan_gemm(37, 50, 300, B1, B2)  # K -> 16, N -> 8, M -> 8 (1x128 a)
    assert p.ok and p.padded == (40, 56, 304)
    p = plan_gemm(37, 50, 300, B2, B1)  # 128x128 a: M needs no alignment
    assert p.ok and p.padded == (37, 56, 304)
    assert plan_gemm(1, 4096, 4096).ok  # decode: M 1 -> 8 is 8x the work of a tiny GEMM
    assert "both operands" in plan_gemm(128, 128, 128, B2, B2).reason
    assert "E5M2 on both" in plan_gemm(128, 128, 128, B1, B1, E5M2, E5M2).reason
    assert plan_gemm(128, 128, 128, B1, B1, E5M2, E4M3).ok
    assert "multiply the GEMM's work" in plan_gemm(1, 1, 100).reason
    assert "empty" in plan_gemm(0, 8, 16).reason
    assert "2**31" in plan_gemm(8, 8, 2**31).reason
    with pytest.raises(ValueError, match="a_block"):
        plan_gemm(8, 8, 16, (32, 32))


def _aligned(rng, M, N, K, a_block=B1, b_block=B2, a_dtype=E4M3, b_dtype=E4M3):
    qa = jf.quantize_blockwise(data(rng, (M, K), F32), block=a_block, dtype=a_dtype, layout="gemm_ready")
    qb = jf.quantize_blockwise(data(rng, (N, K), F32), block=b_block, dtype=b_dtype, layout="gemm_ready")
    return qa, qb, G.gemm_operand(qa), G.gemm_operand(qb)


def test_primitive_checks_its_contract():
    rng = np.random.default_rng(0)
    _, _, a, b = _aligned(rng, 16, 24, 256)
    bind = lambda *ops, **kw: fp8_gemm_bind(*ops, **{**dict(a_block=B1, b_block=B2, out_dtype=BF16, backend=CUBLASLT), **kw})  # noqa
    assert bind(a.data, a.scale, b.data, b.scale).shape == (16, 24)
    cases = [
        (ValueError, "not aligned", lambda: bind(a.data[:, :200], a.scale, b.data[:, :200], b.scale)),
        (ValueError, "not aligned", lambda: bind(a.data[:12], a.scale, b.data, b.scale)),
        (ValueError, "both operands", lambda: bind(a.data, a.scale, b.data, b.scale, a_block=B2)),
        (ValueError, "a_scale must be float32 (2, 16)", lambda: bind(a.data, a.scale[:, :8], b.data, b.scale)),
        (ValueError, "b_scale must be float32", lambda: bind(a.data, a.scale, b.data, b.scale.astype(BF16))),
        (ValueError, "share K", lambda: bind(a.data, a.scale, b.data[:, :128], b.scale)),
        (ValueError, "must be 2-D", lambda: bind(a.data[None], a.scale, b.data, b.scale)),
        (TypeError, "float8_e4m3fn or float8_e5m2", lambda: bind(a.data.astype(BF16), a.scale, b.data, b.scale)),
        (TypeError, "out_dtype must be float32 or bfloat16", lambda: bind(a.data, a.scale, b.data, b.scale,
                                                                          out_dtype=F16)),
        (ValueError, "c must be bfloat16(16, 24)", lambda: bind(a.data, a.scale, b.data, b.scale,
                                                                 jnp.zeros((16, 24), F32))),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match.replace("(", r"\(").replace(")", r"\)")):
            fn()
    e5 = _aligned(rng, 16, 24, 256, B1, B1, E5M2, E5M2)
    with pytest.raises(ValueError, match="E5M2 on both"):
        fp8_gemm_bind(e5[2].data, e5[2].scale, e5[3].data, e5[3].scale, a_block=B1, b_block=B1, out_dtype=F32, backend=CUBLASLT)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.jvp(lambda d: bind(d, a.scale, b.data, b.scale), (a.data,), (a.data,))


# ---- the GEMM against fp64 --------------------------------------------------------------------------
GEMM_SHAPES = [(1, 8, 256), (37, 50, 300), (130, 257, 200), (9, 3, 40), (200, 64, 1000)]


@pytest.mark.parametrize("M,N,K", GEMM_SHAPES, ids=str)
@pytest.mark.parametrize("blocks", [(B1, B2), (B2, B1), (B1, B1)], ids=["1Dx2D", "2Dx1D", "1Dx1D"])
def test_gemm_within_bound(M, N, K, blocks, strict):
    rng = np.random.default_rng(stable_seed(M, N, K, blocks))
    gemm = jax.jit(G.fp8_gemm, static_argnames="out_dtype")
    for outliers, out_dtype in ((False, BF16), (True, F32)):
        bd = E5M2 if out_dtype == F32 else E4M3  # an E4M3 x E5M2 pair too
        qa = jf.quantize_blockwise(data(rng, (M, K), BF16, outliers), block=blocks[0])
        qb = jf.quantize_blockwise(data(rng, (N, K), F32, outliers), block=blocks[1], dtype=bd)
        out = gemm(qa, qb, out_dtype=out_dtype)
        check_gemm(out, deq(qa), deq(qb), out_dtype, what=f"outliers={outliers} {out_dtype}")


@pytest.mark.parametrize("blocks", [(B1, B2), (B1, B1)], ids=["1Dx2D", "1Dx1D"])
def test_gemm_large_within_bound(blocks, strict):
    """A shape where cuBLASLt's algorithms use a workspace (the call's workspace result)."""
    M, N, K = 2048, 1024, 4096
    rng = np.random.default_rng(stable_seed(M, N, K, blocks))
    qa = jf.quantize_blockwise(data(rng, (M, K), BF16), block=blocks[0])
    qb = jf.quantize_blockwise(data(rng, (N, K), BF16), block=blocks[1])
    out = jax.jit(G.fp8_gemm, static_argnames="out_dtype")(qa, qb, out_dtype=BF16)
    check_gemm(out, deq(qa), deq(qb), BF16, what=f"{M}x{N}x{K}")


def test_gemm_accumulates_into_c(strict):
    rng = np.random.default_rng(1)
    qa = jf.quantize_blockwise(data(rng, (45, 300), F32), layout="gemm_ready")
    qb = jf.quantize_blockwise(data(rng, (70, 300), F32), block=B2)
    for out_dtype in (F32, BF16):
        c = data(rng, (45, 70), out_dtype) * 30
        out = jax.jit(G.fp8_gemm, static_argnames="out_dtype")(qa, qb, out_dtype=out_dtype, c=c)
        check_gemm(out, deq(qa), deq(qb), out_dtype, c=f64(c), what=str(out_dtype))


def test_gemm_fallback_warns_once_and_matches_reference():
    rng = np.random.default_rng(2)
    qa = jf.quantize_blockwise(data(rng, (1, 5), F32))
    qb = jf.quantize_blockwise(data(rng, (1, 5), F32), block=B2)
    out, w = one_warning(lambda: G.fp8_gemm(qa, qb, F32), "multiply the GEMM's work")
    assert w.filename == __file__
    check_gemm(out, deq(qa), deq(qb), F32)
    q2 = jf.quantize_blockwise(data(rng, (16, 128), F32), block=B2)  # 2D x 2D
    out, _ = one_warning(lambda: G.fp8_gemm(q2, q2, F32), "both operands")
    check_gemm(out, deq(q2), deq(q2), F32)


def test_gemm_cuda_status_says_why():
    """Where the cuBLASLt GEMM cannot run (no CUDA module, no cuBLASLt >= 12.9, no Hopper GPU), the
    status is a reason in words, never an exception; on an H200 with the module it is None."""
    from jax_fp8 import _ffi

    why = cublaslt.unavailable()
    version, where = cublaslt.cublaslt()
    hopper = jax.default_backend() == "gpu" and all(
        str(getattr(d, "compute_capability", "")).startswith("9.") for d in jax.devices())
    if hopper and _ffi.AVAILABLE["cuda"]:
        assert why is None and version >= cublaslt.CUBLASLT_MIN_VERSION, (why, version, where)
    else:
        assert isinstance(why, str) and why, why


def test_cuda_lowering_runs_cublaslt_or_falls_back():
    """Lowered for CUDA (jax.export, on any machine): the cuBLASLt custom call where it can run; where
    the CUDA module is built but cannot run it (no Hopper, no cuBLASLt), the reference with one
    Fp8GemmFallbackWarning saying why; without the CUDA module, the reference and no warning."""
    from jax import export
    from jax_fp8 import _ffi

    rng = np.random.default_rng(4)
    qa = jf.quantize_blockwise(data(rng, (64, 256), F32), layout="gemm_ready")
    qb = jf.quantize_blockwise(data(rng, (32, 256), F32), block=B2, layout="gemm_ready")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # our custom call has no cross-version guarantee: export checks that unless told not to
        ok = [export.DisabledSafetyCheck.custom_call("jf_cublaslt_gemm")]
        gemm = jax.jit(lambda a, b: G.fp8_gemm(a, b, F32))
        text = export.export(gemm, platforms=["cuda"], disabled_checks=ok)(qa, qb).mlir_module()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, jf.Fp8GemmFallbackWarning)]
    why = cublaslt.unavailable()
    called = "custom_call @jf_cublaslt_gemm" in text  # the call itself (source locations may name it too)
    if _ffi.AVAILABLE["cuda"] and why is None:
        assert called and not fallbacks, fallbacks
    elif _ffi.AVAILABLE["cuda"]:
        assert not called and len(fallbacks) == 1 and why in fallbacks[0], (why, fallbacks)
    else:
        assert not called and not fallbacks, fallbacks


def test_gemm_operand_orientations():
    """gemm_operand of either layout and usage: the same values as the tensor's dequantized view."""
    rng = np.random.default_rng(3)
    x = data(rng, (3, 70, 200), F32)
    for block in (B1, B2):
        for layout in ("compact", "gemm_ready"):
            q = jf.quantize_blockwise(x, block=block, colwise=True, layout=layout)
            last, first = G.gemm_operand(q, "last"), G.gemm_operand(q, "first")
            assert last.shape == (210, 200) and first.shape == (200, 210) and last.block == first.block == block
            assert_bits_equal(last.values(), deq(q).astype(np.float32), "rowwise")
            assert_bits_equal(first.values(), deq(q, "colwise").T.astype(np.float32), "colwise")
    only_row = jf.quantize_blockwise(x)
    assert G.gemm_operand(only_row, "first") is None
    tiles = jf.quantize_blockwise(x, block=B2, layout="gemm_ready")  # rowwise only: tiles serve both
    assert_bits_equal(G.gemm_operand(tiles, "first").values(), deq(tiles).T.astype(np.float32), "tiles")
    mx = jf.quantize_mxfp8(x, rowwise=True, colwise=True)  # MXFP8: E8M0 scales along the contraction, (1, 32)
    last, first = G.gemm_operand(mx, "last"), G.gemm_operand(mx, "first")
    assert last.block == first.block == (1, 32) and first.shape == (200, 210)
    assert_bits_equal(last.values(), deq(mx).astype(np.float32), "mxfp8 rowwise")
    assert_bits_equal(first.values(), deq(mx, "colwise").T.astype(np.float32), "mxfp8 colwise")
    with pytest.raises(TypeError, match="BlockwiseTensor or MXFP8Tensor"):
        G.gemm_operand(x)


# ---- batching of the primitive ----------------------------------------------------------------------
@pytest.mark.parametrize("case", ["a", "b_1d", "b_tiles_fold", "b_tiles_loop", "both", "c_only"])
def test_gemm_vmap(case):
    rng = np.random.default_rng(stable_seed(case))
    S, M, K = 3, 16, 256
    N = 128 if case == "b_tiles_fold" else 24
    b_block = B1 if case == "b_1d" else B2
    qs = [_aligned(rng, M, N, K, B1, b_block) for _ in range(S)]
    stack = lambda i, f: jnp.stack([getattr(q[i], f) for q in qs])  # noqa: E731
    a0, b0 = qs[0][2], qs[0][3]
    c = data(rng, (S, M, N), F32)
    ops = {"a": (stack(2, "data"), stack(2, "scale"), b0.data, b0.scale),
           "b": (a0.data, a0.scale, stack(3, "data"), stack(3, "scale")),
           "both": (stack(2, "data"), stack(2, "scale"), stack(3, "data"), stack(3, "scale")),
           "c_only": (a0.data, a0.scale, b0.data, b0.scale)}[case if case in ("a", "both", "c_only") else "b"]
    axes = tuple(0 if x.ndim == 3 else None for x in ops) + (0,)
    f = partial(fp8_gemm_bind, a_block=B1, b_block=b_block, out_dtype=F32, backend=CUBLASLT)
    out = jax.vmap(lambda a, sa, b, sb, c: f(a, sa, b, sb, c), in_axes=axes)(*ops, c)
    for i in range(S):
        a = qs[i][0] if axes[0] == 0 else qs[0][0]
        b = qs[i][1] if axes[2] == 0 else qs[0][1]
        check_gemm(out[i], deq(a), deq(b), F32, c=f64(c[i]), what=f"{case} example {i}")
    jaxpr = str(jax.make_jaxpr(jax.vmap(lambda *o: f(*o), in_axes=axes))(*ops, c))
    folds = case in ("a", "b_1d", "b_tiles_fold")
    assert ("scan" not in jaxpr) == folds, jaxpr


# ---- MXFP8 interop --------------------------------------------------------------------------------
def _scaled_matmul(a, b, sa, sb):
    """jax.nn.scaled_matmul where this platform lowers it (cuDNN on Blackwell, ROCm); on CPU (jax 0.10
    registers no CPU rule) the op its ROCm rule lowers to: lax.scaled_dot, batch 0, contracting the last
    dims of both, (B, M, K) x (B, N, K) -> (B, M, N). Shapes are checked by scaled_matmul's own
    validation on every platform (jax.eval_shape)."""
    shape = jax.eval_shape(jax.nn.scaled_matmul, a, b, sa, sb)
    try:
        out = jax.nn.scaled_matmul(a, b, sa, sb)
    except NotImplementedError:
        out = lax.scaled_dot(a, b, lhs_scale=sa, rhs_scale=sb, dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)
    assert out.shape == shape.shape and out.dtype == shape.dtype
    return out[0]


@pytest.mark.skipif(not hasattr(lax, "scaled_dot"), reason="this jax has no lax.scaled_dot")
@pytest.mark.parametrize("M,N,K", [(33, 40, 100)], ids=str)
def test_mxfp8_scaled_matmul_operands(M, N, K):
    rng = np.random.default_rng(stable_seed("mx", M, N, K))
    x, w = data(rng, (M, K), BF16, outliers=True), data(rng, (N, K), BF16)
    qx, qw = jf.quantize_mxfp8(x, colwise=True), jf.quantize_mxfp8(w)
    a, sa = jf.mxfp8_scaled_matmul_operands(qx)
    b, sb = jf.mxfp8_scaled_matmul_operands(qw)
    assert a.shape == (1, M, -(-K // 32) * 32) and sa.shape == (1, M, -(-K // 32)) and sa.dtype == jnp.float8_e8m0fnu
    check_gemm(_scaled_matmul(a, b, sa, sb), deq(qx), deq(qw), F32, what="rowwise")
    # columnwise usages (a wgrad's operands): xᵀ (K, M) contracted over M, either layout
    g = data(rng, (M, N), BF16)
    qg = jf.quantize_mxfp8(g, colwise=True, layout="gemm_ready")
    xt, sxt = jf.mxfp8_scaled_matmul_operands(qx, "colwise")
    gt, sgt = jf.mxfp8_scaled_matmul_operands(qg, "colwise")
    check_gemm(_scaled_matmul(gt, xt, sgt, sxt), deq(qg, "colwise").T, deq(qx, "colwise").T, F32, what="colwise")
    with pytest.raises(TypeError, match="MXFP8Tensor"):
        jf.mxfp8_scaled_matmul_operands(jf.quantize_blockwise(x))
    with pytest.raises(ValueError, match="usage must be"):
        jf.mxfp8_scaled_matmul_operands(qx, "tile")
