"""``fp8_dot_general`` as a drop-in for ``lax.dot_general``: the same errors for bad arguments, warnings
that point at the caller's line, non-finite values that propagate like lax's, and forward-mode
autodiff that fails with a message naming it (the GEMM path has a reverse-mode rule only)."""
import functools
import inspect
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_fp8 as jf
from helpers import assert_bits_equal, assert_drop_in_signature, stable_seed

KN, NK = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))


def _raised(f):
    """(exception type, first line of its message) of ``f()``, or None when it returns."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f()
    except Exception as e:  # noqa: BLE001 - compared with what lax raises
        return type(e), str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("dn", [
    (((3,), (0,)), ((), ())),       # lhs dim out of range (once contracted dim 1, silently)
    (((-1,), (0,)), ((), ())),      # negative dims: lax rejects them
    (((1,), (-2,)), ((), ())),
    (((1,), (0, 1)), ((), ())),     # malformed: two rhs dims for one lhs dim
    (((1,), (1,)), ((), ())),       # mismatched contracted sizes (128 vs 256)
    (((0,), (0,)), ((0,), (1,))),   # a dim both batch and contracting
    (((1,), (0,)),),                # not (contracting, batch)
])
def test_bad_dimension_numbers_raise_what_lax_raises(dn):
    x, w = jnp.ones((16, 128)), jnp.ones((128, 256))
    want = _raised(lambda: lax.dot_general(x, w, dn))
    assert want is not None
    assert _raised(lambda: jf.fp8_dot_general(x, w, dn)) == want
    assert _raised(lambda: jax.jit(lambda a, b: jf.fp8_dot_general(a, b, dn))(x, w)) == want


@pytest.mark.parametrize("kw", [dict(precision="bogus"), dict(precision=("highest", 3)),
                                dict(preferred_element_type="bogus")], ids=str)
def test_bad_precision_and_dtype_raise_what_lax_raises(kw):
    x, w = jnp.ones((16, 128)), jnp.ones((128, 256))
    want = _raised(lambda: lax.dot_general(x, w, KN, **kw))
    assert want is not None
    assert _raised(lambda: jf.fp8_dot_general(x, w, KN, **kw)) == want


def test_valid_forms_that_lax_accepts_are_accepted():
    """Integer dims instead of tuples, and a precision string: lax takes them, so do we (on the GEMM)."""
    rng = np.random.default_rng(stable_seed("valid-forms"))
    x, w = rng.standard_normal((16, 128), np.float32), rng.standard_normal((128, 256), np.float32)
    want = jf.fp8_dot_general(x, w, KN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the GEMM path: no fallback warning
        got = jf.fp8_dot_general(x, w, ((1, 0), ((), ())), precision="highest")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


#: each drop-in, the lax function it replaces, and arguments for both (a seeded generator's operands)
DROP_INS = {
    "dot_general": (jf.fp8_dot_general, lax.dot_general,
                    lambda rng: (rng.standard_normal((16, 128), np.float32),
                                 rng.standard_normal((128, 256), np.float32), KN)),
    "ragged_dot": (jf.fp8_ragged_dot, lax.ragged_dot,
                   lambda rng: (rng.standard_normal((64, 128), np.float32),
                                rng.standard_normal((2, 128, 32), np.float32), np.array([30, 34], np.int32))),
}


@pytest.mark.parametrize("op", DROP_INS)
def test_signature_is_laxs(op):
    ours, theirs, _ = DROP_INS[op]
    assert_drop_in_signature(ours, theirs)


@pytest.mark.parametrize("op", DROP_INS)
def test_reduction_order_as_lax_takes_it(op):
    """jax 0.12's ``reduction_order``: "unordered" (any order) on the FP8 path, the same bits as without it;
    another order goes to the lax function (in its jaxpr) with the fallback's warning; a bad one raises
    lax's error before any warning. jax 0.10 and 0.11's lax has none: the TypeError lax raises."""
    ours, theirs, make = DROP_INS[op]
    args = make(np.random.default_rng(stable_seed("reduction_order", op)))
    if "reduction_order" not in inspect.signature(theirs).parameters:
        with pytest.raises(TypeError, match="reduction_order"):
            ours(*args, reduction_order="unordered")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the FP8 path: no fallback warning
        got = ours(*args, reduction_order="unordered")
    assert_bits_equal(got, ours(*args))
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="reduction_order='linear'"):
        jaxpr = jax.make_jaxpr(lambda x, w: ours(x, w, *args[2:], reduction_order="linear"))(*args[:2])
    orders = [str(e.params.get("reduction_order")) for e in jaxpr.eqns if "dot_general" in e.primitive.name]
    assert orders and all("linear" in o for o in orders), orders
    want = _raised(lambda: theirs(*args, reduction_order="bogus"))
    assert want is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _raised(lambda: ours(*args, reduction_order="bogus")) == want


def _line_of(marker: str) -> int:
    """The line number (1-based) in this file of the line that carries ``marker`` as a comment."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith("# " + marker))


def test_fallback_warning_points_at_the_callers_line():
    a, b = jnp.ones((2, 3)), jnp.ones((3, 2))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        jnp.einsum("ij,jk->ik", a, b, _dot_general=jf.fp8_dot_general)  # CALL-EINSUM
        jax.jit(lambda u, v: jf.fp8_dot_general(u, v, KN))(a[:, :2], b[:2])  # CALL-JIT
    got = [(r.filename, r.lineno) for r in rec if issubclass(r.category, jf.Fp8GemmFallbackWarning)]
    assert got == [(__file__, _line_of("CALL-EINSUM")), (__file__, _line_of("CALL-JIT"))], got


def test_fallback_warning_through_flax_points_at_the_callers_line():
    nn = pytest.importorskip("flax.linen")
    layer = nn.Dense(3, dot_general=jf.fp8_dot_general)
    x = jnp.ones((2, 5))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        params = layer.init(jax.random.key(0), x)  # CALL-FLAX
    got = {(r.filename, r.lineno) for r in rec if issubclass(r.category, jf.Fp8GemmFallbackWarning)}
    assert got == {(__file__, _line_of("CALL-FLAX"))}, got
    assert params["params"]["kernel"].shape == (5, 3)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_forward_mode_names_fp8_dot_general(transform):
    rng = np.random.default_rng(stable_seed("forward-mode", transform))
    x, w = rng.standard_normal((8, 128), np.float32), rng.standard_normal((128, 128), np.float32)
    f = lambda v: jf.fp8_dot_general(v, w, KN).sum()  # noqa: E731 - the GEMM path (no fallback warning)
    run = {"jvp": lambda: jax.jvp(f, (x,), (x,)), "jacfwd": lambda: jax.jacfwd(f)(x),
           "hessian": lambda: jax.hessian(f)(x[:, :128])}[transform]
    with pytest.raises(TypeError, match=r"fp8_dot_general: forward-mode differentiation .* reverse mode"):
        run()
    g = jax.jacrev(f)(x)  # reverse mode works
    assert g.shape == x.shape and np.isfinite(np.asarray(g)).all()


BATCHED = (((2,), (1,)), ((0,), (0,)))  # batch dims: the GEMM does not take them (the lax fallback)


def test_forward_mode_on_the_fallback_works():
    """The fallback is lax.dot_general of straight-through quantize-dequantized operands: jvp works and
    its tangent is lax.dot_general of the tangent with the other (quantize-dequantized) operand."""
    rng = np.random.default_rng(stable_seed("forward-mode-fallback"))
    x, w, t = (rng.standard_normal(s, np.float32) for s in [(2, 3, 4), (2, 4, 5), (2, 3, 4)])
    wq = jf.quantize_dequantize(jnp.asarray(w), "blockwise", block=(128, 128))  # the recipe's rhs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, ty = jax.jvp(lambda v: jf.fp8_dot_general(v, w, BATCHED), (x,), (t,))
    np.testing.assert_array_equal(np.asarray(ty), np.asarray(lax.dot_general(t, wq, BATCHED)))
    assert y.shape == (2, 3, 5)


# ---- non-finite values ---------------------------------------------------------------------------
def _inf_tiles(w):
    """The weight as the recipe's GEMM sees an infinity: its 128x128 tile gets an infinite scale, so
    every value of the tile is non-finite (a NaN stays one element)."""
    w = np.array(w, np.float32)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            if np.isinf(w[i:i + 128, j:j + 128]).any():
                w[i:i + 128, j:j + 128] = np.inf
    return w


def _masks(f, x, w, dy):
    """Which entries of y, dx, dW are finite, for a dot_general-like ``f``."""
    y, vjp = jax.vjp(f, x, w)
    return [np.isfinite(np.asarray(v, np.float32)) for v in (y, *vjp(dy))]


@functools.cache
def _jit_fp8_dot_general(dn):
    """One jitted fp8_dot_general per dimension numbers, shared by the cases below: the six ``where``
    cases of a shape and dtype differ only in their values, so their programs (forward and vjp) compile
    once instead of six times (about 16 s less CPU time on 2 cores); every case still runs them."""
    return jax.jit(lambda a, b: jf.fp8_dot_general(a, b, dn))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dn", [KN, NK], ids=["KN", "NK"])
@pytest.mark.parametrize("where", ["x-inf", "x-nan", "w-neg-inf", "dy-inf", "dy-nan", "x-inf-and-dy-nan"])
@pytest.mark.parametrize("shape", [(256, 384, 256), (3, 5, 2)], ids=["gemm", "reference-math"])
def test_non_finite_values_propagate_like_lax(dtype, dn, where, shape):
    M, K, N = shape
    rng = np.random.default_rng(stable_seed("non-finite", dtype, dn, where, shape))
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N) if dn == KN else (N, K)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    i, k, n = rng.integers(M), rng.integers(K), rng.integers(N)
    if "x-inf" in where:
        x[i, k] = np.inf
    if where == "x-nan":
        x[i, k] = np.nan
    if where == "w-neg-inf":
        w[(k, n) if dn == KN else (n, k)] = -np.inf
    if "dy-inf" in where:
        dy[i, n] = np.inf
    if "dy-nan" in where:
        dy[(i + 1) % M, n] = np.nan
    x, w, dy = (jnp.asarray(v, dtype) for v in (x, w, dy))
    # lax's finite entries, where an inf of the weight reaches the outputs of its whole 128x128 tile
    want = _masks(lambda a, b: lax.dot_general(a, b, dn), x, jnp.asarray(_inf_tiles(w), dtype), dy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small shape is computed by the reference math (a warning)
        got = _masks(_jit_fp8_dot_general(dn), x, w, dy)
    assert any((~m).any() for m in want)  # the case has non-finite outputs to propagate
    for name, g, r in zip(("y", "dx", "dW"), got, want):
        np.testing.assert_array_equal(g, r, err_msg=f"{name}: finite entries differ from lax.dot_general's")


def test_inf_input_reported_case():
    """The reported case: an inf in x gave 449.29 where lax.dot_general gives inf."""
    x = np.ones((128, 128), np.float32)
    x[0, 0] = np.inf
    y = np.asarray(jf.fp8_dot_general(x, np.ones((128, 128), np.float32), KN))
    assert np.isposinf(y[0]).all() and np.isfinite(y[1:]).all()


@pytest.mark.parametrize("where", ["x-inf", "w-nan", "dy-inf"])
def test_non_finite_values_propagate_like_lax_on_the_lax_fallback(where):
    rng = np.random.default_rng(stable_seed("non-finite-fallback", where))
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 4), (2, 4, 5), (2, 3, 5)])
    {"x-inf": x, "w-nan": w, "dy-inf": dy}[where][1, 2, 3] = np.nan if where == "w-nan" else np.inf
    want = _masks(lambda a, b: lax.dot_general(a, b, BATCHED), x, w, dy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _masks(lambda a, b: jf.fp8_dot_general(a, b, BATCHED), x, w, dy)
    assert any((~m).any() for m in want)
    for name, g, r in zip(("y", "dx", "dW"), got, want):
        np.testing.assert_array_equal(g, r, err_msg=f"{name}: finite entries differ from lax.dot_general's")


def test_non_array_operands_behave_as_in_lax():
    """A Python list is rejected with lax's error; a Python scalar with scalar dimension numbers and a
    NumPy array are taken, as lax takes them."""
    w = jnp.ones((2, 2))
    want = _raised(lambda: lax.dot_general([[1.0, 2.0]], w, KN))
    assert want is not None and _raised(lambda: jf.fp8_dot_general([[1.0, 2.0]], w, KN)) == want
    scalar = (((), ()), ((), ()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shapes this small are no FP8 GEMM: one warning each
        np.testing.assert_array_equal(np.asarray(jf.fp8_dot_general(2.0, w, scalar)),
                                      np.asarray(lax.dot_general(2.0, w, scalar)))
        assert jf.fp8_dot_general(np.ones((1, 2), np.float32), w, KN).shape == (1, 2)


def test_recipe_quantized_tensors_satisfy_a_te_rule_scheme():
    """saturate_inf does not count when a gather asks whether a tensor already holds what it needs:
    the recipe's activations gather as they are under a Scheme built with TE's rule."""
    qz = jf.Scheme("blockwise", rowwise=True, colwise=True, layout="gemm_ready")
    lhs = jf.Float8BlockScaling().scheme("lhs")
    assert not lhs.saturate_inf and qz.satisfied_by(lhs) and lhs.satisfied_by(qz)


@pytest.mark.parametrize("out", [jnp.float8_e4m3fn, jnp.complex64], ids=["float8", "complex64"])
def test_other_output_dtypes_fall_back_and_differentiate(out):
    """An output dtype the GEMM does not give: the lax fallback, forward and gradient, as lax does."""
    rng = np.random.default_rng(stable_seed("out-dtype", jnp.dtype(out).name))
    # on the CPU device: XLA's complex GEMM fails on cuBLAS 13 ("not supported by cublasLt"), lax's too
    cpu = jax.devices("cpu")[0]
    x, w = (jax.device_put(rng.standard_normal((128, 128), np.float32), cpu) for _ in range(2))
    with pytest.warns(jf.Fp8GemmFallbackWarning, match="preferred_element_type"):
        y, vjp = jax.vjp(lambda a, b: jf.fp8_dot_general(a, b, KN, preferred_element_type=out), x, w)
    y_ref, vjp_ref = jax.vjp(lambda a, b: lax.dot_general(a, b, KN, preferred_element_type=out), x, w)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    dx, dw = vjp(y)
    dx_ref, dw_ref = vjp_ref(y_ref)
    assert (dx.dtype, dw.dtype, dx.shape, dw.shape) == (dx_ref.dtype, dw_ref.dtype, x.shape, w.shape)


@pytest.mark.parametrize("shape,n,grad_dtype", [((2, 256, 384), 272, jnp.float8_e4m3fn),
                                                ((3, 2, 128, 256), 256, jnp.float8_e5m2),
                                                ((4, 136, 256), 272, jnp.float8_e4m3fn),
                                                ((2, 128, 256), 264, jnp.float8_e4m3fn)],
                         ids=["3d", "4d-e5m2", "seq-not-128", "n-padded"])
def test_sequences_kept_apart_give_the_folded_bits(shape, n, grad_dtype):
    """A (..., S, K) lhs with S % 128 == 0 runs as stacked sequences where they may be split across devices
    (so a split S stays split under jit):
    forward and gradients bit for bit those of the same lhs folded to (M, K) by hand; S % 128 != 0, or
    an N the stacked GEMMs would need padded, folds."""
    rng = np.random.default_rng(stable_seed("stacked", shape))
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((shape[-1], n)) / 16, jnp.float32)
    recipe = jf.Float8BlockScaling(grad_dtype=grad_dtype)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    cot = jnp.asarray(rng.standard_normal((*shape[:-1], n)), jnp.bfloat16)

    def run(x, w, fold):
        f = lambda a, b: jf.fp8_dot_general(a.reshape(-1, shape[-1]) if fold else a, b,  # noqa: E731
                                            (((1,), (0,)), ((), ())) if fold else dims, recipe=recipe)
        y, vjp = jax.vjp(f, x, w)
        return (y.reshape(cot.shape), *vjp(cot.reshape(y.shape).astype(y.dtype)))

    stacked = f"u8[{int(np.prod(shape[:-2]))},{shape[-2]},{shape[-1]}]"  # the GEMM's stacked lhs
    assert len(jax.devices("cpu")) > 1  # conftest's 8 CPU devices: where sequences may be split, they stack
    assert (stacked in str(jax.make_jaxpr(partial(run, fold=False))(x, w))) == (shape[-2] % 128 == 0 and n % 16 == 0)
    for got, want, what in zip(jax.jit(partial(run, fold=False))(x, w), jax.jit(partial(run, fold=True))(x, w),
                               ("y", "dx", "dw")):
        assert_bits_equal(got.reshape(want.shape), want, what)


def test_sequences_fold_where_they_cannot_be_split():
    """Inside shard_map (local arrays) a (B, S, K) lhs folds into rows: no stacked GEMM, no transpose."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("d",))
    x, w = jnp.ones((4, 128, 256), jnp.bfloat16), jnp.ones((256, 256), jnp.bfloat16)
    f = jax.shard_map(lambda x, w: jf.fp8_dot_general(x, w, (((2,), (0,)), ((), ()))), mesh=mesh,
                      in_specs=(jax.sharding.PartitionSpec("d"), jax.sharding.PartitionSpec()),
                      out_specs=jax.sharding.PartitionSpec("d"))
    text = str(jax.make_jaxpr(f)(x, w))
    assert "u8[256,256]" in text and "u8[2,128,256]" not in text  # the folded (M, K) lhs, not the stack


@pytest.mark.parametrize("dtypes", [("int32", "int32"), ("complex64", "complex64"), ("int32", "float32")], ids=str)
def test_the_fallback_warning_says_what_it_computes(dtypes):
    """Operands FP8 cannot quantize are used as they are: the warning says so (not "quantize-dequantized
    operands"), and names the call; the result is lax.dot_general's of those operands (the float one,
    if any, quantize-dequantized as the warning says)."""
    rng = np.random.default_rng(stable_seed("fallback-words", dtypes))
    x, w = (jnp.asarray(rng.integers(-5, 5, s).astype(d) + (1j * rng.integers(-5, 5, s) if d == "complex64" else 0),
                        d) for s, d in zip([(4, 6), (6, 3)], dtypes))
    with pytest.warns(jf.Fp8GemmFallbackWarning) as rec:
        y = jf.fp8_dot_general(x, w, KN)
    (msg,) = [str(r.message) for r in rec if issubclass(r.category, jf.Fp8GemmFallbackWarning)]
    assert f"lhs {dtypes[0]}[4,6], rhs {dtypes[1]}[6,3], dimension_numbers (((1,), (0,)), ((), ()))" in msg, msg
    if dtypes[0] == dtypes[1]:
        assert (f"computing lax.dot_general on the operands as they are ({dtypes[0]} is not a float type FP8 can "
                "quantize)") in msg and "quantize-dequantized" not in msg, msg
        want = lax.dot_general(x, w, KN)
    else:
        assert (f"the lhs as it is ({dtypes[0]} is not a float type FP8 can quantize) and the rhs "
                "quantize-dequantized (128x128 tiles)") in msg, msg
        want = lax.dot_general(x, jf.quantize_dequantize(w, "blockwise", block=(128, 128)), KN)
    assert y.dtype == want.dtype
    assert_bits_equal(y, want, "the fallback's result")
