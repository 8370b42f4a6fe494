"""The format objects (jax_fp8.formats) and the one way to name a scheme: a Scheme and the string
forms that build one give the same bits; the kernels decode the format as an enum and reject unknown
values by name, and both compiled modules register one handler list; the deprecated top-level helper
still answers, with a warning."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from jax_fp8 import Scheme, formats
from jax_fp8.primitives import (dequantize_p, norm_grad_p, partial_amax_p, partial_cast_p, produce_p, produce_quantize_p,
                                quantize_grouped_p, quantize_p)
from helpers import assert_bits_equal, random_input, stable_seed


def test_format_objects():
    """Each Scheme holds its format object; the object says what differs between the formats."""
    mx, bw = Scheme("mxfp8"), Scheme("blockwise", block=(128, 128))
    assert mx.format is formats.MXFP8 and bw.format is formats.BLOCKWISE
    assert Scheme(formats.BLOCKWISE, block=(128, 128)) == bw and Scheme(formats.BLOCKWISE).fmt == "blockwise"
    assert (mx.e8m0, bw.e8m0) == (True, False)  # kept for the GEMM modules
    assert mx.format.tensor_class is jf.MXFP8Tensor and bw.format.tensor_class is jf.BlockwiseTensor
    assert (mx.scale_dtype, bw.scale_dtype) == (np.uint8, np.float32)
    assert mx.kernel_blocks == ((1, 32),) and bw.kernel_blocks == ((128, 128),)
    assert Scheme("blockwise", colwise=True).kernel_blocks == ((1, 128), (128, 1))
    assert [f.kernel_id for f in formats.FORMATS.values()] == [0, 1]
    assert mx.ffi_attrs()["format"] == 0 and bw.ffi_attrs()["format"] == 1 and "e8m0" not in mx.ffi_attrs()
    # GEMM-ready rule: Float8 scales are rearranged, MXFP8 scales stay compact
    assert Scheme("blockwise", layout="gemm_ready").scale_shape(6, 300, "rowwise") == (3, 8)
    assert Scheme("mxfp8", layout="gemm_ready").scale_shape(6, 300, "rowwise") == (6, 10)
    with pytest.raises(ValueError, match="fmt must be 'mxfp8' or 'blockwise', got 'nvfp4'"):
        Scheme("nvfp4")
    with pytest.raises(ValueError, match=r"block must be \(1, 128\) or \(128, 128\)"):
        Scheme("blockwise", block=(1, 32))
    with pytest.raises(TypeError, match="fmt='mxfp8'"):
        jf.MXFP8Tensor(None, None, None, None, (2, 32), jnp.dtype(jnp.float32), bw)


@pytest.mark.parametrize("fmt,options", [("mxfp8", {}), ("mxfp8", dict(dtype=jnp.float8_e5m2)),
                                         ("blockwise", dict(block=(1, 128), amax_epsilon=1e-3)),
                                         ("blockwise", dict(block=(128, 128), pow2_scales=False))], ids=str)
@pytest.mark.parametrize("usage", ["rowwise", "colwise"])
def test_quantize_dequantize_scheme_equals_string(fmt, options, usage):
    """quantize_dequantize(x, Scheme) and (x, fmt, **options): the same forward bits and gradient."""
    x = jnp.asarray(random_input(np.random.default_rng(stable_seed("qdq scheme", fmt, usage)), (200, 300),
                                 jnp.bfloat16, specials=False))
    scheme = Scheme(fmt, rowwise=True, colwise=True, **options)
    got = jf.quantize_dequantize(x, scheme, usage)
    assert_bits_equal(got, jf.quantize_dequantize(x, fmt, usage, **options), "scheme vs string")
    assert_bits_equal(got, jf.dequantize(jf.quantize(x, scheme), x.dtype, usage), "straight dequantize")
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32))  # it did quantize
    t = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), x.dtype)
    g = jax.grad(lambda v: (jf.quantize_dequantize(v, scheme, usage).astype(jnp.float32) * t).sum())(x)
    assert_bits_equal(g, t.astype(jnp.float32).astype(x.dtype), "identity gradient")


def test_quantize_dequantize_scheme_errors():
    x = jnp.ones((4, 64), jnp.float32)
    with pytest.raises(TypeError, match=r"a Scheme says every option; got it and \['dtype'\]"):
        jf.quantize_dequantize(x, Scheme("mxfp8"), dtype=jnp.float8_e5m2)
    with pytest.raises(ValueError, match="usage 'colwise' is not one the scheme produces"):
        jf.quantize_dequantize(x, Scheme("mxfp8"), "colwise")


def test_unknown_format_is_an_ffi_error_naming_it(monkeypatch):
    """The kernels decode scheme.format as an enum: a value no format has fails the call, naming it."""
    attrs = Scheme.ffi_attrs
    monkeypatch.setattr(Scheme, "ffi_attrs", lambda self: dict(attrs(self), format=np.int32(7)))
    x = jax.device_put(jnp.ones((3, 97), jnp.float32), jax.devices("cpu")[0])  # a shape no other test compiles
    with pytest.raises(Exception, match=r"scheme.format must be 0 \(mxfp8\) or 1 \(blockwise\), got 7"):
        jax.block_until_ready(jax.jit(jf.quantize_mxfp8)(x))


def test_e8m0_from_amax_moved_with_a_deprecation():
    amax = np.array([0.0, 1.0, 448.0, 449.0, 3.0e38, np.inf, np.nan, 2.0**-130], np.float32)
    with pytest.warns(DeprecationWarning, match="jax_fp8.reference.e8m0_from_amax"):
        old = jf.e8m0_from_amax
    assert "e8m0_from_amax" not in jf.__all__
    assert_bits_equal(old(amax), jf.reference.e8m0_from_amax(jnp.asarray(amax)), "deprecated vs reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jf.reference.e8m0_from_amax(amax)  # the new home: no warning
    with pytest.raises(AttributeError, match="no attribute 'e8m0_from_amx'"):
        jf.e8m0_from_amx  # noqa: B018


def test_primitives_exports_every_primitive():
    assert set(jf.primitives.__all__) == {"quantize_p", "dequantize_p", "partial_amax_p", "partial_cast_p",
                                          "produce_p", "produce_quantize_p", "norm_grad_p", "quantize_grouped_p"}
    prims = (quantize_p, dequantize_p, partial_amax_p, partial_cast_p, produce_p, produce_quantize_p, norm_grad_p,
             quantize_grouped_p)
    assert {p.name for p in prims} == {"jf_quantize", "jf_dequantize", "jf_partial_amax", "jf_partial_cast",
                                       "jf_produce", "jf_produce_quantize", "jf_norm_grad", "jf_quantize_grouped"}


def test_one_handler_list_for_both_modules():
    """The CPU and CUDA modules register the handlers of one list (ffi_bindings.h's JF_FFI_HANDLERS);
    the CUDA module adds its GEMM."""
    from jax_fp8 import _ffi

    if not _ffi.AVAILABLE["cpu"]:
        pytest.skip("the CPU module is not built")
    cpu = set(jf._jax_fp8_cpu.registrations())
    assert cpu == {"jf_quantize", "jf_dequantize", "jf_partial_amax", "jf_partial_cast", "jf_produce",
                   "jf_produce_quantize", "jf_norm_grad", "jf_quantize_grouped"}
    if _ffi.AVAILABLE["cuda"]:
        cuda = set(jf._jax_fp8_cuda.registrations())
        assert cpu < cuda and len(cuda - cpu) == 1  # the GEMM
