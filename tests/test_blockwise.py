"""Float8 blockwise (1x128, 128x1, 128x128; fp32 scales): kernels against the reference, bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from helpers import (FP8_DTYPES, IN_DTYPES, assert_bits_equal, assert_dequantize_within_half_step,
                     assert_tensors_equal, check_against_reference, on_cpu, random_input, stable_seed)
from jax_fp8.reference import block_scale_from_amax

SHAPES = [(1, 1), (1, 129), (5, 128), (127, 100), (128, 128), (129, 257), (200, 384), (3, 50, 130), (300,)]


def _check(x, **kw):
    return check_against_reference(jf.quantize_blockwise, jf.reference.quantize_blockwise, x, **kw)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=str)
def test_matches_reference(shape, in_dtype, block):
    rng = np.random.default_rng(stable_seed(shape, in_dtype, block))
    x = random_input(rng, shape, in_dtype)
    for fp8 in FP8_DTYPES:
        q = _check(x, block=block, dtype=fp8, colwise=True)
        M, K = int(np.prod(shape[:-1])), shape[-1]
        if block == (1, 128):
            assert q.rowwise_scale_inv.shape == (M, -(-K // 128))
            assert q.colwise_scale_inv.shape == (-(-M // 128), K)
        else:
            assert q.rowwise_scale_inv.shape == (-(-M // 128), -(-K // 128))
        assert q.rowwise_scale_inv.dtype == jnp.float32 and q.rowwise_data.shape == shape


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-3, 4.0])
def test_options(pow2, eps):
    rng = np.random.default_rng(stable_seed("options", pow2, eps))
    x = random_input(rng, (130, 260), jnp.bfloat16).copy()
    x[5] = 0  # an all-zero row: its amax is 0, lifted to amax_epsilon when that is > 0
    x[7] = (x[7].astype(np.float32) * np.float32(1e-4)).astype(x.dtype)  # a tiny row: amax below epsilon
    for block in [(1, 128), (128, 128)]:
        q = _check(x, block=block, pow2_scales=pow2, amax_epsilon=eps, colwise=True)
        _check(x, block=block, pow2_scales=pow2, amax_epsilon=eps, colwise=True, rowwise=False)
        if block != (1, 128):
            continue
        # the zero row's scale, by hand: 1 with eps = 0; else 448/eps (pow2: rounded down to 2^k)
        if eps == 0:
            want = np.float32(1.0)
        else:
            scale = np.float32(448.0) / np.float32(eps)
            want = np.float32(1.0) / (np.float32(2.0 ** np.floor(np.log2(scale))) if pow2 else scale)
        si = np.asarray(q.rowwise_scale_inv)
        np.testing.assert_array_equal(si[5], np.full(si.shape[1], want))
        # blocks of the tiny row whose amax fell below eps share the zero row's scale
        row7 = x[7].astype(np.float32)
        amax = np.fmax.reduce(np.abs(np.pad(row7, (0, -row7.size % 128))).reshape(-1, 128), axis=1)  # NaN ignored
        below = amax < eps
        assert eps != 4.0 or below.any(), amax  # with eps = 4 the tiny row has such blocks
        np.testing.assert_array_equal(si[7][below], si[5][below])


def test_scale_rule_hand_cases():
    """TE's compute_scale_from_amax, worked by hand (E4M3, fp32 input unless noted)."""
    f32max = np.float32(np.finfo(np.float32).max)
    a = lambda *v: np.array(v, np.float32)  # noqa: E731
    s = lambda amax, pow2=True, eps=0.0, inf=f32max: block_scale_from_amax(amax, jnp.float8_e4m3fn, pow2, eps, inf)  # noqa: E731
    np.testing.assert_array_equal(s(a(0.0, np.inf, np.nan)), a(1, 1, 1))     # trivial amaxes -> 1
    np.testing.assert_array_equal(s(a(448.0, 224.0, 300.0, 1.0)), a(1, 2, 1, 256))  # pow2: 1.493 -> 1, 448 -> 256
    np.testing.assert_array_equal(s(a(300.0), pow2=False), a(np.float32(448) / np.float32(300)))
    np.testing.assert_array_equal(s(a(0.5), eps=1.0, pow2=False), a(448.0))    # amax raised to epsilon
    np.testing.assert_array_equal(s(a(0.0), eps=1.0, pow2=False), a(448.0))    # epsilon also lifts zero
    np.testing.assert_array_equal(s(a(1e-45), pow2=False), a(f32max))          # 448/1e-45 = inf -> fp32 max
    np.testing.assert_array_equal(s(a(1e-45)), a(2.0**127))                   # ... rounded down to 2^127
    bf16max = np.float32(jnp.finfo(jnp.bfloat16).max)
    np.testing.assert_array_equal(s(a(1e-45), pow2=False, inf=bf16max), a(bf16max))


def test_subnormal_block_uses_input_dtype_max():
    """A bf16 block of subnormals: 448/amax overflows, the scale becomes bf16's max (pow2: 2^127)."""
    x = np.zeros((2, 128), np.float32)
    x[0, :4] = [1e-40, -2e-40, 3e-40, 0.0]
    x = x.astype(jnp.bfloat16)
    q = _check(x)
    np.testing.assert_array_equal(np.asarray(q.rowwise_scale_inv), np.array([[2.0**-127], [1.0]], np.float32))
    assert np.asarray(q.rowwise_data).view(np.uint8)[0, :3].tolist() != [0, 0, 0]


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=str)
def test_dequantize_error_bound(fp8, block):
    rng = np.random.default_rng(stable_seed("blockwise dequantize error bound", fp8, block))
    x = random_input(rng, (200, 300), jnp.float32, specials=False)
    q = jf.quantize_blockwise(x, block=block, dtype=fp8, colwise=True)
    assert_dequantize_within_half_step(x, q, fp8, lambda si: si.astype(np.float64))


def test_jit_vmap_grad():
    rng = np.random.default_rng(2)
    x = random_input(rng, (3, 130, 200), jnp.float16)
    qv = jax.jit(jax.vmap(lambda v: jf.quantize_blockwise(v, block=(128, 128))))(x)
    for i in range(3):
        assert_tensors_equal(jax.tree_util.tree_map(lambda a: a[i], qv),
                             on_cpu(jf.reference.quantize_blockwise, x[i], block=(128, 128)))
    w = rng.standard_normal((130, 200)).astype(np.float32)
    g = jax.grad(lambda v: (jf.quantize_dequantize(v, "blockwise", block=(1, 128)) * w).sum())(x[0].astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(g), w)


def test_bad_arguments():
    x = jnp.ones((4, 128))
    for block in [(1, 32), (128, 1), (64, 64), (2, 128), 128, "1x128"]:
        with pytest.raises(ValueError, match="block must be"):
            jf.quantize_blockwise(x, block=block)
    for eps in [-1.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="amax_epsilon"):
            jf.quantize_blockwise(x, amax_epsilon=eps)
    with pytest.raises(TypeError, match="dtype must be"):
        jf.quantize_blockwise(x, dtype=jnp.int8)
    with pytest.raises(TypeError, match="x must have dtype"):
        jf.quantize_blockwise(jnp.ones((4, 128), jnp.float64) if jax.config.x64_enabled else jnp.ones((4, 128), jnp.int8))
    with pytest.raises(ValueError, match="rank"):
        jf.quantize_blockwise(jnp.float32(2))
    with pytest.raises(ValueError, match="fmt"):
        jf.quantize_dequantize(x, "nvfp4")


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=str)
@pytest.mark.parametrize("layout", ["compact", "gemm_ready"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_saturate_inf_false_gives_infinite_scales(block, layout, in_dtype):
    """saturate_inf=False (the GEMM recipe's): kernels equal the reference bit for bit; a block whose
    amax is inf stores scale_inv inf and every other scale, and all the data, is TE's (saturate_inf=True)."""
    rng = np.random.default_rng(stable_seed("saturate_inf", block, layout, in_dtype))
    x = random_input(rng, (260, 390), in_dtype).copy()  # specials: inf, nan, subnormals, huge
    x[3, 7], x[200, 300] = np.inf, -np.inf  # at least two infinite blocks, whatever the draw
    s = jf.Scheme("blockwise", block=block, rowwise=True, colwise=True, layout=layout, saturate_inf=False)
    q = check_against_reference(jf.quantize, jf.reference.quantize, x, scheme=s)
    te = jf.quantize(x, jf.Scheme("blockwise", block=block, rowwise=True, colwise=True, layout=layout))
    assert q.scheme.saturate_inf is False and q.scheme == s
    amax_inf = {}
    for usage, (bm, bk) in q.usage_blocks().items():
        assert_bits_equal(getattr(q, f"{usage}_data"), getattr(te, f"{usage}_data"), usage)
        cq, ct = (jf.to_layout(t, "compact") for t in (q, te))
        got, want = (np.asarray(getattr(t, f"{usage}_scale_inv")) for t in (cq, ct))
        xb = np.abs(np.pad(x.astype(np.float32), ((0, -260 % bm), (0, -390 % bk))))
        amax_inf[usage] = np.isinf(xb.reshape(xb.shape[0] // bm, bm, -1, bk)).any(axis=(1, 3))
        assert amax_inf[usage].sum() >= 2
        np.testing.assert_array_equal(np.isposinf(got), amax_inf[usage])
        np.testing.assert_array_equal(got[~amax_inf[usage]], want[~amax_inf[usage]])
        y = np.asarray(jf.dequantize(q, jnp.float32, usage))
        rows, cols = np.nonzero(amax_inf[usage])
        assert not np.isfinite(y[rows[0] * bm:(rows[0] + 1) * bm, cols[0] * bk:(cols[0] + 1) * bk]).any()
