"""``jax_fp8.fused.norm_dense`` and ``norm_mlp`` against the unfused composition they promise the bits
of: ``fp8_dot_general(rms_norm(x, gamma), kernel.astype(x.dtype))`` and ``fp8_dot_general(swiglu(
fp8_dot_general(rms_norm(x, gamma), w_gate_up.astype(x.dtype))), w_down.astype(x.dtype))``.

Compared bit for bit: the output, dx, and dW once the fused layer's gradient (the wgrad GEMM's output in
the weight's dtype: an fp32 master gets fp32) is rounded to x's dtype, where the unfused program
rounds it (its GEMM runs on the kernel cast to x's dtype). dgamma is a sum over the rows that XLA may
order differently in the two programs: within the bound of two fp32 sums of the same M terms.

Shapes are generated: every dim (M, or the sequence length of a 3-D x, K, F, N) takes each residue
class of ``RESIDUES`` against the 128-wide blocks, with the gamma kind, kernel dtype, rank of x and the
recipe cycled over the cases; then the transformations (jit, grad, vmap, checkpoint), ``shard_map`` and
sharded ``jax.jit``; the errors; and the unfused ops' gradients against float64 autodiff.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import fused, producers
from jax_fp8.gemm.backends import cudnn
from helpers import assert_bits_equal, stable_seed, xla_rounds_as_written

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
U32 = 2.0 ** -24
_CPU = jax.devices("cpu")[0]
# the MXFP8 recipe's GEMMs run as their reference on CPU, and so does a GEMM padded too much (one row),
# each saying so once per trace
pytestmark = [pytest.mark.filterwarnings("ignore::jax_fp8.MXFP8GemmFallbackWarning"),
              pytest.mark.filterwarnings("ignore::jax_fp8.Fp8GemmFallbackWarning")]

RECIPES = {"f8": jf.Float8BlockScaling(), "f8-e5m2": jf.Float8BlockScaling(grad_dtype=jnp.float8_e5m2),
           "mx": jf.MXFP8BlockScaling()}
RESIDUES = (0, 1, 72, 127)  # against 128: aligned, one over, mid-block, one short
GAMMAS = (F32, None, BF16)
EPS = 1e-6


def _dim(i: int, q: int) -> int:
    """128 * q + RESIDUES[i % 4], at least 1."""
    return max(1, 128 * q + RESIDUES[i % len(RESIDUES)])


def _cases(n_dims: int, n: int, tag: str):
    """``n`` cases over ``n_dims`` dims: dim d of case i takes RESIDUES[(i + d + d * (i // 4)) % 4], so
    each dim meets every residue in every 4 consecutive cases and the dims' residues pair differently
    in the next 4; quotients (128s) cycle over 0..2."""
    out = []
    for i in range(n):
        dims = tuple(_dim(i + d + d * (i // 4), (i + d) % 3 if d else (i // 2) % 3) for d in range(n_dims))
        out.append(dict(dims=dims, gamma=GAMMAS[i % 3], w_dtype=(F32, BF16)[(i // 2) % 2], ndim=2 + i % 2,
                        recipe=list(RECIPES)[i % 3], x_dtype=(BF16, BF16, BF16, F32, BF16, F16)[i % 6], tag=tag, i=i))
    return out


def _case_id(c):
    g = "none" if c["gamma"] is None else jnp.dtype(c["gamma"]).name
    extra = "".join(f"-{c[k]}" for k in ("activation",) if k in c)
    if c.get("norm") == "layernorm":
        extra += "-ln" + ("" if c.get("beta") is None else "-b" + jnp.dtype(c["beta"]).name)
    return (f"{c['tag']}{c['i']}-{'x'.join(map(str, c['dims']))}-{c['ndim']}d-{jnp.dtype(c['x_dtype']).name}"
            f"-g{g}-w{jnp.dtype(c['w_dtype']).name}-{c['recipe']}{extra}")


COMMON = (512, 1024, 2048, 4096)  # the widths models use, each among the widths of the cases below


def _common_cases(n_dims: int, n: int, tag: str):
    """``n`` more cases whose widths (every dim but the rows) are the common widths, each taking every
    one of them in turn; the rows keep the residue walk."""
    out = _cases(n_dims, n, tag)
    for i, c in enumerate(out):
        c["dims"] = (c["dims"][0], *(COMMON[(i + d) % len(COMMON)] for d in range(n_dims - 1)))
    return out


DENSE = _cases(3, 8, "dense") + _common_cases(3, 4, "dense-common")  # (M, K, N)
MLP = _cases(4, 6, "mlp") + _common_cases(4, 4, "mlp-common")  # (M, K, F, N)
for _i, _c in enumerate(MLP):  # the MLP's activation alternates (the swiglu in 6 of 10)
    _c["activation"] = ("swiglu", "gelu", "swiglu")[_i % 3]
for _i, _c in enumerate(DENSE + MLP):  # LayerNorm in every other case with a norm, a bias in most of those
    _c["norm"] = ("rmsnorm", "layernorm")[(_i // 3) % 2]
    _c["beta"] = (F32, None, BF16)[(_i // 2) % 3] if _c["norm"] == "layernorm" else None


def test_cases_cover_every_residue():
    for cases, n_dims in ((DENSE, 3), (MLP, 4)):
        for d in range(n_dims):
            assert {c["dims"][d] % 128 for c in cases} == {r % 128 for r in RESIDUES}, (d, [c["dims"] for c in cases])
            if d:  # the widths: every common one too
                assert set(COMMON) <= {c["dims"][d] for c in cases}, (d, [c["dims"] for c in cases])
    assert {c["activation"] for c in MLP} == set(fused.ACTIVATIONS)
    for cases in (DENSE, MLP):  # each norm with a gamma, LayerNorm with and without a bias
        assert {c["norm"] for c in cases if c["gamma"] is not None} == set(fused.NORMS)
        with_ln = [c for c in cases if c["gamma"] is not None and c["norm"] == "layernorm"]
        assert {c["beta"] is None for c in with_ln} == {True, False}
    for key in ("gamma", "w_dtype", "ndim", "recipe"):
        assert len({str(c[key]) for c in DENSE}) == len({str(c[key]) for c in DENSE + MLP}) > 1, key


# ---- the layers and their unfused compositions ---------------------------------------------------------
def _kn(x):
    return (((x.ndim - 1,), (0,)), ((), ()))


def _unfused_norm(x, gamma, eps, norm, beta):
    if gamma is None:
        return x
    return fused.rms_norm(x, gamma, eps) if norm == "rmsnorm" else fused.layer_norm(x, gamma, beta, eps)


def unfused_dense(x, gamma, w, *, eps=EPS, recipe=None, norm="rmsnorm", beta=None):
    n = _unfused_norm(x, gamma, eps, norm, beta)
    return jf.fp8_dot_general(n, w.astype(x.dtype), _kn(n), recipe=recipe)


def unfused_mlp(x, gamma, w1, w2, *, eps=EPS, recipe=None, activation="swiglu", norm="rmsnorm", beta=None):
    h = unfused_dense(x, gamma, w1, eps=eps, recipe=recipe, norm=norm, beta=beta)
    a = fused.ACTIVATIONS[activation][0](h)
    return jf.fp8_dot_general(a, w2.astype(x.dtype), _kn(a), recipe=recipe)


def _x_shape(M, K, ndim):
    """2-D (M, K), or 3-D (2, M, K): M is then the sequence length and the folded rows 2M."""
    return (M, K) if ndim == 2 else (2, M, K)


def _data(rng, x_shape, gamma_dtype, w_shapes, w_dtype, x_dtype, n_out):
    x = rng.standard_normal(x_shape) * 2.0 ** rng.integers(-3, 4, x_shape[:-1] + (1,))
    if x.size // x_shape[-1] > 2:
        x.reshape(-1, x_shape[-1])[0] = 0.0  # an all-zero row: RMSNorm's output 0
    x = jnp.asarray(x, x_dtype)
    gamma = None if gamma_dtype is None else jnp.asarray(1 + 0.25 * rng.standard_normal(x_shape[-1]), gamma_dtype)
    ws = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), w_dtype) for s in w_shapes]
    c = jnp.asarray(rng.standard_normal(x_shape[:-1] + (n_out,)), F32)  # the loss's weights: dy
    return x, gamma, ws, c


def _value_and_grads(layer, x, gamma, ws, c):
    """(y, (dx, dgamma or None, *dW)) of the loss sum(y * c) (jax.grad; dy = c in y's dtype)."""
    def loss(x, gamma, *ws):
        y = layer(x, gamma, *ws)
        return jnp.sum(y.astype(F32) * c), y
    argnums = (0, 1, *range(2, 2 + len(ws))) if gamma is not None else (0, *range(2, 2 + len(ws)))
    (_, y), g = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(x, gamma, *ws)
    g = list(g)
    if gamma is None:
        g.insert(1, None)
    return y, tuple(g)


def _dn(x, gamma, ws, c, eps, recipe, mlp, norm="rmsnorm", beta=None):
    """The output gradient of the unfused norm (what dgamma and dbeta sum over the rows); ``mlp``: False,
    True (the SwiGLU MLP) or the MLP's activation."""
    n = _unfused_norm(x, gamma, eps, norm, beta)
    act = mlp if isinstance(mlp, str) else "swiglu"
    rest = ((lambda n: unfused_mlp(n, None, *ws, recipe=recipe, activation=act)) if mlp
            else (lambda n: unfused_dense(n, None, *ws, recipe=recipe)))
    return jax.grad(lambda n: jnp.sum(rest(n).astype(F32) * c))(n)


def _normalised(x, eps, norm):
    """(xhat, rstd) of the rows in float64 from the contract's statistics: the normalised rows before gamma
    (rows, K) and each row's rstd (rows, 1)."""
    xf = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    if norm == "rmsnorm":
        mean, rstd = 0.0, producers.rms_norm_rstd(xf, eps)
    else:
        mean, rstd = producers.layer_norm_stats(xf, eps)
        mean = mean[:, None]
    rstd = rstd.astype(np.float64)[:, None]
    return (xf - mean) * rstd, rstd


def _xhat(x, eps, norm):
    """The normalised rows (before gamma) in float64 from the contract's statistics; "ones": dbeta's terms'
    factor."""
    if norm == "ones":
        return np.ones((x.size // x.shape[-1], x.shape[-1]))
    return _normalised(x, eps, norm)[0]


def _assert_dgamma_close(got, want, x, gamma, dn, eps, what="dgamma", norm="rmsnorm"):
    """Both sum the same M fp32 terms dn * xhat (their bits agree: dn and the statistics do) over the rows,
    in orders XLA picks: each within gamma(M - 1) * sum|terms| of the exact sum, so within twice that of
    each other; a 16-bit gamma's rounding of each adds at most one of its ulps at the larger value.
    ``norm="ones"``: dbeta, the sum of dn itself."""
    xhat = _xhat(x, eps, norm)
    S = np.sum(np.abs(np.asarray(dn, np.float64).reshape(xhat.shape)) * np.abs(xhat), axis=0)
    M = xhat.shape[0]
    g_m = (M - 1) * U32 / (1 - (M - 1) * U32)
    bound = 2 * g_m * S * (1 + 4 * U32)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if jnp.dtype(gamma.dtype) != jnp.dtype(F32):
        mag = np.maximum(np.abs(got), np.abs(want))
        bound = bound + 2.0 ** (np.floor(np.log2(np.where(mag > 0, mag, 1.0))) - jnp.finfo(gamma.dtype).nmant)
    err = np.abs(got - want)
    assert (err <= bound).all(), (what, np.max(err / np.where(bound > 0, bound, 1e-300)))


def _assert_dx_close(got, want, x, gamma, dn, eps, norm, exact=None):
    """The norm's input gradient, fused layer against unfused: the same jax.numpy on the same bits (x, gamma,
    the statistics, dn), which XLA compiles inside different fusions. On the CPU that gives the same bits.
    XLA's GPU compiler may order the row means c1 = mean(dxhat), c2 = mean(dxhat * xhat) otherwise, contract
    products into FMAs otherwise, or take LayerNorm's backward into a Triton fusion of its own; then each
    side's c is within gamma(K + 2) * sum|terms| / K of the exact mean, so the two within twice that, and
    dx = rstd * ((dxhat - c1) - xhat * c2) within rstd * (|dc1| + |xhat| |dc2|) plus 4 roundings of each
    side's operands, plus one unit in the last place of x's dtype for the final rounding. ``exact``: bits
    (default: on the CPU)."""
    if exact if exact is not None else jax.default_backend() == "cpu":
        assert_bits_equal(got, want, "dx")
        return
    K = x.shape[-1]
    xhat, rstd = _normalised(x, eps, norm)
    dxhat = np.asarray(dn, np.float64).reshape(-1, K) * np.asarray(gamma, np.float64)
    g = (K + 2) * U32 / (1 - (K + 2) * U32)
    s1 = np.abs(dxhat).sum(-1, keepdims=True) / K if norm == "layernorm" else 0.0
    s2 = np.abs(dxhat * xhat).sum(-1, keepdims=True) / K
    c1 = dxhat.mean(-1, keepdims=True) if norm == "layernorm" else 0.0
    c2 = (dxhat * xhat).mean(-1, keepdims=True)
    bound = rstd * (2 * g * (s1 + np.abs(xhat) * s2) + 8 * U32 * (np.abs(dxhat) + np.abs(c1) + np.abs(xhat * c2)))
    got64, want64 = (np.asarray(v, np.float64).reshape(-1, K) for v in (got, want))
    mag = np.maximum(np.abs(got64), np.abs(want64))
    ulp = 2.0 ** (np.floor(np.log2(np.where(mag > 0, mag, 1.0))) - jnp.finfo(x.dtype).nmant)
    err = np.abs(got64 - want64)
    assert (err <= bound * (1 + 1e-3) + ulp).all(), ("dx", np.max(err / (bound + ulp)))


@pytest.mark.parametrize("norm", fused.NORMS)
def test_dx_bound_holds_and_can_fail(norm):
    """_assert_dx_close's bound (what the GPU is held to): the norm's backward as jax.numpy under jit against
    the same formula in NumPy float32 with its means summed one term at a time (another order, no FMA)
    is within it; 2**-10 off is not."""
    rng = np.random.default_rng(stable_seed("dx bound", norm))
    M, K = 64, 1000
    x = (rng.standard_normal((M, K)) * 2 + 1).astype(np.float32)
    gamma, dn = rng.standard_normal(K).astype(np.float32), rng.standard_normal((M, K)).astype(np.float32)
    xhat = _xhat(x, EPS, norm).astype(np.float32)
    if norm == "rmsnorm":
        stats = producers.rms_norm_rstd(x, EPS)
        rstd = stats[:, None]
    else:
        stats = np.stack(producers.layer_norm_stats(x, EPS), -1)
        rstd = stats[:, 1:2]
    want = jax.jit(lambda *a: fused._norm_grad(norm, *a)[0])(x, gamma, stats, dn)
    dxhat = dn * gamma
    mean = lambda t: (np.cumsum(t, axis=-1, dtype=np.float32)[:, -1:] / np.float32(K)).astype(np.float32)  # noqa: E731
    c1 = mean(dxhat) if norm == "layernorm" else np.float32(0)
    got = rstd * ((dxhat - c1) - xhat * mean(dxhat * xhat))
    assert (got != np.asarray(want)).any()  # the premise: another order, other bits
    _assert_dx_close(got, want, x, gamma, dn, EPS, norm, exact=False)
    with pytest.raises(AssertionError):
        _assert_dx_close(got * np.float32(1 + 2.0 ** -10), want, x, gamma, dn, EPS, norm, exact=False)


def _xla_sums_gemms(recipe) -> bool:
    """Whether XLA's GPU GEMMs run the recipe's products (the MXFP8 reference off Blackwell): the fused
    layer's fp32 dW and the unfused layer's x-dtype dW are then two GEMMs of different output dtypes,
    each autotuned on its own, which may sum the same exact FP8 products in different orders (split-K;
    seen on an H100: 6 of 32766 elements one float16 step apart, the test passing on a rerun)."""
    return (jax.default_backend() == "gpu" and isinstance(recipe, jf.MXFP8BlockScaling)
            and cudnn.unavailable("cuda") is not None)


def _assert_weight_grad(dw_fused, dw_unfused, w, x_dtype, what, rows=2, recipe=None, S=None):
    """The fused layer's dW is in the weight's dtype, the unfused one is x's dtype's, upcast: equal once
    the fused one is rounded to x's dtype; an fp32 master's keeps bits the rounding drops (a sum over
    ``rows`` > 1 products of FP8 values; one such product fits in bf16). (The unfused dW is x's dtype's
    only where XLA rounds as the program says: on a GPU, XLA's excess precision may keep its float32
    bits, seen on an H100 for the MXFP8 recipe's reference GEMM; both still round to the same x dtype.)
    ``S``: the sum over the rows of the terms' magnitudes (``_wgrad_magnitudes``). Two fp32 sums of the
    same ``rows`` exact terms in different orders differ by at most 2 (n-1) u / (1 - n u) S (u = 2**-24),
    and the unfused one's rounding to x's dtype adds at most one step of it: asserted where given, and
    instead of the bits where XLA's GPU GEMMs sum the products (``_xla_sums_gemms``)."""
    assert dw_fused.dtype == w.dtype and dw_unfused.dtype == w.dtype, (what, dw_fused.dtype, dw_unfused.dtype)
    if xla_rounds_as_written():
        assert_bits_equal(np.asarray(dw_unfused.astype(x_dtype).astype(w.dtype)), np.asarray(dw_unfused),
                          f"{what} unfused")
    if S is not None:
        a, b = np.asarray(dw_fused, np.float64), np.asarray(dw_unfused, np.float64)
        step = np.spacing(np.abs(np.asarray(dw_unfused.astype(x_dtype)))).astype(np.float64)
        bound = 2 * (rows - 1) * U32 / (1 - rows * U32) * S.reshape(a.shape) * (1 + 1e-3) + step
        assert (np.abs(a - b) <= bound).all(), (what, np.max(np.abs(a - b) / bound))
    if recipe is not None and _xla_sums_gemms(recipe):
        assert S is not None, f"{what}: XLA's GPU GEMMs need the bound's magnitudes"
    else:
        assert_bits_equal(dw_fused.astype(x_dtype), dw_unfused.astype(x_dtype), what)
    if jnp.dtype(w.dtype) == jnp.dtype(F32) and jnp.dtype(x_dtype) != jnp.dtype(F32) and rows > 1:
        assert (np.asarray(dw_fused) != np.asarray(dw_fused.astype(x_dtype).astype(F32))).any(), what


def _n_produce(fn, *args):
    return jax.make_jaxpr(fn)(*args).pretty_print().count("jf_produce_quantize")


def _check_case(c, mlp):
    rng = np.random.default_rng(stable_seed(_case_id(c)))
    act, norm = c.get("activation", "swiglu"), c.get("norm", "rmsnorm")
    if mlp:
        M, K, F, N = c["dims"]
        w_shapes, n_out = [(K, fused.ACTIVATIONS[act][1] * F), (F, N)], N
    else:
        M, K, N = c["dims"]
        w_shapes, n_out = [(K, N)], N
    recipe = RECIPES[c["recipe"]]
    x, gamma, ws, cot = _data(rng, _x_shape(M, K, c["ndim"]), c["gamma"], w_shapes, c["w_dtype"], c["x_dtype"], n_out)
    # LayerNorm with a bias: beta leads the differentiated parameters after gamma
    nb = int(c.get("beta") is not None and gamma is not None)
    params = ([jnp.asarray(0.5 * rng.standard_normal(K), c["beta"])] if nb else []) + ws

    def split(p):
        return dict(norm=norm, beta=p[0] if nb else None), p[nb:]

    def layer(x, g, *p):
        kw, w = split(p)
        return (fused.norm_mlp(x, g, *w, eps=EPS, recipe=recipe, activation=act, **kw) if mlp
                else fused.norm_dense(x, g, *w, eps=EPS, recipe=recipe, **kw))

    def ref(x, g, *p):
        kw, w = split(p)
        return (unfused_mlp(x, g, *w, eps=EPS, recipe=recipe, activation=act, **kw) if mlp
                else unfused_dense(x, g, *w, eps=EPS, recipe=recipe, **kw))

    @jax.jit
    def run(x, gamma, params, cot):
        out = {"fused": _value_and_grads(layer, x, gamma, params, cot),
               "unfused": _value_and_grads(ref, x, gamma, params, cot)}
        kw, w = split(params)
        out["dn"] = None if gamma is None else _dn(x, gamma, w, cot, EPS, recipe, mlp and act, **kw)
        return out

    out = run(x, gamma, params, cot)
    (y, grads), (y_ref, grads_ref) = out["fused"], out["unfused"]
    # the fused layer runs fused: one jf_produce_quantize per norm, master cast and activation
    casts = sum(jnp.dtype(w.dtype) != jnp.dtype(x.dtype) for w in ws)
    assert _n_produce(layer, x, gamma, *params) == (gamma is not None) + casts + mlp
    assert _n_produce(ref, x, gamma, *params) == 0
    if gamma is not None and norm == "layernorm":
        assert "layernorm" in jax.make_jaxpr(layer)(x, gamma, *params).pretty_print()
    assert y.shape == x.shape[:-1] + (n_out,) and y.dtype == x.dtype
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert_bits_equal(y, y_ref, "y")
    if gamma is None:
        assert_bits_equal(grads[0], grads_ref[0], "dx")
    else:
        _assert_dx_close(grads[0], grads_ref[0], x, gamma, out["dn"], EPS, norm)
    # the MXFP8 recipe: also within the bound of two summation orders (on a GPU off Blackwell, XLA's)
    mags = (_wgrad_magnitudes(x, gamma, ws, cot, recipe, mlp, activation=act, **split(params)[0])
            if isinstance(recipe, jf.MXFP8BlockScaling) else [None] * len(ws))
    for i, w in enumerate(ws):
        _assert_weight_grad(grads[2 + nb + i], grads_ref[2 + nb + i], w, x.dtype, f"dW{i}", rows=x.size // x.shape[-1],
                            recipe=recipe, S=mags[i])
    if gamma is None:
        assert grads[1] is None
    else:
        assert grads[1].dtype == gamma.dtype
        _assert_dgamma_close(grads[1], grads_ref[1], x, gamma, out["dn"], EPS, norm=norm)
    if nb:
        assert grads[2].dtype == params[0].dtype
        _assert_dgamma_close(grads[2], grads_ref[2], x, params[0], out["dn"], EPS, "dbeta", norm="ones")


@pytest.mark.parametrize("case", DENSE, ids=_case_id)
def test_norm_dense_matches_unfused(case):
    _check_case(case, mlp=False)


@pytest.mark.parametrize("case", MLP, ids=_case_id)
def test_norm_mlp_matches_unfused(case):
    _check_case(case, mlp=True)


@pytest.mark.parametrize("recipe,M", [("mx", 256), ("f8", 1)])
def test_fused_layers_warn_as_fp8_dot_general(recipe, M):
    """Where fp8_dot_general warns that a GEMM runs by its reference math (the MXFP8 recipe off
    Blackwell; a one-row wgrad padded 16x), the fused layer running the same GEMM warns too."""
    rng = np.random.default_rng(stable_seed("warnings", recipe, M))
    x, gamma, (w,), cot = _data(rng, (M, 328), F32, [(328, 127)], F32, BF16, 127)
    caught = {}
    for name, f in (("unfused", unfused_dense), ("fused", fused.norm_dense)):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            jax.jit(lambda *a: _value_and_grads(lambda x, g, w: f(x, g, w, recipe=RECIPES[recipe]), *a))(
                x, gamma, [w], cot)
        caught[name] = {type(m.message).__name__ for m in got if issubclass(m.category, jf.Fp8Warning)}
    assert caught["unfused"], caught  # the premise: fp8_dot_general says so
    assert caught["fused"] == caught["unfused"], caught


# ---- vmap, checkpoint ----------------------------------------------------------------------------------
def test_vmap_leading_dim():
    """vmap over a leading dim of x (the weights shared): per-example values and gradients equal the
    unfused layer's under the same vmap, and each slice's own unmapped call."""
    rng = np.random.default_rng(stable_seed("vmap"))
    V, M, K, F, N = 2, 130, 256, 128, 200
    x, gamma, ws, cot = _data(rng, (V, M, K), F32, [(K, 2 * F), (F, N)], F32, BF16, N)
    recipe = RECIPES["f8"]
    layer = lambda x, g, *w: fused.norm_mlp(x, g, *w, recipe=recipe)  # noqa: E731
    ref = lambda x, g, *w: unfused_mlp(x, g, *w, recipe=recipe)  # noqa: E731

    def per_example(f):
        return jax.vmap(lambda x, c: _value_and_grads(f, x, gamma, ws, c))(x, cot)

    got, want = jax.jit(lambda: (per_example(layer), per_example(ref)))()
    one = jax.jit(lambda x, c: _value_and_grads(layer, x, gamma, ws, c))
    assert_bits_equal(got[0], want[0], "y")
    assert_bits_equal(got[1][0], want[1][0], "dx")
    for i, w in enumerate(ws):
        _assert_weight_grad(got[1][2 + i], want[1][2 + i], w, x.dtype, f"dW{i}")
    for v in range(V):
        y, g = one(x[v], cot[v])
        assert_bits_equal(got[0][v], y, f"y[{v}]")
        for a, b, what in zip(got[1], g, ("dx", "dgamma", "dW0", "dW1")):
            if what == "dgamma":  # a sum over the rows in XLA's order, which may change under vmap (GPU)
                dn = jax.jit(lambda: _dn(x[v], gamma, ws, cot[v], EPS, recipe, True))()
                _assert_dgamma_close(a[v], b, x[v], gamma, dn, EPS, f"dgamma[{v}]")
            else:
                assert_bits_equal(a[v], b, f"{what}[{v}]")


def test_checkpoint_changes_nothing():
    """jax.checkpoint around the fused layers (the forward recomputed in the backward): same bits."""
    rng = np.random.default_rng(stable_seed("checkpoint"))
    M, K, F, N = 256, 129, 200, 128
    x, gamma, ws, cot = _data(rng, (M, K), BF16, [(K, 2 * F), (F, N)], F32, BF16, N)
    mlp = lambda x, g, *w: fused.norm_mlp(x, g, *w)  # noqa: E731
    dense = lambda x, g, w: fused.norm_dense(x, g, w)  # noqa: E731

    @jax.jit
    def run():
        return [_value_and_grads(f, x, gamma, ws, cot) for f in (mlp, jax.checkpoint(mlp))] + [
            _value_and_grads(f, x, gamma, ws[:1], cot[:, :1].repeat(2 * F, 1)) for f in (dense, jax.checkpoint(dense))]

    outs = run()
    for a, b in (outs[:2], outs[2:]):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert_bits_equal(u, v, "checkpointed")


# ---- shard_map (check_vma on) --------------------------------------------------------------------------
def _varying(v, axis):
    """``v`` cast to vary over ``axis`` (its transpose: the psum of a replicated operand's gradient)."""
    return lax.pcast(v, (axis,), to="varying")


@pytest.mark.parametrize("layer", ["norm_dense", "norm_mlp"])
def test_shard_map_data_parallel(layer):
    """x split over its rows on 8 devices, gamma and the weights replicated, the loss psummed: the fused
    layer's gradients against those of the same code with the unfused ops. dx is the same bits; dgamma
    (per-device sums, psummed) within the bound of M rows; dW is the psum of the per-device fp32 master
    gradients, the unfused one the
    psum of bf16 ones (its kernel was cast to bf16 before the per-device GEMM): within 8 bf16 roundings
    of sum_r |dW_r|. Each against the per-shard gradients computed on one device (no 8x): a device's
    wgrad GEMM is the one-device GEMM of its shard (same operands, same kernel), so the psum of 8 of
    them is within gamma(7) sum_r |dW_r| of their exact sum."""
    n, axis = 8, "data"
    mesh = Mesh(np.array(jax.devices("cpu")[:n]), (axis,))
    rng = np.random.default_rng(stable_seed("shard_map", layer))
    Mloc, K, F, N = 128, 256, 128, 136
    shapes = [(K, 2 * F), (F, N)] if layer == "norm_mlp" else [(K, N)]
    x, gamma, ws, cot = _data(rng, (n * Mloc, K), F32, shapes, F32, BF16, N)
    fused_fn = getattr(fused, layer)
    ref_fn = unfused_mlp if layer == "norm_mlp" else unfused_dense

    def grads(f, replicated_gamma):
        def loss(x, gamma, ws, c):
            if not replicated_gamma:  # the gamma varying as x (fused.rms_norm also takes a replicated one: below)
                gamma = _varying(gamma, axis)
            return lax.psum(jnp.sum(f(x, gamma, *ws).astype(F32) * c), axis)
        return jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                             in_specs=(P(axis), P(), P(), P(axis)), out_specs=(P(axis), P(), P()))

    got, want = jax.jit(lambda *a: (grads(fused_fn, True)(*a), grads(ref_fn, False)(*a)))(x, gamma, ws, cot)
    assert_bits_equal(got[0], want[0], "dx")
    dn = jax.jit(lambda: _dn(x, gamma, ws, cot, EPS, None, layer == "norm_mlp"))()
    _assert_dgamma_close(got[1], want[1], x, gamma, dn, EPS)
    # the per-shard gradients, on one of the mesh's devices (another platform's GEMMs have other bits)
    one = jax.jit(lambda x, c: jax.grad(lambda x, g, ws: jnp.sum(fused_fn(x, g, *ws).astype(F32) * c),
                                        argnums=(0, 1, 2))(x, gamma, ws))
    with jax.default_device(mesh.devices.flat[0]):
        parts = [one(x[r * Mloc:(r + 1) * Mloc], cot[r * Mloc:(r + 1) * Mloc]) for r in range(n)]
    for r in range(n):
        assert_bits_equal(got[0][r * Mloc:(r + 1) * Mloc], parts[r][0], f"dx shard {r}")
    for i, w in enumerate(ws):
        G = np.stack([np.asarray(p[2][i], np.float64) for p in parts])
        total, S = G.sum(0), np.abs(G).sum(0)
        fused_dw, ref_dw = np.asarray(got[2][i], np.float64), np.asarray(want[2][i], np.float64)
        assert (np.abs(fused_dw - total) <= 7 * U32 * (1 + 1e-3) * S).all(), f"dW{i}: fused vs the sum of shards"
        u_b = 2.0 ** -8
        assert (np.abs(ref_dw - total) <= 8 * u_b * (1 + 1e-3) * S).all(), f"dW{i}: unfused vs the sum of shards"
        assert (np.abs(fused_dw - ref_dw) <= (8 * u_b + 8 * U32) * (1 + 1e-3) * S).all(), f"dW{i}"
    # dgamma: the M terms summed per device then psummed, against the shards' own sums added up
    shards = sum(np.asarray(p[1], np.float64) for p in parts)
    _assert_dgamma_close(got[1], shards, x, gamma, dn, EPS, "dgamma vs shards")


def test_shard_map_rms_norm_with_replicated_gamma():
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    x = np.random.default_rng(stable_seed("rms_norm vma")).standard_normal((8 * 4, 256)).astype(np.float32)
    gamma = np.ones(256, np.float32)
    loss = lambda x, g: lax.psum(jnp.sum(fused.rms_norm(x, g) ** 2), "data")  # noqa: E731
    f = jax.jit(jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
    want = jax.grad(lambda x, g: jnp.sum(fused.rms_norm(x, g) ** 2), argnums=1)(x, gamma)
    np.testing.assert_allclose(np.asarray(f(x, gamma)), np.asarray(want), rtol=1e-5)


# ---- sharded jax.jit -----------------------------------------------------------------------------------
def _mesh(mode):
    """8 CPU devices on one axis: Auto, jax's default axis type (Explicit: shardings are types), or a
    plain ``Mesh(devices, names)`` as users build one."""
    if mode == "plain":
        return Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    types = dict(axis_types=(AxisType.Auto,)) if mode == "auto" else {}
    return jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8], **types)


@pytest.mark.parametrize("layer,mode", [("norm_dense", "auto"), ("norm_mlp", "auto"), ("norm_dense", "explicit"),
                                        ("norm_mlp", "plain")])
def test_sharded_jit_data_parallel(layer, mode):
    """x's rows split over 8 devices (128 per device, aligned to every block), everything else
    replicated: y and dx are the unsharded bits and stay split; dW and dgamma are sums over the rows that
    the partitioner splits into per-device partial sums: within twice the fp32 bound of M terms (the
    GEMM's products are the same on every device, only the sums' order changes)."""
    mesh = _mesh(mode)
    rng = np.random.default_rng(stable_seed("sharded jit", layer, mode))
    M, K, F, N = 1024, 256, 128, 128
    shapes = [(K, 2 * F), (F, N)] if layer == "norm_mlp" else [(K, N)]
    x, gamma, ws, cot = _data(rng, (M, K), F32, shapes, F32, BF16, N)
    fn = getattr(fused, layer)
    run = jax.jit(lambda x, g, ws, c: _value_and_grads(fn, x, g, ws, c))
    want = run(*jax.device_put((x, gamma, ws, cot), _CPU))
    rows = NamedSharding(mesh, P("data", None))
    rep = NamedSharding(mesh, P())
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.ShardingWarning)  # aligned shards: nothing gathered
        got = run(jax.device_put(x, rows), jax.device_put(gamma, rep), jax.device_put(ws, rep),
                  jax.device_put(cot, rows))
    assert_bits_equal(got[0], want[0], "y")
    assert_bits_equal(got[1][0], want[1][0], "dx")
    for v, what in ((got[0], "y"), (got[1][0], "dx")):
        assert v.addressable_shards[0].data.shape[0] == M // 8, (what, v.sharding)
    # the sums over rows: each of M products of the wgrad GEMM's FP8 operands (as the unfused program
    # quantizes them), summed in two orders
    for i, S in enumerate(_wgrad_magnitudes(x, gamma, ws, cot, RECIPES["f8"], layer == "norm_mlp")):
        a, b = np.asarray(got[1][2 + i], np.float64), np.asarray(want[1][2 + i], np.float64)
        bound = 2 * (M - 1) * U32 / (1 - M * U32) * S * (1 + 1e-3)
        assert (np.abs(a - b) <= bound).all(), (f"dW{i}", np.max(np.abs(a - b) / bound))
    dn = jax.jit(lambda: _dn(x, gamma, ws, cot, EPS, RECIPES["f8"], layer == "norm_mlp"))()
    _assert_dgamma_close(got[1][1], want[1][1], x, gamma, dn, EPS)


def test_explicit_mesh_split_kernel():
    """FSDP-like: x's rows and the kernel's columns split over the same Explicit axis: the fused layer's
    gradients are the unfused composition's (which runs)."""
    mesh = _mesh("explicit")
    rng = np.random.default_rng(stable_seed("explicit split kernel"))
    x, gamma, (w,), cot = _data(rng, (1024, 256), F32, [(256, 1024)], F32, BF16, 1024)
    put = lambda v, *spec: jax.device_put(v, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(x, "data", None), put(gamma), [put(w, None, "data")], put(cot, "data", None))
    want = jax.jit(lambda x, g, ws, c: _value_and_grads(unfused_dense, x, g, ws, c))(*args)
    got = jax.jit(lambda x, g, ws, c: _value_and_grads(fused.norm_dense, x, g, ws, c))(*args)
    assert_bits_equal(got[0], want[0], "y")
    assert_bits_equal(got[1][0], want[1][0], "dx")
    _assert_weight_grad(got[1][2], want[1][2], w, x.dtype, "dW")


def _wgrad_magnitudes(x, gamma, ws, cot, recipe, mlp, activation="swiglu", norm="rmsnorm", beta=None):
    """For each weight, sum over the rows of |lhs| x |grad| (entrywise, float64): the magnitudes of the
    terms its wgrad GEMM sums, from its operands as the unfused program quantizes them (the layer's
    (normed) input, or the activation's output, columnwise in the lhs scheme; the output gradient, or the
    activation's input gradient, columnwise in the grad scheme)."""
    act = fused.ACTIVATIONS[activation][0]

    @jax.jit
    def operands(x, gamma, ws, cot):
        n = _unfused_norm(x, gamma, EPS, norm, beta)
        dense = lambda v, w: jf.fp8_dot_general(v, w.astype(x.dtype), _kn(v), recipe=recipe)  # noqa: E731
        if not mlp:
            return [(n, cot.astype(x.dtype))]
        h = dense(n, ws[0])
        a = act(h)
        y, down = jax.vjp(lambda a: dense(a, ws[1]), a)
        dy = cot.astype(y.dtype)
        (da,) = down(dy)
        (dh,) = jax.vjp(act, h)[1](da)
        return [(n, dh), (a, dy)]

    out = []
    for lhs, grad in operands(x, gamma, ws, cot):
        qs = [jf.dequantize(jf.quantize(v.reshape(-1, v.shape[-1]), recipe.scheme(role)), F32, usage="colwise")
              for v, role in ((lhs, "lhs"), (grad, "grad"))]
        a, b = (np.abs(np.asarray(q, np.float64)) for q in qs)
        out.append(a.T @ b)
    return out


# ---- errors --------------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    x = jnp.zeros((4, 256), BF16)
    g = jnp.ones((256,), F32)
    w, w1, w2 = jnp.zeros((256, 128), F32), jnp.zeros((256, 256), F32), jnp.zeros((128, 64), F32)
    with pytest.raises(ValueError, match=r"norm_dense: gamma must be a float array of shape \(256,\)"):
        fused.norm_dense(x, jnp.ones((255,), F32), w)
    with pytest.raises(ValueError, match="norm_mlp: gamma"):
        fused.norm_mlp(x, jnp.ones((1, 256), F32), w1, w2)
    with pytest.raises(ValueError, match="gamma"):
        fused.norm_dense(x, jnp.ones((256,), jnp.int32), w)
    with pytest.raises(ValueError, match="norm_dense: kernel must be a float \\(in, out\\) kernel with 256 rows"):
        fused.norm_dense(x, g, jnp.zeros((128, 128), F32))
    with pytest.raises(ValueError, match="kernel"):
        fused.norm_dense(x, g, jnp.zeros((256,), F32))
    with pytest.raises(ValueError, match="norm_mlp: w_gate_up must be .* with 256 rows"):
        fused.norm_mlp(x, g, jnp.zeros((128, 256), F32), w2)
    with pytest.raises(ValueError, match="norm_mlp: w_gate_up must have an even number of columns"):
        fused.norm_mlp(x, g, jnp.zeros((256, 255), F32), w2)
    with pytest.raises(ValueError, match="norm_mlp: w_down must be .* with 128 rows"):
        fused.norm_mlp(x, g, w1, jnp.zeros((256, 64), F32))
    with pytest.raises(ValueError, match="norm_mlp: w_down must be .* with 256 rows"):  # GELU: F = w_gate_up's width
        fused.norm_mlp(x, g, w1, w2, activation="gelu")
    with pytest.raises(ValueError, match=r"norm_mlp: activation must be one of \('swiglu', 'gelu'\), got 'relu'"):
        fused.norm_mlp(x, g, w1, w2, activation="relu")
    with pytest.raises(ValueError, match=r"norm_dense: norm must be one of \('rmsnorm', 'layernorm'\), got 'ln'"):
        fused.norm_dense(x, g, w, norm="ln")
    with pytest.raises(ValueError, match="norm_dense: beta is LayerNorm's bias: it takes norm='layernorm'"):
        fused.norm_dense(x, g, w, beta=jnp.zeros((256,), F32))
    with pytest.raises(ValueError, match="norm_mlp: beta is LayerNorm's bias"):
        fused.norm_mlp(x, None, w1, w2, norm="layernorm", beta=jnp.zeros((256,), F32))
    with pytest.raises(ValueError, match=r"norm_dense: beta must be a float array of shape \(256,\)"):
        fused.norm_dense(x, g, w, norm="layernorm", beta=jnp.zeros((128,), F32))
    with pytest.raises(ValueError, match=r"layer_norm: beta must be a float array of shape \(256,\)"):
        fused.layer_norm(x, g, jnp.zeros((2, 256), F32))
    for bad in ("f8", jf.Scheme("blockwise"), 3):
        with pytest.raises(TypeError, match="norm_dense: recipe must be a Float8BlockScaling or MXFP8BlockScaling"):
            fused.norm_dense(x, g, w, recipe=bad)
        with pytest.raises(TypeError, match="norm_mlp: recipe"):
            fused.norm_mlp(x, g, w1, w2, recipe=bad)
    with pytest.raises(TypeError, match="norm_dense: x must be"):
        fused.norm_dense(jnp.zeros((4, 256), jnp.int32), g, w)
    with pytest.raises(ValueError, match="rms_norm: gamma"):
        fused.rms_norm(x, jnp.ones((128,), F32))


# ---- the unfused ops' gradients against float64 autodiff ------------------------------------------------
def _rms64(x, gamma, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def test_rms_norm_gradients_against_float64_autodiff():
    """fused.rms_norm's VJP (fp32, x fp32) against jax.grad of a float64 RMSNorm. Each quantity's error
    is propagated op by op (each fp32 op's rounding at most u of its value; sums of n terms gamma(n)
    of their magnitudes): rstd within E = gamma(c + 11) / 2 + 2u (test_producers' derivation), xhat
    = x * rstd within E + u; c = mean(dxhat * xhat) within (E + 3u + gamma(K)) mean|dxhat * xhat|;
    dx = rstd * (dxhat - xhat * c) absolutely, term by term; dgamma = sum over rows of dy * xhat within
    (E + 2u + gamma(R)) sum|dy * xhat|."""
    rng = np.random.default_rng(stable_seed("rms grad f64"))
    R, K, eps = 96, 1000, 1e-5
    x = (rng.standard_normal((R, K)) * 2.0 ** rng.integers(-6, 6, (R, 1))).astype(np.float32)
    gamma = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    dy = rng.standard_normal((R, K)).astype(np.float32)
    y, vjp = jax.vjp(lambda x, g: fused.rms_norm(x, g, eps), x, gamma)
    dx, dg = (np.asarray(v, np.float64) for v in vjp(dy))
    with jax.enable_x64(True):
        x64, g64, dy64 = (jnp.asarray(v, jnp.float64) for v in (x, gamma, dy))
        eps64 = float(np.float32(eps))
        dx64, dg64 = (np.asarray(v) for v in jax.vjp(lambda a, b: _rms64(a, b, eps64), x64, g64)[1](dy64))
    xd, gd, dyd = x.astype(np.float64), gamma.astype(np.float64), dy.astype(np.float64)
    rstd = 1 / np.sqrt(np.mean(xd * xd, -1, keepdims=True) + eps64)
    xhat, dxhat = xd * rstd, dyd * gd
    c = np.mean(dxhat * xhat, -1, keepdims=True)
    u = U32
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    E = gam(-(-K // 256) + 11) / 2 + 2 * u
    e_xhat = (E + u) * np.abs(xhat)
    e_dxhat = u * np.abs(dxhat)
    e_c = (E + 3 * u + gam(K)) * np.mean(np.abs(dxhat * xhat), -1, keepdims=True)
    e_t = np.abs(xhat) * e_c + np.abs(c) * e_xhat + u * np.abs(xhat * c)
    d = dxhat - xhat * c
    e_d = e_dxhat + e_t + u * np.abs(d)
    bound_dx = (rstd * e_d + E * rstd * np.abs(d) + u * np.abs(rstd * d)) * 1.001
    assert (np.abs(dx - dx64) <= bound_dx).all(), np.max(np.abs(dx - dx64) / bound_dx)
    bound_dg = (E + 2 * u + gam(R)) * np.sum(np.abs(dyd * xhat), 0) * 1.001
    assert (np.abs(dg - dg64) <= bound_dg).all(), np.max(np.abs(dg - dg64) / bound_dg)
    assert np.max(np.abs(dx - dx64) / bound_dx) > 1e-3  # the bound is not vacuous


def _ln64(x, gamma, beta, eps):
    m = jnp.mean(x, axis=-1, keepdims=True)
    return (x - m) / jnp.sqrt(jnp.mean((x - m) ** 2, axis=-1, keepdims=True) + eps) * gamma + beta


def test_layer_norm_gradients_against_float64_autodiff():
    """fused.layer_norm's VJP (fp32, x fp32) against jax.grad of a float64 LayerNorm, each quantity's error
    propagated op by op as in the RMSNorm test: the mean within dm = gamma(c + 8) mean|x| + 2u|mean|, rstd
    within E = (gamma(c + 14) + dm**2 / var) / 2 + 2u (test_producers' derivation), xhat = (x - mean) * rstd
    within dm * rstd + (E + 2u)|xhat|; c1 = mean(dxhat), c2 = mean(dxhat * xhat) within gamma(K) + u of
    their magnitudes plus their terms' errors; dx = rstd * (dxhat - c1 - xhat * c2) term by term; dgamma =
    sum over rows of dy * xhat, dbeta = sum of dy, within gamma(R) of their magnitudes plus the terms'."""
    rng = np.random.default_rng(stable_seed("ln grad f64"))
    R, K, eps = 96, 1000, 1e-5
    scale = 2.0 ** rng.integers(-6, 6, (R, 1))
    x = ((rng.standard_normal((R, K)) + rng.uniform(-3, 3, (R, 1))) * scale).astype(np.float32)
    gamma = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    beta = rng.standard_normal(K).astype(np.float32)
    dy = rng.standard_normal((R, K)).astype(np.float32)
    _, vjp = jax.vjp(lambda x, g, b: fused.layer_norm(x, g, b, eps), x, gamma, beta)
    dx, dg, db = (np.asarray(v, np.float64) for v in vjp(dy))
    with jax.enable_x64(True):
        args = [jnp.asarray(v, jnp.float64) for v in (x, gamma, beta, dy)]
        eps64 = float(np.float32(eps))
        vjp64 = jax.vjp(lambda a, b, c: _ln64(a, b, c, eps64), *args[:3])[1]
        dx64, dg64, db64 = (np.asarray(v) for v in vjp64(args[3]))
    xd, gd, dyd = x.astype(np.float64), gamma.astype(np.float64), dy.astype(np.float64)
    m = xd.mean(-1, keepdims=True)
    var = ((xd - m) ** 2).mean(-1, keepdims=True) + eps64
    rstd = 1 / np.sqrt(var)
    xhat, dxhat = (xd - m) * rstd, dyd * gd
    c1, c2 = dxhat.mean(-1, keepdims=True), (dxhat * xhat).mean(-1, keepdims=True)
    u = U32
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    c = -(-K // 256)
    dm = gam(c + 8) * np.abs(xd).mean(-1, keepdims=True) + 2 * u * np.abs(m)
    E = (gam(c + 14) + dm ** 2 / var) / 2 + 2 * u
    e_xhat = dm * rstd + (E + 2 * u) * np.abs(xhat)
    e_dxhat = u * np.abs(dxhat)
    e_c1 = (gam(K) + u) * np.abs(dxhat).mean(-1, keepdims=True) + e_dxhat.mean(-1, keepdims=True)
    e_p = np.abs(dxhat) * e_xhat + np.abs(xhat) * e_dxhat + u * np.abs(dxhat * xhat)
    e_c2 = (gam(K) + u) * np.abs(dxhat * xhat).mean(-1, keepdims=True) + e_p.mean(-1, keepdims=True)
    e_t = np.abs(xhat) * e_c2 + np.abs(c2) * e_xhat + u * np.abs(xhat * c2)
    d = dxhat - c1 - xhat * c2
    e_d = e_dxhat + e_c1 + e_t + 2 * u * (np.abs(dxhat - c1) + np.abs(d))
    bound_dx = (rstd * e_d + E * rstd * np.abs(d) + u * np.abs(rstd * d)) * 1.01
    assert (np.abs(dx - dx64) <= bound_dx).all(), np.max(np.abs(dx - dx64) / bound_dx)
    bound_dg = (np.sum(np.abs(dyd) * e_xhat, 0) + (u + gam(R)) * np.sum(np.abs(dyd * xhat), 0)) * 1.01
    assert (np.abs(dg - dg64) <= bound_dg).all(), np.max(np.abs(dg - dg64) / bound_dg)
    bound_db = gam(R) * np.sum(np.abs(dyd), 0) * 1.01
    assert (np.abs(db - db64) <= bound_db).all(), np.max(np.abs(db - db64) / bound_db)
    assert np.max(np.abs(dx - dx64) / bound_dx) > 1e-3  # the bound is not vacuous


def test_swiglu_gradient_against_float64_autodiff():
    """fused.swiglu's VJP (fp32) against jax.grad of silu(gate) * up in float64: d_up within 8u relative,
    d_gate within the absolute bound propagated through s(1 + g(1 - s)) (see test_producers), which
    allows for silu' vanishing near g = -1.28."""
    rng = np.random.default_rng(stable_seed("swiglu grad f64"))
    R, F = 64, 1000
    g = rng.standard_normal((R, F)) * 4
    g[0] = np.linspace(-1.4, -1.1, F)
    h = np.concatenate([g, rng.standard_normal((R, F)) * 2.0 ** rng.integers(-6, 6, (R, 1))], -1).astype(np.float32)
    da = rng.standard_normal((R, F)).astype(np.float32)
    out, vjp = jax.vjp(fused.swiglu, h)
    (dh,) = vjp(da)
    dh = np.asarray(dh, np.float64)
    with jax.enable_x64(True):
        def sw64(h):
            gg, uu = h[:, :F], h[:, F:]
            return gg * jax.nn.sigmoid(gg) * uu
        (dh64,) = jax.vjp(sw64, jnp.asarray(h, jnp.float64))[1](jnp.asarray(da, jnp.float64))
        dh64 = np.asarray(dh64)
    u = U32
    gd, ud, d = h[:, :F].astype(np.float64), h[:, F:].astype(np.float64), da.astype(np.float64)
    s = 1 / (1 + np.exp(-gd))
    t = gd * (1 - s)
    phi = s * (1 + t)
    e_s = 6 * u * s
    e_t = np.abs(gd) * (e_s + u * np.abs(1 - s)) + u * np.abs(t)
    e_phi = s * (e_t + u * np.abs(1 + t)) + np.abs(1 + t) * e_s + u * np.abs(phi)
    bound_gate = (np.abs(d * ud) * e_phi + 2 * u * np.abs(d * ud * phi)) * 1.001 + 4 * 2.0 ** -149
    bound_up = 8 * u * np.abs(d * gd * s) * 1.001 + 4 * 2.0 ** -149
    err_gate, err_up = np.abs(dh[:, :F] - dh64[:, :F]), np.abs(dh[:, F:] - dh64[:, F:])
    assert (err_gate <= bound_gate).all(), np.max(err_gate / bound_gate)
    assert (err_up <= bound_up).all(), np.max(err_up / bound_up)
    assert np.asarray(out).dtype == np.float32


def test_linen_mlp_takes_the_gelu_activation():
    """flax_utils.RMSNormMLP(activation="gelu"): an up projection of ``hidden`` columns (not 2 * hidden)
    and the bits of norm_mlp(..., activation="gelu") on its parameters; an unknown activation is refused."""
    from jax_fp8.flax_utils import RMSNormMLP

    x = jnp.asarray(np.random.default_rng(stable_seed("linen gelu")).standard_normal((2, 128, 256)), BF16)
    m = RMSNormMLP(hidden=384, features=128, activation="gelu")
    params = m.init(jax.random.key(0), x)["params"]
    assert params["gate_up"]["kernel"].shape == (256, 384) and params["down"]["kernel"].shape == (384, 128)
    y = jax.jit(m.apply)({"params": params}, x)
    want = fused.norm_mlp(x, params["norm"]["scale"], params["gate_up"]["kernel"], params["down"]["kernel"],
                          activation="gelu")
    assert y.shape == (2, 128, 128)
    assert_bits_equal(y, want, "y")
    with pytest.raises(ValueError, match="RMSNormMLP: activation must be one of"):
        RMSNormMLP(hidden=8, activation="relu").init(jax.random.key(0), x)


def test_linen_dense_takes_a_layernorm():
    """flax_utils.RMSNormDense(layernorm_type="layernorm"): nn.LayerNorm's parameters (scale and bias, or
    scale alone with use_bias=False) in the norm's scope, and the bits of norm_dense(norm="layernorm") on
    them; the decoder's default (RMSNorm) keeps scale alone; an unknown type is refused."""
    from jax_fp8.flax_utils import RMSNormDense

    x = jnp.asarray(np.random.default_rng(stable_seed("linen ln")).standard_normal((2, 128, 256)), BF16)
    for use_bias in (True, False):
        m = RMSNormDense(features=384, layernorm_type="layernorm", use_bias=use_bias,
                         bias_init=jax.nn.initializers.normal(1.0))
        params = m.init(jax.random.key(1), x)["params"]
        assert set(params["norm"]) == ({"scale", "bias"} if use_bias else {"scale"})
        y = jax.jit(m.apply)({"params": params}, x)
        want = fused.norm_dense(x, params["norm"]["scale"], params["dense"]["kernel"], norm="layernorm",
                                beta=params["norm"].get("bias"))
        assert_bits_equal(y, want, f"y use_bias={use_bias}")
    assert set(RMSNormDense(features=8).init(jax.random.key(0), x)["params"]["norm"]) == {"scale"}
    with pytest.raises(ValueError, match="RMSNormDense: layernorm_type must be one of"):
        RMSNormDense(features=8, layernorm_type="batchnorm").init(jax.random.key(0), x)
