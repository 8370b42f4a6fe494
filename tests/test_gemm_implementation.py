"""``fp8_dot_general(..., implementation=...)``: the user's choice of what runs the three GEMMs of a call.

"reference" runs everywhere, unwarned, with the same bits as the plan's choice where that computes the
reference too (on a CPU; forward and both gradients, both recipes, on generated shapes: aligned,
padded, partial blocks, stacked sequences); a backend that does not take the recipe's format, does not
run here, or cannot take one of the call's GEMMs raises a ValueError that names the argument and says
why; so do unknown names. ``fp8_gemm(..., backend=<name>)`` takes the same names.
"""
import dataclasses
import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from jax_fp8.gemm import backends
from jax_fp8.gemm.backends import REFERENCE, implementations
from helpers import assert_bits_equal, stable_seed
from test_dot_general_vjp import _fwd_bwd, _wide

KN, NK = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
RECIPES = {"blockwise": jf.Float8BlockScaling(grad_dtype=jnp.float8_e5m2), "mxfp8": jf.MXFP8BlockScaling()}
#: hardware backends and the format each takes
HARDWARE = {"cublaslt": "blockwise", "cutlass": "blockwise", "cudnn": "mxfp8"}


def _cases():
    """(x shape, N, W as (K, N), dtype): every combination of M, K, N residues against the 128 and 32
    blocks (aligned, off by a few, one past), two dtypes and both weight orientations, subsampled; plus a
    (B, S, K) lhs with S = 128 (stacked sequences under jit on several devices)."""
    rng = np.random.default_rng(stable_seed("implementation cases"))
    grid = list(itertools.product((1, 37, 128, 130), (32, 200, 256), (8, 50, 136), (True, False), (F32, BF16)))
    picked = [grid[i] for i in sorted(rng.choice(len(grid), 6, replace=False))]
    return [((M, K), N, kn, dt) for M, K, N, kn, dt in picked] + [((2, 128, 256), 64, True, BF16)]


CASES = _cases()


@pytest.mark.parametrize("fmt", sorted(RECIPES))
@pytest.mark.parametrize("xshape,N,kn,dtype", CASES, ids=str)
def test_reference_is_the_default_bits_here_and_unwarned(xshape, N, kn, dtype, fmt):
    """implementation="reference": forward and both gradients equal the default plan's (which computes
    the reference on this machine), bit for bit, with no fallback warning."""
    if jax.default_backend() != "cpu":
        pytest.skip("the default plan runs the kernels here: compared with the reference in test_gemm*.py")
    rng = np.random.default_rng(stable_seed("implementation", xshape, N, kn, dtype, fmt))
    K = xshape[-1]
    x, w, g = (_wide(rng, s, dtype) for s in (xshape, (K, N) if kn else (N, K), (*xshape[:-1], N)))
    dn = (((len(xshape) - 1,), (0 if kn else 1,)), ((), ()))
    recipe = RECIPES[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jf.MXFP8GemmFallbackWarning)  # the default's, on MXFP8
        want = jax.jit(_fwd_bwd(lambda x, w: jf.fp8_dot_general(x, w, dn, recipe=recipe)))(x, w, g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8Warning)
        f = lambda x, w: jf.fp8_dot_general(x, w, dn, recipe=recipe, implementation="reference")  # noqa: E731
        got = jax.jit(_fwd_bwd(f))(x, w, g)
        jaxpr = str(jax.make_jaxpr(_fwd_bwd(f))(x, w, g))
    assert "jf_fp8_gemm" not in jaxpr  # the reference math, not the primitive
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        assert_bits_equal(a, b, f"{name} {fmt}")


@pytest.mark.parametrize("name,fmt", sorted(HARDWARE.items()))
def test_a_backend_that_does_not_run_here_says_why(name, fmt):
    backend = implementations()[name]
    why = backend.unavailable_here()
    if why is None:
        pytest.skip(f"{name} runs here")
    x, w = jnp.ones((64, 128), jnp.float32), jnp.ones((128, 32), jnp.float32)
    with pytest.raises(ValueError, match=re.escape(f"fp8_dot_general: implementation={name!r} cannot run here: {why}")):
        jf.fp8_dot_general(x, w, KN, recipe=RECIPES[fmt], implementation=name)


@pytest.mark.parametrize("name,fmt", sorted(HARDWARE.items()))
def test_a_backend_of_the_other_format_says_which_take_it(name, fmt):
    other = "mxfp8" if fmt == "blockwise" else "blockwise"
    recipe = RECIPES[other]
    takers = ", ".join(repr(n) for n, b in implementations().items() if b.takes(other))
    x, w = jnp.ones((64, 128), jnp.float32), jnp.ones((128, 32), jnp.float32)
    with pytest.raises(ValueError, match=re.escape(
            f"implementation={name!r} does not take the {type(recipe).__name__} recipe's operands ({other}); for "
            f"it: {takers} or None")):
        jf.fp8_dot_general(x, w, KN, recipe=recipe, implementation=name)


@pytest.mark.parametrize("bad", ["cuBLASLt", "", "fp32", "mxfp8", 3, jf.Float8BlockScaling()], ids=repr)
def test_unknown_implementations_raise(bad):
    x, w = jnp.ones((8, 128), jnp.float32), jnp.ones((128, 8), jnp.float32)
    names = ", ".join(map(repr, implementations()))
    with pytest.raises(ValueError, match=re.escape(f"implementation must be None or one of {names}, got {bad!r}")):
        jf.fp8_dot_general(x, w, KN, implementation=bad)
    assert set(implementations()) == {"cublaslt", "cutlass", "cudnn", "reference"}


def test_a_named_backend_that_cannot_take_the_call(monkeypatch):
    """A named backend that runs here but cannot take one of the call's GEMMs (its sizes; the backward's
    count: the call plans them), or a call that is no GEMM at all (batch dims), raises; "reference" takes
    both (the second as the lax.dot_general fallback, with its warning). A made-up backend that runs
    anywhere, taking only K <= 256: one more entry in BACKENDS."""
    def small_k(M, N, K, *blocks_and_dtypes):
        return ((M, N, K), None) if K <= 256 else (None, f"K = {K} is over 256")

    anywhere = dataclasses.replace(REFERENCE, name="small_k", sizes=small_k)
    monkeypatch.setattr(backends, "BACKENDS", (*backends.BACKENDS, anywhere))
    w = jnp.ones((128, 64), jnp.float32)
    jax.grad(lambda x: jf.fp8_dot_general(x, w, KN, implementation="small_k").sum())(jnp.ones((256, 128)))
    # every GEMM of the call is planned at the call (the backward's too): M = 300 is wgrad's K
    with pytest.raises(ValueError, match=re.escape("implementation='small_k' cannot take the wgrad GEMM (128x64x300): "
                                                   "K = 300 is over 256")):
        jf.fp8_dot_general(jnp.ones((300, 128)), w, KN, implementation="small_k")
    xb, wb = jnp.ones((2, 8, 128), jnp.float32), jnp.ones((2, 128, 16), jnp.float32)
    batched = (((2,), (1,)), ((0,), (0,)))
    with pytest.raises(ValueError, match="implementation='small_k' cannot run this call, which is no FP8 GEMM: batch"):
        jf.fp8_dot_general(xb, wb, batched, implementation="small_k")
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="not on the FP8 GEMM: batch dimensions"):
        jf.fp8_dot_general(xb, wb, batched, implementation="reference")


@pytest.mark.parametrize("M,N,K,b_block", [(37, 50, 300, (128, 128)), (130, 8, 256, (1, 128)), (64, 40, 100, None)],
                         ids=str)
def test_fp8_gemm_takes_a_backends_name(M, N, K, b_block):
    """fp8_gemm(..., backend="reference") is the plan's result here, unwarned (None: MXFP8 operands)."""
    rng = np.random.default_rng(stable_seed("fp8_gemm name", M, N, K, b_block))
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((M, K), (N, K)))
    if b_block is None:
        qa, qb = jf.quantize_mxfp8(a), jf.quantize_mxfp8(b)
    else:
        qa, qb = jf.quantize_blockwise(a, layout="gemm_ready"), jf.quantize_blockwise(b, block=b_block)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8Warning)
        got = jf.gemm.fp8_gemm(qa, qb, F32, backend="reference")
    if jax.default_backend() == "cpu":
        assert_bits_equal(got, jf.gemm.fp8_gemm(qa, qb, F32))
