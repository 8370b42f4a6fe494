"""The README's "Numerics at the limits", checked on the kernels and on the reference."""
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from helpers import assert_tensors_equal, on_cpu


def _both(quantize, reference, x, **kw):
    q = quantize(x, **kw)
    assert_tensors_equal(q, on_cpu(reference, x, **kw))
    return q


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_the_input_dtype_max_can_dequantize_to_inf(dtype):
    big = float(jnp.finfo(dtype).max)
    x = np.ones((1, 128), np.float32)
    x[0, 0] = big
    x = x.astype(dtype)
    mx = _both(jf.quantize_mxfp8, jf.reference.quantize_mxfp8, x)
    assert np.asarray(mx.rowwise_data).view(np.uint8)[0, 0] == 0x78  # 256 at the rounded-up scale
    assert np.isposinf(np.asarray(jf.dequantize(mx), np.float32)[0, 0])
    pow2 = _both(jf.quantize_blockwise, jf.reference.quantize_blockwise, x)
    assert np.isposinf(np.asarray(jf.dequantize(pow2), np.float32)[0, 0])
    exact = _both(jf.quantize_blockwise, jf.reference.quantize_blockwise, x, pow2_scales=False)
    assert np.asarray(jf.dequantize(exact), np.float32)[0, 0] == np.float32(big)


def test_one_inf_in_a_block_mxfp8_vs_blockwise():
    x = np.linspace(0.5, 2.0, 64, dtype=np.float32)[None]
    x[0, 3] = np.inf
    mx = _both(jf.quantize_mxfp8, jf.reference.quantize_mxfp8, x)
    assert np.asarray(mx.rowwise_scale_inv).tolist() == [[0xFE, int(jf.reference.e8m0_from_amax(2.0))]]  # inf block saturates
    data = np.asarray(mx.rowwise_data).view(np.uint8)[0]
    assert data[3] == 0x7F and (np.delete(data[:32], 3) == 0).all()  # NaN for the inf, zeros for the rest
    y = np.asarray(jf.dequantize(mx))[0]
    assert np.isnan(y[3]) and (np.delete(y[:32], 3) == 0).all() and np.isfinite(y[32:]).all()
    b = _both(jf.quantize_blockwise, jf.reference.quantize_blockwise, x)
    assert np.asarray(b.rowwise_scale_inv).tolist() == [[1.0]]
    assert np.asarray(b.rowwise_data).view(np.uint8)[0, 3] == 0x7E  # saturates to 448
    np.testing.assert_allclose(np.delete(np.asarray(jf.dequantize(b))[0], 3), np.delete(x[0], 3), rtol=2**-4)
