"""Hand-built or transformed quantized tensors: dequantize checks every field against the tensor's static
layout and raises naming the field (never reinterprets bits); quantize_dequantize's derivatives."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from jax_fp8._compat import E8M0_DTYPE
from helpers import assert_bits_equal, random_input

X = random_input(np.random.default_rng(0), (64, 96), jnp.bfloat16, specials=False)


def test_scales_of_the_wrong_dtype():
    q = jf.quantize_mxfp8(X)
    bad = dataclasses.replace(q, rowwise_scale_inv=q.rowwise_scale_inv.astype(jnp.float32))
    with pytest.raises(TypeError, match="MXFP8Tensor.rowwise_scale_inv must hold E8M0 scales as uint8"):
        jf.dequantize(bad)
    b = jf.quantize_blockwise(X, colwise=True)
    bad = dataclasses.replace(b, colwise_scale_inv=b.colwise_scale_inv.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="BlockwiseTensor.colwise_scale_inv must be float32"):
        jf.dequantize(bad, usage="colwise")


@pytest.mark.skipif(E8M0_DTYPE is None, reason="no float8_e8m0fnu in this jax")
def test_e8m0_scales_are_accepted():
    q = jf.quantize_mxfp8(X, colwise=True)
    e = dataclasses.replace(q, colwise_scale_inv=q.colwise_scale_e8m0)
    assert_bits_equal(jf.dequantize(e, usage="colwise"), jf.dequantize(q, usage="colwise"))


def test_fp8_dtype_must_match_the_data():
    q = jf.quantize_mxfp8(X)
    e5m2 = dataclasses.replace(q.scheme, dtype=jnp.float8_e5m2)
    with pytest.raises(TypeError, match=r"rowwise_data has dtype float8_e4m3fn but the scheme's FP8 dtype is "
                                        r"float8_e5m2"):
        jf.dequantize(q.with_scheme(e5m2))
    with pytest.raises(TypeError, match="dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2"):
        dataclasses.replace(q.scheme, dtype=jnp.float16)  # a scheme is validated where it is built
    with pytest.raises(TypeError, match="MXFP8Tensor: scheme must be a jax_fp8.Scheme with fmt='mxfp8'"):
        dataclasses.replace(q, scheme=jf.Scheme("blockwise"))


def test_leaves_stacked_outside_the_transform():
    xs = jnp.stack([X, X * 2, X * 3])
    qv = jax.vmap(lambda v: jf.quantize_mxfp8(v, colwise=True))(xs)  # aux data says (64, 96), leaves are (3, ...)
    with pytest.raises(ValueError, match=r"rowwise_data has shape \(3, 64, 96\).*stacked"):
        jf.dequantize(qv)
    _, qs = jax.lax.scan(lambda c, v: (c, jf.quantize_blockwise(v, block=(128, 128))), 0, xs)
    with pytest.raises(ValueError, match="stacked"):
        jf.dequantize(qs)
    # inside the transform, or indexed, they are fine
    assert_bits_equal(jax.vmap(jf.dequantize)(qv)[1], jf.dequantize(jf.quantize_mxfp8(X * 2)))
    assert_bits_equal(jf.dequantize(jax.tree_util.tree_map(lambda a: a[2], qs)),
                      jf.dequantize(jf.quantize_blockwise(X * 3, block=(128, 128))))


def test_scale_grid_of_the_wrong_shape():
    q = jf.quantize_blockwise(X, colwise=True)
    with pytest.raises(ValueError, match=r"colwise_scale_inv has shape \(1, 95\), want \(1, 96\)"):
        jf.dequantize(dataclasses.replace(q, colwise_scale_inv=q.colwise_scale_inv[:, :95]), usage="colwise")
    with pytest.raises(ValueError, match="rowwise_scale_inv is None"):
        jf.dequantize(dataclasses.replace(q, rowwise_scale_inv=None))


def test_quantize_dequantize_jvp_is_straight_through():
    x = jnp.asarray(random_input(np.random.default_rng(1), (40, 130), jnp.float32, specials=False))
    t = jnp.asarray(np.random.default_rng(2).standard_normal((40, 130)).astype(np.float32))
    for fmt, opts in [("mxfp8", {}), ("blockwise", {"block": (128, 128)})]:
        y, ty = jax.jvp(lambda v: jf.quantize_dequantize(v, fmt, **opts), (x,), (t,))  # noqa: B023
        assert_bits_equal(ty, t)
        assert_bits_equal(y, jf.quantize_dequantize(x, fmt, **opts))
        g = jax.grad(lambda v: (jf.quantize_dequantize(v, fmt, "colwise", **opts) * t).sum())(x)  # noqa: B023
        assert_bits_equal(g, t)
