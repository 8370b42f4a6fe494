"""MXFP8: FFI kernels (CPU here, CUDA on a GPU backend) against the jax.numpy reference, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_fp8 as jf
from helpers import (FP8_DTYPES, IN_DTYPES, assert_bits_equal, assert_dequantize_within_half_step,
                     assert_tensors_equal, check_against_reference, on_cpu, random_input, stable_seed)

SHAPES = [(1, 1), (1, 33), (5, 32), (31, 17), (32, 32), (33, 65), (64, 256), (70, 100), (129, 257),
          (3, 5, 40), (2, 3, 33, 64), (1000,)]


def _check(x, dtype, rowwise, colwise):
    return check_against_reference(jf.quantize_mxfp8, jf.reference.quantize_mxfp8, x, dtype=dtype, rowwise=rowwise,
                                   colwise=colwise)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rowwise_and_colwise_one_pass(shape, in_dtype, fp8):
    rng = np.random.default_rng(stable_seed(shape, in_dtype, fp8))
    x = random_input(rng, shape, in_dtype)
    q = _check(x, fp8, True, True)
    M, K = int(np.prod(shape[:-1])), shape[-1]
    assert q.rowwise_data.shape == shape and q.rowwise_data.dtype == fp8
    assert q.rowwise_scale_inv.shape == (M, -(-K // 32)) and q.rowwise_scale_inv.dtype == jnp.uint8
    assert q.colwise_scale_inv.shape == (-(-M // 32), K)


@pytest.mark.parametrize("rowwise,colwise", [(True, False), (False, True)])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_single_usage(rowwise, colwise, in_dtype):
    rng = np.random.default_rng(stable_seed("single usage", rowwise, colwise, in_dtype))
    for shape in [(33, 65), (96, 512), (7, 3, 64)]:
        q = _check(random_input(rng, shape, in_dtype), jnp.float8_e4m3fn, rowwise, colwise)
        assert q.has_rowwise == rowwise and q.has_colwise == colwise


def test_no_specials_large_random():
    """Plain random data over a larger matrix (many tiles), fresh seed per dtype."""
    for i, d in enumerate(IN_DTYPES):
        x = random_input(np.random.default_rng(100 + i), (300, 1000), d, specials=False)
        _check(x, jnp.float8_e4m3fn, True, True)


@pytest.mark.parametrize("shape", [(4500, 64), (4500, 40), (3, 1500, 24)], ids=str)
def test_many_rows(shape):
    """Tall inputs: the GPU dequantize kernel walks several rows per thread (grid-stride over rows)."""
    x = random_input(np.random.default_rng(stable_seed("many rows", shape)), shape, jnp.bfloat16)
    for out in (jnp.bfloat16, jnp.float16, jnp.float32):
        q = jf.quantize_mxfp8(x, rowwise=True, colwise=True)
        r = on_cpu(jf.reference.quantize_mxfp8, x, rowwise=True, colwise=True)
        assert_tensors_equal(q, r)
        for usage in ("rowwise", "colwise"):
            assert_bits_equal(jf.dequantize(q, out, usage), on_cpu(jf.reference.dequantize, r, dtype=out, usage=usage), usage)


@pytest.mark.parametrize("fmt", ["mxfp8", "blockwise"])
def test_dequantize_batched_many_rows(fmt):
    """vmap'd dequantize (a batch of 3 matrices in one call) with more rows than the GPU kernel's grid:
    each thread walks several rows and crosses from one matrix into the next."""
    x = random_input(np.random.default_rng(stable_seed("batched many rows", fmt)), (3, 1500, 136), jnp.bfloat16)
    quant, ref = {"mxfp8": (jf.quantize_mxfp8, jf.reference.quantize_mxfp8),
                  "blockwise": (jf.quantize_blockwise, jf.reference.quantize_blockwise)}[fmt]
    quant, ref = functools.partial(quant, colwise=True), functools.partial(ref, colwise=True)
    qv = jax.vmap(quant)(x)
    for out in (jnp.bfloat16, jnp.float16, jnp.float32):
        for usage in ("rowwise", "colwise"):
            y = jax.vmap(lambda q: jf.dequantize(q, out, usage))(qv)  # noqa: B023
            for i in range(3):
                want = on_cpu(jf.reference.dequantize, on_cpu(ref, x[i]), dtype=out, usage=usage)
                assert_bits_equal(y[i], want, f"{usage} {jnp.dtype(out).name} matrix {i}")


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_special_blocks(fp8):
    """Whole blocks of zeros, subnormals, inf, NaN, huge values; NaN stays NaN (0x7F)."""
    fmax = float(jnp.finfo(fp8).max)
    rows = [np.zeros(64), np.full(64, 1e-40), np.full(64, np.nan), np.r_[np.inf, np.ones(63)],
            np.r_[np.nan, np.ones(63) * 3.0], np.r_[-np.inf, np.full(63, np.nan)], np.full(64, 3e38),
            np.r_[fmax, fmax * 1.01, -fmax * 4, np.ones(61)], np.linspace(-1e-38, 1e-38, 64)]
    x = np.stack(rows).astype(np.float32)
    q = _check(x, fp8, True, True)
    data = np.asarray(q.rowwise_data).view(np.uint8)
    sc = np.asarray(q.rowwise_scale_inv)
    assert (data[0] == 0).all() and (sc[0] == 0).all()  # zero block: scale byte 0, data 0
    assert (data[2] == 0x7F).all()  # NaN elements stay (canonical) NaN
    assert sc[3, 0] == 0xFE  # an inf amax saturates the scale
    assert sc[4, 0] == jf.reference.e8m0_from_amax(3.0, fp8)  # NaN is ignored by the amax
    assert data[4, 0] == 0x7F


def test_e8m0_hand_cases():
    """TE's float_to_e8m0(amax * (1/448)), worked by hand for E4M3: v = amax * fp32(1/448), then the
    biased exponent of v, plus 1 when v's mantissa is non-zero (round up to a power of two)."""
    # fp32(1/448) = 1.142857... * 2^-9 (biased exponent 118, mantissa non-zero)
    cases = {
        0.0: 0,          # zero amax -> byte 0 (2^-127); its reciprocal is taken as 1
        448.0: 127,      # 448 * fp32(1/448) rounds to exactly 1.0 = 2^0 -> 0 + 127
        449.0: 128,      # just above 1.0 -> rounds up to 2^1
        896.0: 128,      # exactly 2.0 = 2^1
        1.0: 119,        # v = fp32(1/448): exponent 118, mantissa non-zero -> 119
        3.4e38: 247,     # v ~ 7.589e35 = 1.1419 * 2^119: exponent 119 + 127 = 246, mantissa non-zero -> 247
        np.inf: 0xFE,    # inf amax saturates to the largest scale 2^127
        np.nan: 0xFF,    # NaN amax -> the E8M0 NaN byte
    }
    got = np.asarray(jf.reference.e8m0_from_amax(np.array(list(cases), np.float32)))
    np.testing.assert_array_equal(got, np.array(list(cases.values()), np.uint8))
    # E5M2: 57344 * fp32(1/57344) rounds to 1.0
    assert int(jf.reference.e8m0_from_amax(57344.0, jnp.float8_e5m2)) == 127


def _e8m0_oracle(v: np.ndarray) -> np.ndarray:
    """Independent definition: smallest e in [0, 254] with 2**(e - 127) >= v (float64, exact frexp)."""
    m, ex = np.frexp(v.astype(np.float64))
    e = np.where(m == 0.5, ex - 1, ex) + 127
    return np.where(v == 0, 0, np.clip(e, 0, 254)).astype(np.uint8)


def test_e8m0_matches_ceil_log2_everywhere():
    """Over random fp32 amaxes (v = amax/448 normal and subnormal), the rule is ceil(log2 v) in [0, 254]."""
    rng = np.random.default_rng(3)
    amax = rng.integers(0, 0x7F800000, size=200_000, dtype=np.uint32).view(np.float32)
    rcp = np.float32(1.0) / np.float32(448.0)
    # amaxes around v = 2^-127 (subnormal), 2^-126 (smallest normal) and 2^119 (the largest power of two
    # a finite amax reaches: fp32 max / 448 ~ 2^119.2; v = 2^127 would need amax = 2^127 * 448 = inf),
    # then fp32 max and inf themselves
    edges = np.array([2.0**-127, 2.0**-126, 2.0**119], np.float32) / rcp
    big = np.array([np.finfo(np.float32).max, np.inf], np.float32)
    amax = np.r_[amax, edges, np.nextafter(edges, np.float32(np.inf)), big].astype(np.float32)
    got = jf.reference.e8m0_from_amax(amax)  # NumPy evaluation: IEEE subnormals
    v = amax * rcp  # rcp < 1: no overflow
    np.testing.assert_array_equal(got, np.where(np.isinf(v), 0xFE, _e8m0_oracle(v)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, float(np.finfo(np.float32).max), width=32, allow_subnormal=True), min_size=2, max_size=16))
def test_e8m0_is_monotonic_so_pmax_of_scales_equals_scale_of_pmax(amaxes):
    a = np.array(amaxes, np.float32)
    s = np.asarray(jf.reference.e8m0_from_amax(a))
    assert s.max() == int(jf.reference.e8m0_from_amax(a.max()))
    order = np.argsort(a, kind="stable")
    assert (np.diff(s[order].astype(int)) >= 0).all()


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dequantize_error_bound(fp8):
    """|dequantize(quantize(x)) - x| within half an FP8 step at the block scale (+ output rounding)."""
    rng = np.random.default_rng(stable_seed("mxfp8 dequantize error bound", fp8))
    x = random_input(rng, (96, 160), jnp.float32, specials=False)
    q = jf.quantize_mxfp8(x, dtype=fp8, rowwise=True, colwise=True)
    assert_dequantize_within_half_step(x, q, fp8, lambda sc: 2.0 ** (sc.astype(np.float64) - 127))


def test_jit_vmap_and_batches():
    rng = np.random.default_rng(5)
    x = random_input(rng, (4, 40, 96), jnp.bfloat16)
    f = jax.jit(lambda v: jf.quantize_mxfp8(v, rowwise=True, colwise=True))
    assert_tensors_equal(f(x), on_cpu(jf.reference.quantize_mxfp8, x, rowwise=True, colwise=True))
    # vmap: each example quantized on its own (columnwise blocks do not cross examples)
    qv = jax.vmap(lambda v: jf.quantize_mxfp8(v, rowwise=True, colwise=True))(x)
    for i in range(4):
        qi = jax.tree_util.tree_map(lambda a: a[i], qv)
        assert_tensors_equal(qi, on_cpu(jf.reference.quantize_mxfp8, x[i], rowwise=True, colwise=True))
    yv = jax.vmap(jf.dequantize)(qv)
    assert_bits_equal(yv[2], jf.dequantize(jf.quantize_mxfp8(x[2])))
    # nested vmap and vmap over a non-leading axis
    qn = jax.vmap(jax.vmap(lambda v: jf.quantize_mxfp8(v, colwise=True)), in_axes=1)(x.reshape(4, 5, 8, 96))
    assert qn.colwise_scale_inv.shape == (5, 4, 1, 96)


def test_straight_through_gradient():
    rng = np.random.default_rng(9)
    x = random_input(rng, (64, 96), jnp.float32, specials=False)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    g = jax.grad(lambda v: (jf.quantize_dequantize(v) * w).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), w)  # identity VJP
    fwd = jax.jit(lambda v: jf.quantize_dequantize(v, usage="colwise", dtype=jnp.float8_e5m2))(x)
    assert_bits_equal(fwd, jf.dequantize(jf.quantize_mxfp8(x, jnp.float8_e5m2, False, True)))
    with pytest.raises(TypeError, match="quantize_dequantize"):
        jax.grad(lambda v: jf.dequantize(jf.quantize_mxfp8(v)).sum())(x)


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must have dtype"):
        jf.quantize_mxfp8(jnp.ones((4, 32), jnp.int32))
    with pytest.raises(ValueError, match="rank"):
        jf.quantize_mxfp8(jnp.float32(1.0))
    with pytest.raises(TypeError, match="dtype must be"):
        jf.quantize_mxfp8(jnp.ones((4, 32)), dtype=jnp.float16)
    with pytest.raises(ValueError, match="at least one"):
        jf.quantize_mxfp8(jnp.ones((4, 32)), rowwise=False, colwise=False)
    with pytest.raises(TypeError, match="MXFP8Tensor or BlockwiseTensor"):
        jf.dequantize(jnp.ones(3))
    q = jf.quantize_mxfp8(jnp.ones((4, 32)))
    with pytest.raises(ValueError, match="usage"):
        jf.dequantize(q, usage="colwise")
    with pytest.raises(TypeError, match="dtype"):
        jf.dequantize(q, jnp.int8)


@pytest.mark.parametrize("shape", [(0, 32), (5, 0), (0,), (2, 0, 7)], ids=str)
def test_empty_inputs(shape):
    """Empty input: empty data and scales of the documented shapes; dequantize gives an empty array."""
    q = jf.quantize_mxfp8(jnp.zeros(shape, jnp.bfloat16), rowwise=True, colwise=True)
    M, K = int(np.prod(shape[:-1])), shape[-1]
    assert q.rowwise_data.shape == shape and q.rowwise_scale_inv.shape == (M, -(-K // 32))
    assert q.colwise_scale_inv.shape == (-(-M // 32), K)
    assert jf.dequantize(q).shape == shape


def test_e8m0_dtype_view():
    q = jf.quantize_mxfp8(jnp.arange(64.0).reshape(2, 32))
    if jf._compat.E8M0_DTYPE is None:
        pytest.skip("no float8_e8m0fnu in this jax")
    e = q.rowwise_scale_e8m0
    assert e.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(np.asarray(e.astype(jnp.float32)),
                                  2.0 ** (np.asarray(q.rowwise_scale_inv).astype(np.float64) - 127))


def test_tensors_pass_through_scan():
    """Quantized tensors are pytrees: a scan can carry and produce them."""
    xs = random_input(np.random.default_rng(8), (5, 40, 64), jnp.float32, specials=False)

    def body(carry, x):
        q = jf.quantize_mxfp8(x, colwise=True)
        return q, jf.dequantize(q, usage="colwise")

    init = jf.quantize_mxfp8(jnp.zeros((40, 64)), colwise=True)
    last, ys = jax.lax.scan(body, init, xs)
    assert_tensors_equal(last, jf.quantize_mxfp8(xs[-1], colwise=True))
    assert_bits_equal(ys[2], jf.dequantize(jf.quantize_mxfp8(xs[2], colwise=True), usage="colwise"))
