"""``fp8_dot_general`` with the MXFP8 recipe (``jf.MXFP8BlockScaling``): forward and both gradients
against fp64 products of operands quantized independently (the jax.numpy reference, dequantized in
NumPy), pre-quantized MXFP8 operands used as given, one quantization of each tensor, the fallback
warning where no block-scaled MXFP8 GEMM runs, and the CUDA lowering (``jax.export``): cuDNN's
block-scaled GEMM on our quantized operands, for all three GEMMs."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_fp8 as jf
from jax_fp8.gemm.backends import cudnn
from jax_fp8 import MXFP8GemmFallbackWarning
from helpers import assert_bits_equal, deq, on_cpu, stable_seed
from test_dot_general_vjp import _fwd_bwd, _wide, accumulation_bound, assert_three_gemms_within
from test_gemm import TINY, assert_within

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
KN = (((1,), (0,)), ((), ()))
NK = (((1,), (1,)), ((), ()))
#: (x shape, N, dtype, grad dtype, W as (K, N)): M, K, N off the 32 grid (partial blocks), aligned, and
#: a (B, S, K) lhs
CASES = [((37, 300), 50, F32, E4M3, True), ((130, 257), 129, BF16, E5M2, False), ((2, 20, 130), 72, BF16, E4M3, True),
         ((256, 384), 256, F32, E5M2, False)]


@pytest.fixture
def quiet():
    """The MXFP8 GEMMs run as their reference on this machine: their one warning is tested below."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MXFP8GemmFallbackWarning)
        yield


def _ref64(v, dtype, usage):
    """fp64 (rows, cols) of ``v``'s 2-D view quantized by the reference MXFP8 quantizer, ``usage``
    (rowwise: 1x32 blocks along the last dim; colwise: 32x1 along the first) dequantized in NumPy."""
    v = np.asarray(v).reshape(-1, v.shape[-1])
    q = on_cpu(jf.reference.quantize_mxfp8, v, dtype=dtype, rowwise=usage == "rowwise", colwise=usage == "colwise")
    return deq(q, usage)


@pytest.mark.parametrize("xshape,N,dtype,grad_dtype,kn", CASES, ids=str)
def test_vjp_against_fp64_of_independent_quantizations(xshape, N, dtype, grad_dtype, kn, quiet):
    """fprop y = x̃ · W̃ (x and W in 1x32 / 32x1 blocks along K), dgrad dx = d̃y · W̃ᵀ (dy and W along
    N), wgrad dW = x̃ᵀ · d̃y (x and dy along M: the columnwise usages), each within the fp32 accumulation
    bound of its contraction (test_dot_general_vjp.accumulation_bound; the E8M0 scales are powers of two,
    so dequantizing is exact). Rows and columns are scaled by powers of two over 2^12, so a GEMM reading
    the wrong usage falls outside the bounds."""
    rng = np.random.default_rng(stable_seed("mx vjp", xshape, N, dtype, grad_dtype, kn))
    K = xshape[-1]
    x, w, g = (_wide(rng, s, dtype) for s in (xshape, (K, N) if kn else (N, K), (*xshape[:-1], N)))
    recipe = jf.MXFP8BlockScaling(grad_dtype=grad_dtype)
    dn = (((len(xshape) - 1,), (0 if kn else 1,)), ((), ()))
    f = lambda x, w: jf.fp8_dot_general(x, w, dn, recipe=recipe)  # noqa: E731
    y, dx, dw = jax.jit(_fwd_bwd(f))(x, w, g)
    assert y.dtype == dx.dtype == dw.dtype == dtype and dx.shape == x.shape and dw.shape == w.shape
    # W (K, N): K is its first dim (columnwise usage over K), N its last; W (N, K) the other way round
    w_over_k, w_over_n = (("colwise", "rowwise") if kn else ("rowwise", "colwise"))
    Wk = _ref64(w, E4M3, w_over_k)  # W's own shape, blocks along K
    Wn = _ref64(w, E4M3, w_over_n)  # blocks along N
    Wk_nk, Wn_nk = (Wk.T, Wn.T) if kn else (Wk, Wn)  # as (N, K)
    Xr, Xc = _ref64(x, E4M3, "rowwise"), _ref64(x, E4M3, "colwise")  # (M, K)
    Gr, Gc = _ref64(g, grad_dtype, "rowwise"), _ref64(g, grad_dtype, "colwise")  # (M, N)
    assert_three_gemms_within((y, dx, dw), (Xr, Xc), (Wk_nk, Wn_nk), (Gr, Gc), dtype, kn)


def test_each_tensor_quantized_once_and_one_warning():
    """Forward + backward: one quantize of x, of W and of dy (both usages each), no dequantize of a
    high-precision operand; and one MXFP8GemmFallbackWarning per call where no block-scaled GEMM runs."""
    rng = np.random.default_rng(stable_seed("mx once"))
    x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 256), (256, 96), (64, 96)))
    f = lambda x, w: jf.fp8_dot_general(x, w, KN, recipe=jf.MXFP8BlockScaling())  # noqa: E731
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        jaxpr = str(jax.make_jaxpr(lambda x, w, g: jax.vjp(f, x, w)[1](g))(x, w, g))
    assert jaxpr.count("jf_quantize[") == 3, jaxpr
    ours = [r for r in rec if issubclass(r.category, MXFP8GemmFallbackWarning)]
    assert len(ours) == 1, ours
    msg = str(ours[0].message)
    assert "the MXFP8 GEMMs run as their reference, a bf16 GEMM of the dequantized operands" in msg, msg
    assert "with fp32 accumulation" in msg, msg


def test_prequantized_mxfp8_used_as_given(quiet):
    """An MXFP8Tensor weight is used as it is (the same bits as the weight the call quantizes itself),
    gets no gradient, and is not quantized again."""
    rng = np.random.default_rng(stable_seed("mx pre"))
    x = jnp.asarray(rng.standard_normal((48, 160)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((160, 64)), jnp.float32)
    recipe = jf.MXFP8BlockScaling()
    wq = jf.quantize(w, recipe.scheme("rhs"))
    f = lambda x, w: jf.fp8_dot_general(x, w, KN, recipe=recipe)  # noqa: E731
    assert_bits_equal(jax.jit(f)(x, wq), jax.jit(f)(x, w))
    dx_pre = jax.grad(lambda x: f(x, wq).sum())(x)
    dx, _ = jax.grad(lambda x, w: f(x, w).sum(), (0, 1))(x, w)
    assert_bits_equal(dx_pre, dx)
    jaxpr = str(jax.make_jaxpr(lambda x: jax.grad(lambda x: f(x, wq).sum())(x))(x))
    assert jaxpr.count("jf_quantize[") == 2, jaxpr  # x and dy only


def test_mixing_formats_falls_back_with_a_reason(quiet):
    rng = np.random.default_rng(stable_seed("mx mix"))
    x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
    wb = jf.quantize_blockwise(jnp.asarray(rng.standard_normal((128, 64)), jnp.float32), block=(128, 128))
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="a Float8 blockwise rhs with the MXFP8 recipe"):
        jf.fp8_dot_general(x, wb, KN, recipe=jf.MXFP8BlockScaling())
    with pytest.raises(TypeError, match="recipe must be a Float8BlockScaling or MXFP8BlockScaling"):
        jf.fp8_dot_general(x, x.T, KN, recipe="mxfp8")
    with pytest.raises(TypeError, match="MXFP8BlockScaling: grad_dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2"):
        jf.MXFP8BlockScaling(grad_dtype=jnp.float16)


def test_cuda_lowering_is_the_block_scaled_dot_on_our_operands(quiet, monkeypatch):
    """Exported for CUDA (no GPU needed): the forward and both gradients are three cuDNN block-scaled
    dots (``__op$block_scaled_dot``) whose operands are FP8 data with E8M0 scales, what jax_fp8 quantized
    (no dot_general of dequantized values, no second quantization). The target is a Blackwell: on a
    machine whose own GPUs are older the call would take the reference, so the test says Blackwell."""
    monkeypatch.setattr(cudnn, "lowers_for_cuda", lambda: None)
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    f = lambda x, w: jf.fp8_dot_general(x, w, KN, recipe=jf.MXFP8BlockScaling())  # noqa: E731
    # our own CUDA kernels appear as custom calls too where the CUDA module is built (nvcc found)
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in ("__op$block_scaled_dot", "jf_quantize")]
    exp = export.export(jax.jit(_fwd_bwd(f)), platforms=["cuda"], disabled_checks=checks)(x, w, g)
    calls = [line for line in exp.mlir_module().splitlines() if "custom_call @__op$block_scaled_dot" in line]
    assert len(calls) == 3, calls
    for call in calls:
        assert call.count("f8E4M3FN>") + call.count("f8E5M2>") >= 2 and call.count("f8E8M0FNU>") >= 2, call
    assert "stablehlo.dot_general" not in exp.mlir_module()


def test_collectives_feed_the_recipe_without_requantizing(quiet):
    """Inside the default jax.shard_map over 8 data ranks: MXFP8 master weights cast with one uint8
    scale all-reduce and gathered, and activations gathered as FP8 (32 local rows: whole 32-row
    blocks), go into fp8_dot_general with the MXFP8 recipe as they are: the product equals, bit for bit,
    fp8_dot_general of the full activations and weights in one device, and nothing is quantized after
    the gathers."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_fp8.distributed import all_gather_first_dim, gather_master_weights, quantize_master_weights

    rng = np.random.default_rng(stable_seed("mx collectives"))
    K, N, rows = 256, 96, 32
    x = jnp.asarray(rng.standard_normal((8 * rows, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    recipe = jf.MXFP8BlockScaling()

    def step(x, shard):
        wq, = gather_master_weights(quantize_master_weights([shard[0]], [(K, N)], "data", fmt="mxfp8"), "data")
        xq = all_gather_first_dim(x, "data", recipe.scheme("lhs"))
        return jf.fp8_dot_general(xq, wq, KN, recipe=recipe)[None]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
    shards = jnp.asarray(np.asarray(w).reshape(8, -1))
    args = (jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(shards, NamedSharding(mesh, P("data"))))
    got = np.asarray(f(*args))
    # the one-device product, run on each device of the same mesh (the same platform and GEMM: its sum order)
    whole = jax.jit(jax.shard_map(lambda x, w: jf.fp8_dot_general(x, w.astype(jnp.bfloat16), KN, recipe=recipe)[None],
                                  mesh=mesh, in_specs=(P(), P()), out_specs=P("data")))
    want = np.asarray(whole(jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(w, NamedSharding(mesh, P()))))[0]
    for r in range(8):
        assert_bits_equal(got[r], want, f"rank {r}")
    jaxpr = str(jax.make_jaxpr(f)(*args))
    assert jaxpr.count("jf_quantize[") == 1, jaxpr  # the local activations, before their gather


def test_flax_layers_take_the_recipe(quiet):
    """``fp8_dot_general_for(MXFP8BlockScaling())`` on a linen Dense and ``use_fp8_dot_general(model,
    recipe)`` on an nnx Linear give fp8_dot_general's own result with that recipe, bit for bit."""
    pytest.importorskip("flax")
    from flax import linen as nn, nnx

    from jax_fp8.flax_utils import fp8_dot_general_for, use_fp8_dot_general

    recipe = jf.MXFP8BlockScaling()
    rng = np.random.default_rng(stable_seed("mx flax"))
    x = jnp.asarray(rng.standard_normal((40, 96)), jnp.float32)
    dense = nn.Dense(64, use_bias=False, dot_general=fp8_dot_general_for(recipe))
    params = dense.init(jax.random.key(0), x)
    kernel = params["params"]["kernel"]
    assert_bits_equal(dense.apply(params, x), jf.fp8_dot_general(x, kernel, KN, recipe=recipe))
    linear = nnx.Linear(96, 64, use_bias=False, rngs=nnx.Rngs(0))
    assert use_fp8_dot_general(linear, recipe) == [()]
    assert_bits_equal(linear(x), jf.fp8_dot_general(x, linear.kernel[...], KN, recipe=recipe))


# ---- the reference where no block-scaled GEMM runs: a bf16 GEMM of the dequantized operands --------------
def _mx_operand(rng, rows, K, kind):
    """(rows, K) float32 values for the reference MXFP8 quantizer: normal values with rows scaled by
    2**[-8, 8); ``kind`` plants zeros (whole blocks and single entries), tiny rows (scaled by
    2**[-122, -112]: E8M0 scales down to 2**-130, their small entries dequantized below bf16's normal
    range, 2**-126),
    or a NaN and an infinity (their blocks' scales become NaN)."""
    v = rng.standard_normal((rows, K)) * 2.0 ** rng.integers(-8, 8, size=(rows, 1))
    if kind == "zeros":
        v[rng.random((rows, K)) < 0.2] = 0.0
        v[:, :min(K, 32)][rng.random(rows) < 0.5] = 0.0
    elif kind == "tiny":  # blocks whose E8M0 scales are ~2**-126: their small entries dequantize below it
        tiny = rng.random(rows) < 0.6
        v[tiny] = rng.standard_normal((tiny.sum(), K)) * 2.0 ** -rng.integers(112, 123, size=(tiny.sum(), 1))
    elif kind == "nonfinite":
        v[rng.integers(rows), rng.integers(K)] = np.nan
        v[rng.integers(rows), rng.integers(K)] = np.inf
    return v.astype(np.float32)


#: (M, N, K, kind): K across the residues of the 32 block (1, 31, 0, 1, 17, 0), with zeros, tiny values
#: below bf16's normal range, and NaN/inf
MX_GEMM_CASES = [(M, N, K, kind) for (M, N, K), kind in zip(
    [(1, 3, 1), (5, 40, 31), (33, 8, 32), (17, 9, 33), (40, 24, 81), (64, 48, 160), (7, 5, 95), (3, 70, 257)],
    ["plain", "zeros", "tiny", "nonfinite", "tiny", "zeros", "nonfinite", "tiny"])]


@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("M,N,K,kind", MX_GEMM_CASES, ids=str)
def test_mx_reference_against_fp64_of_independent_quantizations(M, N, K, kind, out_dtype):
    """The MXFP8 GEMM where cuDNN's does not run (this machine), fp8_gemm and implementation="reference"
    alike: a bf16 GEMM of the dequantized operands with fp32 accumulation
    (``jax_fp8.gemm.reference.mx_gemm_reference``). Against the fp64 product of operands quantized
    independently (the jax.numpy reference evaluated in NumPy, dequantized in NumPy): every dequantized
    value of magnitude >= 2**-126 is exact in bf16, a smaller one is off by less than 2**-126 (bf16's
    subnormal rounding, or XLA CPU's flush to zero), and products of bf16 values are exact in fp32. So
    |got - exact| <= the fp32 accumulation bound of the contraction + sum_k (|ã_k| + |b̃_k|) * 2**-126 +
    K * 2**-252, within the output's rounding; NaN and inf exactly where the fp64 product has them."""
    rng = np.random.default_rng(stable_seed("mx reference", M, N, K, kind))
    a, b = _mx_operand(rng, M, K, kind), _mx_operand(rng, N, K, kind)
    qa, qb = (on_cpu(jf.reference.quantize_mxfp8, v) for v in (a, b))
    A, B = deq(qa), deq(qb)
    with np.errstate(invalid="ignore", over="ignore"):
        exact = A @ B.T
    got = jax.jit(lambda qa, qb: jf.gemm.fp8_gemm(qa, qb, out_dtype))(qa, qb)
    ref = jax.jit(lambda qa, qb: jf.gemm.fp8_gemm(qa, qb, out_dtype, backend="reference"))(qa, qb)
    assert_bits_equal(got, ref)  # NaN payloads included: before any conversion
    got = np.asarray(got).astype(np.float64)
    nonfinite = ~np.isfinite(exact)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exact), "NaN where the fp64 product has one")
    np.testing.assert_array_equal(np.isinf(got) & nonfinite, np.isinf(exact), "inf where the fp64 product has one")
    finite_rows, finite_cols = np.isfinite(A).all(1), np.isfinite(B).all(1)
    A, B = A[finite_rows], B[finite_cols]
    exact, acc = accumulation_bound(A, B, out_dtype)
    small = (np.abs(A) @ np.ones((K, B.shape[0])) + np.ones((A.shape[0], K)) @ np.abs(B).T) * TINY + K * 2.0**-252
    assert_within(got[np.ix_(finite_rows, finite_cols)], exact, acc + small, f"{kind} {M}x{N}x{K}")
    if kind == "tiny":  # the case exercises values below bf16's normal range
        assert ((np.abs(deq(qa)) < TINY) & (deq(qa) != 0)).any() or ((np.abs(deq(qb)) < TINY) & (deq(qb) != 0)).any()
