"""Sequence-parallel all-gather: both paths equal quantizing the full tensor, on 2, 3, 4, 8 CPU devices."""
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8 as jf
from jax import shard_map
from jax_fp8 import Scheme
from jax_fp8.distributed import all_gather_dequantized, all_gather_first_dim
from helpers import assert_tensors_equal, random_input, replicated, stable_seed

QUANTIZERS = {
    "mx-row": Scheme("mxfp8"),
    "mx-rowcol": Scheme("mxfp8", rowwise=True, colwise=True),
    "mx-col-e5m2": Scheme("mxfp8", jnp.float8_e5m2, rowwise=False, colwise=True),
    "f8-1d": Scheme("blockwise", rowwise=True, colwise=True),
    "f8-2d": Scheme("blockwise", block=(128, 128)),
}


def _mesh(n):
    return Mesh(np.array(jax.devices("cpu")[:n]), ("sp",))


def _gathered(fn, x, n):
    call, f = replicated(fn, _mesh(n), P("sp"), "sp")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = call(x)
    return out, f, [str(m.message) for m in w]


def _all_gather_dtypes(f, x):
    """Element types of the all-gathers in the lowered program (before XLA's CPU backend widens bf16)."""
    hlo = f.lower(x).as_text()
    return set(re.findall(r'"stablehlo.all_gather".*-> tensor<[\dx]*x(\w+)>', hlo))


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("n,local_rows", [(8, 100), (8, 128), (3, 96), (3, 41), (2, 256), (4, 32)])
def test_unquantized_input_equals_full_quantization(name, n, local_rows):
    qz = QUANTIZERS[name]
    rng = np.random.default_rng(stable_seed("unquantized input", name, n, local_rows))
    x = random_input(rng, (n * local_rows, 160), jnp.bfloat16)
    got, f, warns = _gathered(lambda v: all_gather_first_dim(v, "sp", qz), x, n)
    assert_tensors_equal(got, jf.quantize(x, qz))
    fast = local_rows % qz.block_rows == 0
    assert bool(warns) == (not fast), warns
    dtypes = _all_gather_dtypes(f, x)
    if fast:  # FP8 data (as its bytes: no backend may widen it) and uint8 / fp32 scales travel; no
        assert dtypes <= {"ui8", "f32"} and "ui8" in dtypes, dtypes  # high-precision gather
    else:
        assert dtypes == {"bf16"}, dtypes


@pytest.mark.parametrize("name", ["mx-rowcol", "f8-1d", "f8-2d"])
@pytest.mark.parametrize("n,local_rows", [(8, 128), (8, 100), (3, 50)])
def test_quantized_input(name, n, local_rows):
    """Already quantized: fast path gathers it as is (== quantizing the full tensor); the fallback
    dequantizes, gathers, requantizes (== quantizing the gathered dequantized values)."""
    qz = QUANTIZERS[name]
    rng = np.random.default_rng(stable_seed("quantized input", name, n, local_rows))
    x = random_input(rng, (n, local_rows, 3, 64), jnp.float32).reshape(n * local_rows, 3, 64)
    got, f, warns = _gathered(lambda v: all_gather_first_dim(jf.quantize(v, qz), "sp", qz), x, n)
    if (local_rows * 3) % qz.block_rows == 0:
        assert not warns
        assert_tensors_equal(got, jf.quantize(x, qz))
    else:
        assert warns
        local = [jf.dequantize(jf.quantize(x[r * local_rows:(r + 1) * local_rows], qz)) for r in range(n)]
        assert_tensors_equal(got, jf.quantize(jnp.concatenate(local), qz))
        assert _all_gather_dtypes(f, x) == {"f32"}


def test_missing_usage_is_requantized():
    n, rows = 4, 64
    x = random_input(np.random.default_rng(1), (n * rows, 96), jnp.bfloat16)
    want_q = Scheme("mxfp8", rowwise=True, colwise=True)
    got, _, warns = _gathered(lambda v: all_gather_first_dim(jf.quantize_mxfp8(v), "sp", want_q), x, n)
    assert len(warns) == 1 and "second rounding" in warns[0], warns  # fast path; the conversion warns
    assert got.has_colwise and got.has_rowwise
    local = [jf.dequantize(jf.quantize_mxfp8(x[r * rows:(r + 1) * rows])) for r in range(n)]
    assert_tensors_equal(got, jf.quantize(jnp.concatenate(local), want_q))


@pytest.mark.parametrize("local_rows", [64, 100])
def test_gradients_match_unquantized_all_gather(local_rows):
    n = 4
    rng = np.random.default_rng(stable_seed("gradients", local_rows))
    x = random_input(rng, (n * local_rows, 96), jnp.float32, specials=False)
    w = jnp.asarray(rng.standard_normal((n * local_rows, 96)).astype(np.float32))
    qz = Scheme("mxfp8", rowwise=True, colwise=True)

    def loss(fn):
        def per_rank(v, w):
            return (fn(v) * w).sum()[None]
        f = shard_map(per_rank, mesh=_mesh(n), in_specs=(P("sp"), P()), out_specs=P("sp"))
        return jax.jit(jax.grad(lambda v: f(v, w).sum()))(x)

    g_ref = loss(lambda v: lax.all_gather(v, "sp", axis=0, tiled=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g_q = loss(lambda v: all_gather_dequantized(v, "sp", qz, "colwise"))
    g_hi = loss(lambda v: all_gather_first_dim(v, "sp"))
    np.testing.assert_array_equal(np.asarray(g_q), np.asarray(g_ref))
    np.testing.assert_array_equal(np.asarray(g_hi), np.asarray(g_ref))
    np.testing.assert_allclose(np.asarray(g_ref), n * np.asarray(w), rtol=0)  # each rank's copy contributes


def test_scheme_errors():
    with pytest.raises(ValueError, match="fmt"):
        Scheme("nvfp4")
    with pytest.raises(ValueError, match="at least one"):
        Scheme(rowwise=False)
    with pytest.raises(ValueError, match="block"):
        Scheme("blockwise", block=(32, 32))
    with pytest.raises(TypeError, match="dtype"):
        Scheme(dtype=jnp.float16)


def test_quantized_input_without_scheme_keeps_its_format():
    n, rows = 4, 64
    x = random_input(np.random.default_rng(5), (n * rows, 256), jnp.bfloat16)
    for quantize in (lambda v: jf.quantize_mxfp8(v, jnp.float8_e5m2, True, True),
                     lambda v: jf.quantize_blockwise(v, block=(128, 128), pow2_scales=False)):
        got, _, warns = _gathered(lambda v: all_gather_first_dim(quantize(v), "sp"), x, n)
        fast = rows % quantize(x).scheme.block_rows == 0
        assert bool(warns) == (not fast)
        local = [jf.dequantize(quantize(x[r * rows:(r + 1) * rows])) for r in range(n)]
        assert_tensors_equal(got, quantize(x) if fast else quantize(jnp.concatenate(local)))


def test_fallback_conversion_rounds_once():
    """Regression: a rowwise-only input gathered for colwise on the fallback path was requantized
    locally first and then dequantized again (two roundings). The fallback dequantizes the original."""
    x = np.array([[1.0], [0.625 * 2.0**-15], [4.0], [0.0]], np.float32)
    got, _, warns = _gathered(lambda v: all_gather_first_dim(jf.quantize_mxfp8(v), "sp",
                                                             Scheme("mxfp8", rowwise=False, colwise=True)), x, 2)
    assert np.asarray(got.colwise_data).view(np.uint8).ravel().tolist() == [0x68, 0x01, 0x78, 0x00]
    assert any("second rounding" in w for w in warns) and any("high precision" in w for w in warns), warns


@pytest.mark.parametrize("src,dst", [("mx-row", "mx-col-e5m2"), ("mx-row", "f8-1d"), ("f8-2d", "mx-rowcol"),
                                     ("f8-1d", "f8-2d")])
@pytest.mark.parametrize("local_rows", [40, 128])
def test_conversion_equals_quantizing_the_gathered_dequantized_input(src, dst, local_rows):
    """Another format or a missing usage: on either path, the result is the target quantization of
    the gathered dequantized input (one conversion), and a warning says so."""
    n = 2
    rng = np.random.default_rng(stable_seed("conversion", src, dst, local_rows))
    x = random_input(rng, (n * local_rows, 160), jnp.bfloat16)
    qs, qd = QUANTIZERS[src], QUANTIZERS[dst]
    got, _, warns = _gathered(lambda v: all_gather_first_dim(jf.quantize(v, qs), "sp", qd), x, n)
    local = [jf.dequantize(jf.quantize(x[r * local_rows:(r + 1) * local_rows], qs)) for r in range(n)]
    assert_tensors_equal(got, jf.quantize(jnp.concatenate(local), qd))
    assert any("second rounding" in w for w in warns), warns
    assert any("high precision" in w for w in warns) == (local_rows % qd.block_rows != 0), warns


def test_bad_arguments_name_the_argument():
    mesh, x = _mesh(2), np.ones((64, 32), np.float32)

    def run(fn):
        return jax.jit(shard_map(fn, mesh=mesh, in_specs=P("sp"), out_specs=P()))(x)

    with pytest.raises(TypeError, match="scheme must be a jax_fp8.Scheme"):
        run(lambda v: all_gather_first_dim(v, "sp", "mxfp8"))
    with pytest.raises(TypeError, match="all_gather_dequantized: scheme"):
        run(lambda v: all_gather_dequantized(v, "sp", None))
    with pytest.raises(ValueError, match="usage"):
        run(lambda v: all_gather_dequantized(v, "sp", Scheme("mxfp8"), "colwise"))


def test_scheme_validates_options():
    with pytest.raises(ValueError, match="amax_epsilon"):
        Scheme("blockwise", amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="amax_epsilon"):
        Scheme("blockwise", amax_epsilon=float("nan"))
    with pytest.raises(TypeError, match="rowwise must be a bool"):
        Scheme("mxfp8", rowwise="yes")
    with pytest.raises(TypeError, match="pow2_scales must be a bool"):
        Scheme("blockwise", pow2_scales=None)
    with pytest.raises(ValueError, match="block"):
        Scheme("blockwise", block=(1, 32))
    assert Scheme("blockwise", block=[128, 128]).block == (128, 128)


GEMM_READY = {
    "f8-1d-gr": Scheme("blockwise", rowwise=True, colwise=True, layout="gemm_ready"),
    "f8-2d-gr": Scheme("blockwise", block=(128, 128), rowwise=True, colwise=True, layout="gemm_ready"),
    "f8-col-gr": Scheme("blockwise", rowwise=False, colwise=True, layout="gemm_ready"),
    "mx-gr": Scheme("mxfp8", rowwise=True, colwise=True, layout="gemm_ready"),
}


@pytest.mark.parametrize("name", list(GEMM_READY))
@pytest.mark.parametrize("n,local_rows", [(2, 256), (4, 128), (3, 100)])
def test_gemm_ready_gather_equals_full_quantization(name, n, local_rows):
    """GEMM-ready schemes: both paths give the GEMM-ready quantization of the gathered tensor
    (transposed columnwise data gathered along its second axis, scales re-padded)."""
    qz = GEMM_READY[name]
    rng = np.random.default_rng(stable_seed("gemm_ready gather", name, n, local_rows))
    x = random_input(rng, (n * local_rows, 200), jnp.bfloat16)
    got, f, warns = _gathered(lambda v: all_gather_first_dim(v, "sp", qz), x, n)
    assert_tensors_equal(got, jf.quantize(x, qz))
    assert bool(warns) == (local_rows % qz.block_rows != 0), warns
    # an input already quantized, compact or GEMM-ready, converts its layout exactly (no warning)
    compact = dataclasses.replace(qz, layout="compact")
    for src in (qz, compact):
        got, _, warns = _gathered(lambda v: all_gather_first_dim(jf.quantize(v, src), "sp", qz), x, n)  # noqa: B023
        if local_rows % qz.block_rows == 0:
            assert_tensors_equal(got, jf.quantize(x, qz))
            assert not warns, warns


def test_shared_tiles_travel_once():
    """Compact 128x128 tiles serve both usages: their data and scales are gathered once, not twice."""
    qz = Scheme("blockwise", block=(128, 128), rowwise=True, colwise=True)
    x = random_input(np.random.default_rng(9), (2 * 128, 200), jnp.bfloat16)
    got, f, warns = _gathered(lambda v: all_gather_first_dim(v, "sp", qz), x, 2)
    assert not warns
    assert_tensors_equal(got, jf.quantize(x, qz))
    assert len(re.findall(r'"stablehlo.all_gather"', f.lower(x).as_text())) == 2  # data + scales
