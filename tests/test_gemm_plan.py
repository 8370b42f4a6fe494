"""The GEMM plan (jax_fp8/gemm/plan.py): one place decides, per fp8_dot_general call, the three GEMMs'
operands and orientations, sizes, blocks, dtypes, backend and fallback reasons; the VJP executes it.
A new backend plugs in as one module plus its line in BACKENDS."""
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from jax_fp8.gemm import backends
from jax_fp8.gemm.plan import Operand, plan_dot_general, plan_gemm
from jax_fp8.gemm.backends.cublaslt import CUBLASLT
from jax_fp8.gemm.contract import BLOCK_1D, BLOCK_2D, GemmBackend
from helpers import assert_bits_equal, stable_seed

KN = (((1,), (0,)), ((), ()))  # x (M, K) . W (K, N), flax's kernel
NK = (((1,), (1,)), ((), ()))  # x (M, K) . W (N, K)
RECIPE = jf.Float8BlockScaling(grad_dtype=jnp.float8_e5m2)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def _arrays(M, K, N, rhs_kn):
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    return x, jax.ShapeDtypeStruct((K, N) if rhs_kn else (N, K), jnp.bfloat16)


@pytest.mark.parametrize("rhs_kn", [True, False], ids=["KN", "NK"])
def test_the_three_gemms_orientations_sizes_blocks_dtypes(rhs_kn):
    M, K, N = 256, 384, 512
    p = plan_dot_general(*_arrays(M, K, N, rhs_kn), KN if rhs_kn else NK, jnp.dtype(jnp.bfloat16), RECIPE)
    assert p.fallback is None and p.rhs_kn == rhs_kn and (p.M, p.N, p.K) == (M, N, K) and not p.reasons()
    w_k, w_n = ("first", "last") if rhs_kn else ("last", "first")
    fprop, dgrad, wgrad = p.steps
    assert (fprop.name, fprop.a, fprop.b) == ("fprop", Operand("x", "last"), Operand("w", w_k))
    assert (dgrad.name, dgrad.a, dgrad.b) == ("dgrad", Operand("dy", "last"), Operand("w", w_n))
    assert wgrad.name == "wgrad"
    if rhs_kn:  # dW (K, N) = xᵀ · dy
        assert (wgrad.a, wgrad.b, (wgrad.gemm.M, wgrad.gemm.N, wgrad.gemm.K)) == (
            Operand("x", "first"), Operand("dy", "first"), (K, N, M))
    else:  # dW (N, K) = dyᵀ · x
        assert (wgrad.a, wgrad.b, (wgrad.gemm.M, wgrad.gemm.N, wgrad.gemm.K)) == (
            Operand("dy", "first"), Operand("x", "first"), (N, K, M))
    assert (fprop.gemm.M, fprop.gemm.N, fprop.gemm.K) == (M, N, K)
    assert (dgrad.gemm.M, dgrad.gemm.N, dgrad.gemm.K) == (M, K, N)
    assert (fprop.gemm.a_block, fprop.gemm.b_block) == (BLOCK_1D, BLOCK_2D)
    assert (dgrad.gemm.a_block, dgrad.gemm.b_block, dgrad.gemm.a_dtype) == (BLOCK_1D, BLOCK_2D, E5M2)
    assert (wgrad.gemm.a_block, wgrad.gemm.b_block) == (BLOCK_1D, BLOCK_1D)
    assert all(s.gemm.backend is CUBLASLT and s.gemm.aligned for s in p.steps)


def test_fallback_reasons_per_gemm_and_for_the_call():
    # M = 1, N = 1: padding each GEMM to cuBLASLt's alignment multiplies its work too much
    p = plan_dot_general(*_arrays(1, 128, 1, True), KN, jnp.dtype(jnp.float32), RECIPE)
    assert p.fallback is None and [r.split(":")[0] for r in p.reasons()] == ["fprop", "dgrad", "wgrad"]
    assert all(s.gemm.backend is None and "multiply the GEMM's work" in s.gemm.reason for s in p.steps)
    # a pre-quantized lhs without its columnwise usage: no dgrad (no gradient), wgrad reads values
    xq = jf.quantize_blockwise(jnp.ones((256, 128), jnp.float32), layout="gemm_ready")
    p = plan_dot_general(xq, _arrays(256, 128, 256, True)[1], KN, jnp.dtype(jnp.float32), RECIPE)
    assert [s.name for s in p.steps] == ["fprop", "wgrad"] and p.reasons() == [
        "wgrad: a pre-quantized operand lacks the usage this GEMM contracts (1x128 blocks along the other dim)"]
    # the whole call falls back, with the reason the warning gives
    x, w = _arrays(128, 128, 128, True)
    assert "batch dimensions" in plan_dot_general(x, w, (((1,), (0,)), ((0,), (0,))), jnp.dtype(jnp.float32),
                                                  RECIPE).fallback
    mx = jf.quantize_mxfp8(jnp.ones((128, 128), jnp.float32))
    assert "MXFP8" in plan_dot_general(mx, w, KN, jnp.dtype(jnp.float32), RECIPE).fallback
    assert plan_dot_general(jax.ShapeDtypeStruct((0, 128), jnp.float32), w, KN, jnp.dtype(jnp.float32),
                            RECIPE).empty


def test_stacked_only_where_sequences_may_split_and_every_gemm_is_aligned():
    kn3 = (((2,), (0,)), ((), ()))
    args = (jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16), jax.ShapeDtypeStruct((384, 512), jnp.bfloat16), kn3,
            jnp.dtype(jnp.bfloat16), RECIPE)
    assert plan_dot_general(*args, sequences_may_split=True).stacked
    assert not plan_dot_general(*args, sequences_may_split=False).stacked
    odd = (jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16), jax.ShapeDtypeStruct((384, 520), jnp.bfloat16))
    assert not plan_dot_general(*odd, *args[2:], sequences_may_split=True).stacked  # dgrad's K = 520: padded


#: A made-up backend, written as a module of jax_fp8/gemm/backends would be: it takes only GEMMs with M
#: a multiple of 64, unpadded, and runs cuBLASLt's kernel (the reference where cuBLASLt does not run).
WIDE_ROWS_MODULE = """
from jax_fp8.gemm.backends.cublaslt import CUBLASLT
from jax_fp8.gemm.contract import GemmBackend


def sizes(M, N, K, a_block, b_block, a_dtype, b_dtype):
    ok = M % 64 == 0 and K % 16 == 0 and N % 8 == 0
    return ((M, N, K), None) if ok else (None, "M is not a multiple of 64")


WIDE_ROWS = GemmBackend("wide_rows", sizes, CUBLASLT.unavailable, lowerings=CUBLASLT.lowerings)
"""


def test_a_new_backend_is_one_module_plus_one_line(monkeypatch, tmp_path):
    """A backend is one module (above) plus its line in BACKENDS: the plan picks it where it takes a GEMM,
    the primitive carries it as its backend param into the lowering, and ``implementation=`` names it
    (where it does not run, the error says why). Its kernel here is cuBLASLt's (on a machine without it,
    the reference): the same bits as the plan without it."""
    (tmp_path / "wide_rows_backend.py").write_text(WIDE_ROWS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import wide_rows_backend

    other = wide_rows_backend.WIDE_ROWS
    rng = np.random.default_rng(stable_seed("second-backend"))
    x = jnp.asarray(rng.standard_normal((192, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    f = jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN))
    want = f(x, w)
    monkeypatch.setattr(backends, "BACKENDS", (other, *backends.BACKENDS))  # the one line
    assert plan_gemm(192, 128, 256).backend is other and plan_gemm(8, 128, 256).backend is CUBLASLT
    loss = lambda x, w: jf.fp8_dot_general(x, w, KN).sum()  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))  # fprop (M 192), dgrad (192), wgrad (M 256)
    assert jaxpr.count("backend=wide_rows") == 3 and "backend=cublaslt" not in jaxpr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bits_equal(jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN))(x, w), want)
    gx, gw = jax.grad(loss, (0, 1))(x, w)
    why = other.unavailable_here()
    if why is None:
        assert_bits_equal(jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN, implementation="wide_rows"))(x, w), want)
    else:
        with pytest.raises(ValueError, match=re.escape(f"implementation='wide_rows' cannot run here: {why}")):
            jf.fp8_dot_general(x, w, KN, implementation="wide_rows")
    monkeypatch.setattr(backends, "BACKENDS", (CUBLASLT,))
    rx, rw = jax.grad(loss, (0, 1))(x, w)
    assert_bits_equal(gx, rx)
    assert_bits_equal(gw, rw)


def test_plan_is_static_and_hashable():
    p = plan_dot_general(*_arrays(256, 128, 256, False), NK, jnp.dtype(jnp.float32), RECIPE)
    assert hash(p) == hash(dataclasses.replace(p)) and p == dataclasses.replace(p)
