"""GEMM-ready layouts: the quantize kernels write columnwise data transposed and Float8 blockwise scales in
cuBLASLt's order in the same pass; bit for bit the compact tensor rearranged (and the reference)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from helpers import FP8_DTYPES, IN_DTYPES, assert_bits_equal, assert_tensors_equal, on_cpu, random_input, stable_seed

SHAPES = [(1, 1), (1, 130), (3, 129), (127, 100), (128, 128), (129, 257), (200, 384), (256, 260), (3, 50, 130),
          (300,)]
PAD = 1.0


def _round4(n):
    return -(-n // 4) * 4


def _check_against_compact(q, c):
    """``q`` (GEMM-ready) is the compact ``c`` rearranged, pads included, by hand (not through to_layout)."""
    M, K = int(np.prod(c.shape[:-1])), c.shape[-1]
    assert q.layout == "gemm_ready" and c.layout == "compact"
    if c.has_rowwise:
        assert_bits_equal(q.rowwise_data, c.rowwise_data, "rowwise data")
    if c.has_colwise:
        assert q.colwise_data.shape == (K, M)
        assert_bits_equal(q.colwise_data, np.asarray(c.colwise_data).reshape(M, K).T, "colwise data = transpose")
    if isinstance(c, jf.MXFP8Tensor):
        for u in ("rowwise", "colwise"):
            if getattr(c, f"has_{u}"):
                assert_bits_equal(getattr(q, f"{u}_scale_inv"), getattr(c, f"{u}_scale_inv"), f"{u} scales (compact)")
        return
    tiles = tuple(c.block) == (128, 128)
    for u in ("rowwise", "colwise"):
        if not getattr(c, f"has_{u}"):
            continue
        grid = np.asarray(getattr(c, f"{u}_scale_inv"))
        want = grid.T if (u == "rowwise") != tiles else grid  # 1x128 rowwise and 128x128 colwise: transposed
        got = np.asarray(getattr(q, f"{u}_scale_inv"))
        assert got.shape == (want.shape[0], _round4(want.shape[1])), (u, got.shape, want.shape)
        assert_bits_equal(got[:, :want.shape[1]], want, f"{u} scales")
        assert (got[:, want.shape[1]:] == PAD).all(), f"{u} scale padding"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=str)
def test_blockwise_gemm_ready(shape, in_dtype, block):
    x = random_input(np.random.default_rng(stable_seed(shape, in_dtype, block)), shape, in_dtype)
    for fp8 in FP8_DTYPES:
        for rowwise, colwise in [(True, True), (True, False), (False, True)]:
            kw = dict(block=block, dtype=fp8, rowwise=rowwise, colwise=colwise)
            q = jf.quantize_blockwise(x, layout="gemm_ready", **kw)
            c = jf.quantize_blockwise(x, **kw)
            assert_tensors_equal(q, on_cpu(jf.reference.quantize_blockwise, x, layout="gemm_ready", **kw))
            _check_against_compact(q, c)
            assert_tensors_equal(jf.to_layout(c, "gemm_ready"), q)
            assert_tensors_equal(jf.to_layout(q, "compact"), c)
            for u in ("rowwise", "colwise"):
                if getattr(c, f"has_{u}"):
                    assert_bits_equal(jf.dequantize(q, usage=u), jf.dequantize(c, usage=u), u)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mxfp8_transposed_colwise(shape, in_dtype):
    x = random_input(np.random.default_rng(stable_seed(shape, in_dtype, "mx")), shape, in_dtype)
    for rowwise, colwise in [(True, True), (False, True), (True, False)]:
        kw = dict(rowwise=rowwise, colwise=colwise)
        q = jf.quantize_mxfp8(x, layout="gemm_ready", **kw)
        c = jf.quantize_mxfp8(x, **kw)
        assert_tensors_equal(q, on_cpu(jf.reference.quantize_mxfp8, x, layout="gemm_ready", **kw))
        _check_against_compact(q, c)
        assert_tensors_equal(jf.to_layout(q, "compact"), c)


@pytest.mark.parametrize("shape", [(0, 130), (5, 0), (0,)], ids=str)
def test_empty(shape):
    q = jf.quantize_blockwise(jnp.zeros(shape, jnp.bfloat16), colwise=True, layout="gemm_ready")
    M, K = int(np.prod(shape[:-1])), shape[-1]
    assert q.colwise_data.shape == (K, M) and q.rowwise_data.shape == shape
    assert q.rowwise_scale_inv.shape == (-(-K // 128), _round4(M)) and q.colwise_scale_inv.shape == (-(-M // 128), _round4(K))
    assert jf.dequantize(q, usage="colwise").shape == shape


def test_jit_vmap_pytree():
    x = random_input(np.random.default_rng(3), (3, 130, 200), jnp.bfloat16)
    f = jax.jit(jax.vmap(lambda v: jf.quantize_blockwise(v, colwise=True, layout="gemm_ready")))
    qv = f(x)
    assert qv.colwise_data.shape == (3, 200, 130) and qv.rowwise_scale_inv.shape == (3, 2, 132)
    for i in range(3):
        qi = jax.tree_util.tree_map(lambda a: a[i], qv)  # noqa: B023
        assert_tensors_equal(qi, on_cpu(jf.reference.quantize_blockwise, x[i], colwise=True, layout="gemm_ready"))
    y = jax.jit(jax.vmap(lambda q: jf.dequantize(q, usage="colwise")))(qv)
    assert_bits_equal(y[1], jf.dequantize(jf.quantize_blockwise(x[1], colwise=True), usage="colwise"))
    leaves, tree = jax.tree_util.tree_flatten(qv)
    assert jax.tree_util.tree_unflatten(tree, leaves).layout == "gemm_ready" and "gemm_ready" in repr(qv)
    back = jax.jit(jax.vmap(lambda q: jf.to_layout(q, "compact")))(qv)
    assert_tensors_equal(jax.tree_util.tree_map(lambda a: a[2], back), jf.quantize_blockwise(x[2], colwise=True))


def test_bad_layout():
    with pytest.raises(ValueError, match="layout"):
        jf.quantize_blockwise(jnp.ones((4, 128)), layout="swizzled")
    with pytest.raises(ValueError, match="layout"):
        jf.to_layout(jf.quantize_mxfp8(jnp.ones((4, 32))), "transposed")
