"""``jf_produce_quantize`` (RMSNorm, SwiGLU, SwiGLU's gradient and a cast, fused with quantization):
the CPU kernel against its contract (``jax_fp8.producers.produce_quantize``) evaluated on NumPy inputs,
bit for bit; the contract's own properties against float64 math; its ``jax.numpy`` evaluation under
``jax.jit`` against NumPy's; the primitive under ``vmap``, under sharded ``jax.jit`` and inside
``jax.shard_map``; and its shape errors.

The sweep is generated: every row length of ``KS`` (each residue class against the 32- and 128-wide
blocks and the 256 lanes of the row sum of squares) meets every scheme and, across the schemes, every
row count of ``MS``, with the input, output and gamma dtypes cycled over the cases. Data is fresh per
case (``stable_seed`` of its parameters): normal rows over many binades, and zeros, subnormals, huge
values (1e20: x*x overflows fp32), +-inf and +-NaN planted at random positions, plus rows of tiny
values whose squares are subnormal.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import Scheme, ShardingWarning, producers
from jax_fp8.primitives import produce_p, produce_quantize_p
from jax_fp8.primitives.produce import ELEMENTWISE
from jax_fp8.quantization import produce_quantize
from jax_fp8.vma import axes_of
from helpers import IN_DTYPES, assert_bits_equal, random_input, stable_seed

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
E5M2 = jnp.float8_e5m2
_CPU = jax.devices("cpu")[0]
# the NumPy contract's final casts overflow to inf where the data says so (as intended)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
U32 = 2.0 ** -24  # fp32's unit roundoff
TINY = 2.0 ** -149  # fp32's smallest subnormal

PRODUCERS = producers.PRODUCERS
SCHEMES = {
    "f8-lhs": jf.Float8BlockScaling().scheme("lhs"),  # GEMM-ready 1x128 + 128x1 (transposed), E4M3
    "f8-grad-e5m2": jf.Float8BlockScaling(grad_dtype=E5M2).scheme("grad"),
    "f8-rhs": jf.Float8BlockScaling().scheme("rhs"),  # GEMM-ready 128x128 tiles, both orientations
    "f8-lhs-nopow2-eps": jf.Float8BlockScaling(pow2_scales=False, amax_epsilon=1e-3).scheme("lhs"),
    "compact-1x128": Scheme("blockwise", block=(1, 128), colwise=True),  # saturate_inf=True: TE's rule
    "compact-tiles": Scheme("blockwise", block=(128, 128)),  # one shared set of tiles
    "compact-colwise-e5m2": Scheme("blockwise", E5M2, rowwise=False, colwise=True, pow2_scales=False),
    "mx-lhs": jf.MXFP8BlockScaling().scheme("lhs"),  # 1x32 + 32x1, E8M0
    "mx-grad-e5m2": jf.MXFP8BlockScaling(grad_dtype=E5M2).scheme("grad"),
}
KS = (1, 31, 32, 100, 127, 128, 129, 255, 256, 257, 384, 512, 1000, 1024, 2048, 4096)  # 512..4096: common widths
MS = (1, 127, 128, 129, 300)
BS = (1, 2)
EPS = (1e-6, 0.0, 1e-5)


def _sweep():
    """(producer, scheme, B, M, K, in dtype, out dtype, gamma dtype, eps) cases. K is the row length of
    the producer's first input's half for SwiGLU (F), its full length otherwise."""
    cases = []
    for producer in PRODUCERS:
        for j, name in enumerate(SCHEMES):
            for i, K in enumerate(KS):
                n = j * len(KS) + i
                cases.append((producer, name, BS[(i + j // 5) % 2], MS[(i + j) % len(MS)], K,
                              IN_DTYPES[n % 3], IN_DTYPES[(n // 3) % 3], (F32, BF16)[(n // 9) % 2],
                              EPS[(n // 2) % 3]))
    return cases


CASES = _sweep()


def _case_id(c):
    producer, name, B, M, K, dt, out, gdt, eps = c
    dts = "-to-".join(jnp.dtype(d).name for d in (dt, out))
    return f"{producer}-{name}-{B}x{M}x{K}-{dts}-g{jnp.dtype(gdt).name}-eps{eps}"


def test_sweep_covers_every_combination():
    """The generated sweep meets each K with every M, each (in, out) dtype pair per producer, both B."""
    for producer in PRODUCERS:
        mine = [c for c in CASES if c[0] == producer]
        assert {(c[4], c[3]) for c in mine} == {(k, m) for k in KS for m in MS}
        assert {(jnp.dtype(c[5]), jnp.dtype(c[6])) for c in mine} == {(jnp.dtype(a), jnp.dtype(b))
                                                                     for a in IN_DTYPES for b in IN_DTYPES}
        assert {c[2] for c in mine} == set(BS) and {c[8] for c in mine} == set(EPS)


# ---- inputs --------------------------------------------------------------------------------------------
def _plant(rng, x2, values, cols=None):
    """Each of ``values`` at a random position of the 2-D ``x2`` (columns from ``cols`` if given)."""
    R, K = x2.shape
    for v in values:
        c = rng.integers(0, K) if cols is None else rng.choice(cols)
        x2[rng.integers(0, R), c] = v


def _values(rng, shape, dtype):
    """Rows over many binades; random_input's specials in about a quarter of the rows (a special poisons
    an RMSNorm row); each value below planted at least once (1e20: its square overflows fp32; fp16
    rounds it to inf); a row of tiny values (fp32 / bf16: squares subnormal in fp32; fp16: subnormal
    values) and an all-zero row."""
    dtype = jnp.dtype(dtype)
    clean = random_input(rng, shape, dtype, specials=False).astype(np.float32)
    dirty = random_input(rng, shape, dtype, specials=True).astype(np.float32)
    x = np.where((rng.random(shape[:-1]) < 0.25)[..., None], dirty, clean)
    x2 = x.reshape(-1, shape[-1])
    fi = jnp.finfo(dtype)
    if x2.shape[0] > 4:
        tiny = 1e-21 if dtype != jnp.dtype(F16) else float(fi.smallest_subnormal)
        x2[rng.integers(0, x2.shape[0])] = rng.standard_normal(shape[-1]) * tiny * (1 if tiny < 1e-10 else 40)
        x2[rng.integers(0, x2.shape[0])] = 0.0
    _plant(rng, x2, [1e20, -1e20, float(fi.max), np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0,
                     float(fi.smallest_subnormal), -3 * float(fi.smallest_subnormal), float(fi.tiny)])
    with np.errstate(over="ignore"):
        return x.astype(dtype)


#: gate values at the edges of the sigmoid: its flush (-126 ln 2 = -87.3365), exp's clamps (+-17, +-88),
#: float32 exp's own overflow and underflow limits, saturation
EXP_EDGES = [88.7228394, -88.7228394, 88.0, -88.0, 87.3, -87.3, -87.33654, -87.336555, -87.33656, 103.98, -103.98,
             100.0, -100.0, 1e4, -1e4, 17.0, -17.0, 16.99999, -16.99999, 20.0, -20.0, 1.0, -1.278]


def _gate_up(rng, shape, dtype):
    """SwiGLU's input (..., 2F): _values, with exp's edge values planted in the gate half."""
    h = _values(rng, shape, dtype).astype(np.float32)
    F = shape[-1] // 2
    _plant(rng, h.reshape(-1, shape[-1]), EXP_EDGES, cols=np.arange(F))
    with np.errstate(over="ignore"):
        return h.astype(dtype)


#: GELU inputs at its edges: the sigmoid's flush (x * (A + B x**2) = -87.34 near x = -5.3), the derivative's
#: clamp (+-20), x**3 overflowing float32 (|x| > 7e12), saturation
GELU_EDGES = [-5.3, -5.31, -5.2, -6.0, 20.0, -20.0, 19.99, 20.01, -20.01, 1e13, -1e13, 1e20, -1e20, 3.0, -3.0, 0.5]


def _gelu_x(rng, shape, dtype):
    """GELU's input: _values with more mass where GELU bends (N(0, 3)) and its edge values planted."""
    x = _values(rng, shape, dtype).astype(np.float32)
    x = np.where(rng.random(shape) < 0.5, (rng.standard_normal(shape) * 3).astype(np.float32), x)
    _plant(rng, x.reshape(-1, shape[-1]), GELU_EDGES)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _gamma(rng, K, dtype):
    g = (1 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    _plant(rng, g[None], [0.0, -2.0, 1e-40, 3.0])
    return g.astype(dtype)


def _inputs(rng, producer, B, M, K, dtype, gamma_dtype):
    if producer == "cast":
        return [_values(rng, (B, M, K), dtype)]
    if producer == "rmsnorm":
        return [_values(rng, (B, M, K), dtype), _gamma(rng, K, gamma_dtype)]
    if producer == "layernorm":  # beta: another gamma-like vector, shifted (zeros and sign changes planted)
        beta = (_gamma(rng, K, F32) - 1).astype(gamma_dtype)
        return [_values(rng, (B, M, K), dtype), _gamma(rng, K, gamma_dtype), beta]
    if producer == "swiglu":
        return [_gate_up(rng, (B, M, 2 * K), dtype)]
    if producer == "gelu":
        return [_gelu_x(rng, (B, M, K), dtype)]
    if producer == "gelu_grad":
        return [_values(rng, (B, M, K), dtype), _gelu_x(rng, (B, M, K), dtype)]
    return [_values(rng, (B, M, K), dtype), _gate_up(rng, (B, M, 2 * K), dtype)]  # swiglu_grad: da, h


def _bind(producer, scheme, eps=1e-6, out_dtype=BF16):
    params = dict(producer=producer, scheme=scheme, eps=float(eps), out_dtype=jnp.dtype(out_dtype))
    return (lambda *a: produce_quantize_p.bind(*a, **params)), params


def _assert_same_nan_class(g, w, what):
    """Bits equal, except that a NaN matches a NaN of any sign or payload (RMSNorm's rstd: see
    test_rstd_nan_sign_matches_contract)."""
    g, w = np.asarray(g), np.asarray(w)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    np.testing.assert_array_equal(nan_g, nan_w, err_msg=f"{what}: NaN positions")
    assert_bits_equal(np.where(nan_g, np.float32(np.nan), g), np.where(nan_w, np.float32(np.nan), w), what)


def _assert_outputs_equal(got, want, what="", rstd=False):
    """Every output bit for bit (``rstd``: the last one, RMSNorm's rstd, up to its NaNs' signs)."""
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        assert g.dtype == np.asarray(w).dtype and g.shape == np.shape(w), (what, i, g.dtype, np.asarray(w).dtype,
                                                                           g.shape, np.shape(w))
        if rstd and i == len(got) - 1:
            _assert_same_nan_class(g, w, f"{what} rstd")
        else:
            assert_bits_equal(g, w, f"{what} output {i}")


# ---- 1. the kernel against the contract, bit for bit ---------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_contract(case):
    producer, name, B, M, K, dtype, out_dtype, gamma_dtype, eps = case
    rng = np.random.default_rng(stable_seed("produce kernel", case))
    args = _inputs(rng, producer, B, M, K, dtype, gamma_dtype)
    scheme = SCHEMES[name]
    fn, params = _bind(producer, scheme, eps, out_dtype)
    got = jax.jit(fn)(*args)
    want = producers.produce_quantize(*args, **params)  # NumPy: IEEE subnormals
    norm = producer in producers.NORMS
    assert len(want) == 2 * len(scheme.kernel_usages) + norm
    _assert_outputs_equal(got, want, _case_id(case), rstd=norm)
    if norm:
        assert np.asarray(got[-1]).shape == producers.stats_shape(producer, (B, M))
    # the data is not degenerate: most FP8 bytes of the first output are nonzero
    data = np.asarray(want[0])
    if data.size >= 4096:
        assert np.count_nonzero(data) > data.size // 2, (np.count_nonzero(data), data.size)


#: Widths that pick the fused CUDA kernels' code paths: whole vectors or not, whole tiles or partial ones (and
#: for SwiGLU's gradient, whose K is 2F, F a multiple of 128 or not)
FUSED_KS = (64, 100, 128, 200, 256, 384, 1000, 1024, 2176)
FUSED_CASES = [(producer, K, MS[(i + j) % len(MS)], ("f8-lhs", "f8-grad-e5m2")[(i + j) % 2])
               for i, producer in enumerate(p for p in PRODUCERS if p != "cast") for j, K in enumerate(FUSED_KS)]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{c[0]}-K{c[1]}-M{c[2]}-{c[3]}")
def test_fused_kernel_inputs_match_contract(case):
    """What the fused CUDA kernels take (bfloat16 in and out, GEMM-ready 1x128 blocks), over widths that
    pick their code paths, two matrices: bit for bit the contract (on the CPU, the CPU kernel)."""
    producer, K, M, name = case
    rng = np.random.default_rng(stable_seed("fused kernel", case))
    args = _inputs(rng, producer, 2, M, K, BF16, BF16)
    fn, params = _bind(producer, SCHEMES[name], 1e-6, BF16)
    want = producers.produce_quantize(*args, **params)
    _assert_outputs_equal(jax.jit(fn)(*args), want, str(case), rstd=producer in producers.NORMS)


@pytest.mark.parametrize("case", CASES[::9], ids=_case_id)
def test_produce_kernel_matches_contract(case):
    """jf_produce (the producer alone: the unfused ops, and what the fused CUDA kernels do not take) against
    producers.produce_values on NumPy, bit for bit: the produced tensor in its dtype, NaNs canonical, and
    a norm's statistics."""
    producer, _, B, M, K, dtype, out_dtype, gamma_dtype, eps = case
    rng = np.random.default_rng(stable_seed("produce values", case))
    args = _inputs(rng, producer, B, M, K, dtype, gamma_dtype)
    params = dict(producer=producer, eps=float(eps), out_dtype=jnp.dtype(out_dtype))
    got = jax.jit(lambda *a: produce_p.bind(*a, **params))(*args)
    want = producers.produce_values(*args, **params)
    assert len(got) == len(want) == (2 if producer in producers.NORMS else 1)
    assert np.asarray(got[0]).dtype == jnp.dtype(out_dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g, w, f"{_case_id(case)} output {i}")


@pytest.mark.parametrize("producer", ["swiglu", "swiglu_grad"])
def test_every_bfloat16_gate(producer):
    """Every one of the 65536 bfloat16 gates (the sigmoid's whole input domain in bfloat16) through this
    platform's kernels against the NumPy contract, bit for bit: the fused kernel in the recipe's scheme (the
    one the fused layers run), and jf_produce with float32 output (the sigmoid's bits unrounded)."""
    rng = np.random.default_rng(stable_seed("every bf16 gate", producer))
    gate = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16).reshape(1, 512, 128)
    up = rng.standard_normal((1, 512, 128)).astype(np.float32).astype(BF16)
    h = np.concatenate([np.asarray(gate), up], axis=-1)
    args = (h,) if producer == "swiglu" else (rng.standard_normal((1, 512, 128)).astype(np.float32).astype(BF16), h)
    fn, params = _bind(producer, jf.Float8BlockScaling().scheme("lhs"), 0.0, BF16)
    _assert_outputs_equal(jax.jit(fn)(*args), producers.produce_quantize(*args, **params), producer)
    values = dict(producer=producer, eps=0.0, out_dtype=jnp.dtype(F32))
    got = jax.jit(lambda *a: produce_p.bind(*a, **values))(*args)
    assert_bits_equal(got[0], producers.produce_values(*args, **values)[0], f"{producer} values")


def _cuda_module_text(fn, *args):
    """``fn``'s module as jax lowers it for CUDA (no GPU needed; our custom calls exported unchecked)."""
    from jax import export

    ok = [export.DisabledSafetyCheck.custom_call(t) for t in ("jf_produce", "jf_produce_quantize", "jf_quantize")]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=ok)(*args).mlir_module()


@pytest.mark.skipif(not jf._ffi.AVAILABLE["cuda"], reason="the CUDA module is not built here")
@pytest.mark.parametrize("name", list(SCHEMES))
def test_cuda_lowering_fused_where_the_kernels_take_it(name):
    """On CUDA a call runs as the fused kernel where it takes it (the fused layers' schemes), else as
    jf_produce then jf_quantize: the same bits, never the jax.numpy contract (XLA's GPU arithmetic is
    not NumPy's)."""
    from jax_fp8.primitives.produce import fused_kernel_takes

    for dtype in (F32, BF16):
        x = np.ones((1, 256, 256), dtype)
        for producer, args in (("cast", (x,)), ("swiglu", (x,)), ("rmsnorm", (x, np.ones(256, np.float32))),
                               ("layernorm", (x, np.ones(256, np.float32), np.zeros(256, BF16))),
                               ("swiglu_grad", (x[..., :128], x))):
            fn, params = _bind(producer, SCHEMES[name], 1e-6, BF16)
            text = _cuda_module_text(fn, *args)
            fused = fused_kernel_takes(params, [a.dtype for a in args])
            assert ("custom_call @jf_produce_quantize" in text) == fused, (name, producer)
            assert ("custom_call @jf_produce(" in text) == (not fused), (name, producer)
            assert ("custom_call @jf_quantize(" in text) == (not fused), (name, producer)
    recipe = jf.Float8BlockScaling()
    for producer, scheme, dtype, want in (("swiglu", "lhs", BF16, True), ("swiglu", "lhs", F32, False),
                                          ("cast", "rhs", F32, True), ("cast", "rhs", BF16, False)):
        params = dict(producer=producer, scheme=recipe.scheme(scheme), eps=0.0, out_dtype=jnp.dtype(BF16))
        assert fused_kernel_takes(params, [jnp.dtype(dtype)]) == want, (producer, dtype)
    assert fused_kernel_takes(dict(params, producer="rmsnorm", scheme=recipe.scheme("lhs")), [BF16, F32])


@pytest.mark.parametrize("producer", ["swiglu", "swiglu_grad", "rmsnorm", "layernorm", "gelu", "gelu_grad"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_scales_expose_every_produced_value(producer, dtype):
    """FP8 data hides a produced value's last bits, but a non-power-of-2 scale is computed from its
    block's amax: with one nonzero produced value per 1x128 block (SwiGLU: one nonzero up or da per block,
    RMSNorm: one nonzero gamma), every value's fp32 bits reach an output, so the kernel's SwiGLU (its
    exp), SwiGLU's gradient and RMSNorm values are checked to the last bit, over gates from exp's
    underflow to its overflow."""
    rng = np.random.default_rng(stable_seed("exposed", producer, dtype))
    scheme = Scheme("blockwise", block=(1, 128), pow2_scales=False)
    B, M, F = 2, 256, 1024
    one = np.zeros((B, M, F), np.float32)
    cols = np.arange(0, F, 128) + rng.integers(0, 128, (B, M, F // 128))
    np.put_along_axis(one, cols, rng.standard_normal((B, M, F // 128)) * 2.0 ** rng.integers(-10, 10, (B, M, 1)), -1)
    gate = np.where(rng.random((B, M, F)) < 0.5, rng.uniform(-110, 110, (B, M, F)), rng.standard_normal((B, M, F)) * 4)
    full = rng.standard_normal((B, M, F)) * 2.0 ** rng.integers(-10, 10, (B, M, 1))
    if producer == "swiglu":
        args = [np.concatenate([gate, one], -1)]
    elif producer == "swiglu_grad":
        args = [one, np.concatenate([gate, full], -1)]
    elif producer == "gelu":  # gelu(0) = 0: one nonzero x per block, from the sigmoid's flush to saturation
        args = [one * 0 + np.where(one != 0, gate / 8, 0)]
    elif producer == "gelu_grad":
        args = [one, gate / 8]
    else:  # the norms: one nonzero gamma per block (beta 0)
        args = [full, one[0, 0]] + ([np.zeros(F)] if producer == "layernorm" else [])
    dt = (dtype, F32, F32) if producer in producers.NORMS else (dtype,) * len(args)
    with np.errstate(over="ignore"):
        args = [np.asarray(a, np.float32).astype(d) for a, d in zip(args, dt)]
    fn, params = _bind(producer, scheme, 1e-6, F32)
    got = jax.jit(fn)(*args)
    want = producers.produce_quantize(*args, **params)
    _assert_outputs_equal(got, want, f"{producer} {jnp.dtype(dtype).name}", rstd=producer in producers.NORMS)
    si = np.asarray(want[1])
    assert np.mean((si != 1) & np.isfinite(si)) > 0.7  # most blocks hold a nonzero value that sets their scale


def test_quantization_wrapper_takes_nd_inputs():
    """quantization.produce_quantize views (..., cols) inputs as rows: its tensor's fields are the
    primitive's outputs of the (1, rows, cols) view, rstd has x's leading dims."""
    rng = np.random.default_rng(stable_seed("wrapper nd"))
    scheme = SCHEMES["f8-lhs"]
    x = _values(rng, (3, 50, 200), BF16)
    g = _gamma(rng, 200, F32)
    q, (rstd,) = jax.jit(lambda x, g: produce_quantize("rmsnorm", x, g, scheme=scheme, eps=1e-5))(x, g)
    assert q.shape == (3, 50, 200) and q.dtype == jnp.bfloat16 and rstd.shape == (3, 50)
    want = producers.produce_quantize(x.reshape(1, 150, 200), g, producer="rmsnorm", scheme=scheme, eps=1e-5,
                                      out_dtype=jnp.dtype(BF16))
    assert_bits_equal(q.rowwise_data.reshape(1, 150, 200), want[0], "rowwise data")
    assert_bits_equal(q.rowwise_scale_inv, want[1][0], "rowwise scales")
    assert_bits_equal(q.colwise_data.reshape(1, 200, 150), want[2], "colwise data")
    assert_bits_equal(q.colwise_scale_inv, want[3][0], "colwise scales")
    assert_bits_equal(rstd.reshape(1, 150), want[4], "rstd")
    # SwiGLU's gradient: the produced dtype is h's (its last input's) unless out_dtype says otherwise
    da, h = _values(rng, (2, 40, 64), F32), _gate_up(rng, (2, 40, 128), BF16)
    q, extra = produce_quantize("swiglu_grad", da, h, scheme=scheme)
    assert q.dtype == jnp.bfloat16 and q.shape == (2, 40, 128) and extra == []


def test_rstd_nan_sign_matches_contract():
    """A row [NaN, -NaN]: its rstd is NaN; the kernel's and the contract's must be the same bits."""
    x = np.array([[[np.nan, -np.nan]], [[-np.nan, np.nan]]], np.float32)
    fn, params = _bind("rmsnorm", SCHEMES["compact-1x128"], 1e-6, F32)
    got = jax.jit(fn)(x, np.ones(2, np.float32))
    want = producers.produce_quantize(x, np.ones(2, np.float32), **params)
    _assert_outputs_equal(got[:-1], want[:-1], "data")  # the FP8 data and scales agree
    assert_bits_equal(got[-1], want[-1], "rstd")


# ---- 2. the contract's properties against float64 ------------------------------------------------------
def _ulp32(v):
    """The spacing of fp32 at |v| (float64 ``v``), subnormal spacing below the normal range."""
    with np.errstate(over="ignore"):
        a = np.abs(v).astype(np.float32)
    return np.spacing(np.where(np.isfinite(a), a, np.float32(3e38))).astype(np.float64)


def test_exp_within_two_ulp_on_its_domain():
    rng = np.random.default_rng(stable_seed("exp"))
    f32 = np.float32
    lo, hi = producers.EXP_DOMAIN
    x = np.concatenate([
        rng.uniform(lo, hi, 1_000_000).astype(f32),
        rng.uniform(-1, 1, 100_000).astype(f32),
        np.arange(-136, 704, dtype=np.int32).astype(f32) / f32(8),  # many reductions' boundaries
        # every fp32 within 4096 ulp inside both ends
        (hi.view(np.int32) - np.arange(4096)).astype(np.int32).view(f32),
        (lo.view(np.int32) - np.arange(4096)).astype(np.int32).view(f32),
        np.array([0.0, -0.0, lo, hi], f32),
    ])
    y = producers.exp_f32(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    true = np.exp(x.astype(np.float64))
    assert (y >= np.finfo(f32).tiny).all() and np.isfinite(y).all()  # normal on the whole domain
    err = np.abs(y.astype(np.float64) - true) / _ulp32(true)
    assert err.max() <= 2.0, (err.max(), x[np.argmax(err)])
    assert producers.exp_f32(np.array([0.0], f32))[0] == 1.0


def test_sigmoid_clamps_change_nothing_but_flush_below_the_normal_range():
    """sigmoid_f32 against float64: within 6u (exp's 2 ulp, then 1 + e and 1 / d) wherever the true value
    is normal, exactly 1 where 1 + e**-g rounds to 1 (g >= 17: the clamp at -17 changes nothing), 0 where
    the quotient would be below 2**-126 (g <= -126 ln 2, the flush); every fp32 around both boundaries;
    NaN gives 1, -inf 0, inf 1."""
    rng = np.random.default_rng(stable_seed("sigmoid"))
    f32 = np.float32
    edge = f32(-126 * np.log(2))
    g = np.concatenate([
        rng.uniform(-120, 120, 1_000_000).astype(f32),
        (edge.view(np.int32) + np.arange(-2048, 2048)).astype(np.int32).view(f32),
        (f32(17).view(np.int32) + np.arange(-2048, 2048)).astype(np.int32).view(f32),
        np.array([0.0, -0.0, 1e30, -1e30, np.finfo(f32).max, -np.finfo(f32).max], f32),
    ])
    s = producers.sigmoid_f32(g)
    with np.errstate(over="ignore"):
        true = 1 / (1 + np.exp(-g.astype(np.float64)))
    normal = true >= 2.0 ** -126
    rel = np.abs(s[normal].astype(np.float64) - true[normal]) / true[normal]
    assert rel.max() <= 6 * U32, rel.max() / U32
    assert (s[g >= 17] == 1).all() and (s[g < f32(-87.34)] == 0).all()
    assert (s[~normal] == 0).all() and not np.signbit(s[~normal]).any()
    assert (~normal).sum() > 1000 and (normal & (true < 2.0 ** -125)).sum() > 100  # both sides of the flush
    np.testing.assert_array_equal(producers.sigmoid_f32(np.array([np.nan, -np.inf, np.inf], f32)), [1, 0, 1])


def _rms_inputs(rng, R, K, dtype=F32):
    """Normal-range rows: no overflow of x*x, no subnormal square or result."""
    mags = 2.0 ** rng.integers(-20, 20, size=(R, 1))
    x = (rng.uniform(0.5, 2, (R, K)) * rng.choice([-1, 1], (R, K)) * mags).astype(np.float32)
    return x.astype(dtype)


@pytest.mark.parametrize("K", KS)
def test_layer_norm_within_derived_bound(K):
    """LayerNorm's fp32 statistics and values against float64. The mean's sum of K terms of either sign,
    through ceil(K/256) - 1 lane additions and the 8 tree levels: within gamma(c + 8) * sum|x|, then the
    mean's 2 roundings. The centred sum of squares: each (x - mean) one rounding and its square one (so
    3u relative per term), the sum gamma(c + 8), times fp32(1/K) 2 and + eps 1 more, and the mean's own
    error dm adds K dm**2 (the centred terms sum to 0): the variance within (c + 14)u relative + dm**2 /
    var; the sqrt halves it and rounds, 1 / rounds. The values ((x - mean) * rstd) * gamma + beta: each
    op one rounding on top of the inputs' errors, absolutely."""
    rng = np.random.default_rng(stable_seed("layer norm bound", K))
    R = 64
    scale = 2.0 ** rng.integers(-20, 20, (R, 1))  # per row; its mean up to 3 of its spreads from 0
    x = ((rng.standard_normal((R, K)) + rng.uniform(-3, 3, (R, 1))) * scale).astype(np.float32)
    gamma = (rng.uniform(0.25, 4, K) * rng.choice([-1, 1], K)).astype(np.float32)
    beta = rng.standard_normal(K).astype(np.float32)
    x64, c = x.astype(np.float64), -(-K // producers.SUM_LANES)
    g_n = lambda n: n * U32 / (1 - n * U32)  # noqa: E731
    for eps in (1e-6, 0.0, 0.5) if K > 1 else (1e-6, 0.5):  # (K = 1, eps = 0: variance 0, rstd inf)
        mean, rstd = producers.layer_norm_stats(x, eps)
        vals = producers.layer_norm_values(x, gamma, beta, mean, rstd)
        assert mean.dtype == rstd.dtype == vals.dtype == np.float32
        m64 = x64.mean(-1)
        var64 = ((x64 - m64[:, None]) ** 2).mean(-1) + float(np.float32(eps))
        dm = (g_n(c + 8) * np.abs(x64).sum(-1) / K + 2 * U32 * np.abs(m64)) * (1 + 1e-6)
        assert (np.abs(mean - m64) <= dm).all(), np.max(np.abs(mean - m64) / dm)
        rel_var = g_n(c + 14) + K * dm ** 2 / var64 / K
        bound_rstd = (rel_var / 2 + 2 * U32) * (1 + 1e-3)
        r64 = 1 / np.sqrt(var64)
        rel = np.abs(rstd - r64) / r64
        assert (rel <= bound_rstd).all(), np.max(rel / bound_rstd)
        want = (x64 - m64[:, None]) * r64[:, None] * gamma + beta
        t = np.abs(x64 - m64[:, None])  # the centred value's error: dm, then its rounding
        e_c = dm[:, None] + U32 * t
        e_n = (e_c * r64[:, None] + t * r64[:, None] * bound_rstd[:, None]) * (1 + 1e-6) + U32 * t * r64[:, None]
        e_g = e_n * np.abs(gamma) + U32 * np.abs(want - beta)
        bound = (e_g + U32 * np.abs(want)) * (1 + 1e-4) + 4 * TINY
        err = np.abs(vals - want)
        assert (err <= bound).all(), np.max(err / bound)
        assert K == 1 or np.max(err / bound) > 0.01  # (K = 1: x - mean is 0, every value beta exactly)


@pytest.mark.parametrize("K", KS)
def test_rms_norm_within_derived_bound(K):
    """RMSNorm's fp32 values against float64 math. Each square rounds once and reaches the total through
    ceil(K/256) - 1 lane additions and the 8 levels of the tree: the sum of these non-negative terms
    has a relative error at most gamma(c + 8), c = ceil(K/256); the mean (times fp32(1/K): 2 roundings)
    and + eps add 3, so gamma(c + 11); the sqrt halves it and rounds, 1 / rounds: rstd within
    gamma(c + 11) / 2 + 2u; the output's two products add 2u."""
    rng = np.random.default_rng(stable_seed("rms bound", K))
    R = 64
    x = _rms_inputs(rng, R, K)
    gamma = (rng.uniform(0.25, 4, K) * rng.choice([-1, 1], K)).astype(np.float32)
    for eps in (1e-6, 0.0, 0.5):
        rstd = producers.rms_norm_rstd(x, eps)
        vals = producers.rms_norm_values(x, gamma, rstd)
        assert rstd.dtype == vals.dtype == np.float32
        x64, eps64 = x.astype(np.float64), float(np.float32(eps))
        rstd64 = 1 / np.sqrt(np.mean(x64 * x64, axis=-1) + eps64)
        c = -(-K // producers.SUM_LANES)
        n = c + 11
        g_n = n * U32 / (1 - n * U32)
        bound_rstd = (g_n / 2 + 2 * U32) * (1 + 1e-3)  # 1e-3: the second-order terms
        rel = np.abs(rstd.astype(np.float64) - rstd64) / rstd64
        assert rel.max() <= bound_rstd, (eps, rel.max() / U32, bound_rstd / U32)
        want = x64 * rstd64[:, None] * gamma.astype(np.float64)
        rel = np.abs(vals.astype(np.float64) - want) / np.abs(want)
        assert rel.max() <= bound_rstd + 2.0001 * U32, (eps, rel.max() / U32)
        # rounded to a 16-bit dtype (inputs and outputs in its normal range): within half its ulp more
        for dt in (BF16, F16):
            xd = (rng.uniform(0.5, 2, (R, K)) * rng.choice([-1, 1], (R, K)) * 2.0 ** rng.integers(-4, 4, (R, 1)))
            xd = xd.astype(np.float32).astype(dt)
            y, _ = producers.rms_norm(xd, gamma, eps)
            assert y.dtype == jnp.dtype(dt)
            x64 = xd.astype(np.float64)
            w = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps64) * gamma.astype(np.float64)
            normal = np.abs(w) >= float(jnp.finfo(dt).tiny)
            assert normal.all()
            half_ulp = 2.0 ** -(jnp.finfo(dt).nmant + 1)
            rel = np.abs(y.astype(np.float64) - w)[normal] / np.abs(w[normal])
            assert rel.max() <= (bound_rstd + 2.0001 * U32) * (1 + half_ulp) + half_ulp, (dt, rel.max())


def _swiglu_data(rng, R, F):
    """Gates whose exp(-g) is normal (|g| < 87), ups over several binades."""
    g = rng.uniform(-86, 86, (R, F))
    g[:, : F // 2] = rng.standard_normal((R, F // 2)) * 4  # most where silu is curved
    u = rng.standard_normal((R, F)) * 2.0 ** rng.integers(-8, 8, (R, 1))
    return np.concatenate([g, u], axis=-1).astype(np.float32), rng.standard_normal((R, F)).astype(np.float32)


def test_swiglu_within_derived_bound():
    """silu(g) * up: exp within 2 ulp (<= 4u relative); 1 + e of positive terms adds u; 1 / adds u; then
    g * s and * up one rounding each: 8u relative, plus the few absolute 2**-149 of subnormal results
    (NumPy rounds them absolutely)."""
    rng = np.random.default_rng(stable_seed("swiglu bound"))
    h, _ = _swiglu_data(rng, 64, 1000)
    F = 1000
    y = producers.swiglu_values(h)
    g, u = h[:, :F].astype(np.float64), h[:, F:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    err = np.abs(y.astype(np.float64) - want)
    bound = 8 * U32 * (1 + 1e-6) * np.abs(want) + 4 * TINY
    assert (err <= bound).all(), np.max(err / bound)
    assert np.max(err / bound) > 0.01  # a bound that is met with room to spare is no test


def test_swiglu_grad_within_derived_bound():
    """d_up = da * (g * s): 6u for s (as above) + 2 roundings: 8u relative. d_gate = (da * up) * (s * (1 +
    g * (1 - s))) vanishes near g = -1.28, where no relative bound holds: the bound is absolute,
    propagated through each op from |err(s)| <= 6u s (each op's rounding at most u of its value)."""
    rng = np.random.default_rng(stable_seed("swiglu grad bound"))
    F = 1000
    h, da = _swiglu_data(rng, 64, F)
    h[0, :F] = np.linspace(-1.4, -1.1, F, dtype=np.float32)  # around silu's stationary point
    out = producers.swiglu_grad(da, h, np.float32)
    d_gate, d_up = out[:, :F].astype(np.float64), out[:, F:].astype(np.float64)
    g, u, d = h[:, :F].astype(np.float64), h[:, F:].astype(np.float64), da.astype(np.float64)
    s = 1 / (1 + np.exp(-g))
    want_up = d * g * s
    assert (np.abs(d_up - want_up) <= 8 * U32 * (1 + 1e-6) * np.abs(want_up) + 4 * TINY).all()
    t = g * (1 - s)
    phi = s * (1 + t)
    e_s = 6 * U32 * s
    e_1ms = e_s + U32 * np.abs(1 - s)
    e_t = np.abs(g) * e_1ms + U32 * np.abs(t)
    e_1pt = e_t + U32 * np.abs(1 + t)
    e_phi = s * e_1pt + np.abs(1 + t) * e_s + U32 * np.abs(phi)
    want_gate = d * u * phi
    bound = (np.abs(d * u) * e_phi + 2 * U32 * np.abs(want_gate)) * (1 + 1e-4) + 4 * TINY
    err = np.abs(d_gate - want_gate)
    assert (err <= bound).all(), np.max(err / bound)
    # near the stationary point a relative bound fails (the absolute one above holds there)
    assert np.max(err[0] / np.abs(want_gate[0])) > 100 * U32


def _gelu64(x):
    """GELU's tanh form and its derivative in float64, with the sigmoid argument u = 2z."""
    x = x.astype(np.float64)
    a = 2 * np.sqrt(2 / np.pi)
    u = x * (a + 0.044715 * a * x * x)
    s = 1 / (1 + np.exp(-u))
    return x * s, s + x * s * (1 - s) * (a + 3 * 0.044715 * a * x * x), u, s


def test_gelu_within_derived_bound():
    """x * sigmoid(u), u = x (A + (B x) x): u within 6u relative (A and B rounded to float32, 4 roundings),
    which moves s by (1 - s) |u| times that; the sigmoid's own 6u; the product one rounding. Against
    float64 where the sigmoid is normal; 0 where it flushes (x below about -5.3)."""
    rng = np.random.default_rng(stable_seed("gelu bound"))
    x = np.concatenate([rng.standard_normal(500_000) * 3, rng.uniform(-5.2, 12, 500_000)]).astype(np.float32)
    y = producers.gelu_values(x)
    want, _, u, s = _gelu64(x)
    bound = (7 + 6 * (1 - s) * np.abs(u)) * U32 * (1 + 1e-6) * np.abs(want) + 4 * TINY
    err = np.abs(y.astype(np.float64) - want)
    normal = s >= 2.0 ** -125  # the sigmoid flushes below 2**-126
    assert (err <= bound)[normal].all(), np.max((err / bound)[normal])
    assert np.max((err / bound)[normal]) > 0.01
    assert (y[s < 2.0 ** -127] == 0).all() and (s < 2.0 ** -127).sum() > 100
    # jax.nn.gelu's tanh form: the same function (its float32 0.5 x (1 + tanh z) cancels for x < 0)
    ref = np.asarray(jax.nn.gelu(x, approximate=True)).astype(np.float64)
    assert (np.abs(ref - want) <= 1e-5 * np.abs(want) + 1e-6).all()


def test_gelu_grad_within_derived_bound():
    """da * (s + (x * (s (1 - s))) * (A + (3B c) c)): absolute, propagated through each op from the
    sigmoid's error as in test_gelu_within_derived_bound (each op's rounding at most u of its value;
    A + (3B c) c within 4u). The derivative vanishes near x = -0.75, where no relative bound holds."""
    rng = np.random.default_rng(stable_seed("gelu grad bound"))
    x = np.concatenate([rng.standard_normal(300_000) * 3, rng.uniform(-5.2, 25, 300_000),
                        np.linspace(-0.9, -0.6, 10_000)]).astype(np.float32)
    da = rng.standard_normal(x.shape).astype(np.float32)
    got = producers.gelu_grad(da, x, np.float32).astype(np.float64)
    _, dg, u, s = _gelu64(x)
    x64, d = x.astype(np.float64), da.astype(np.float64)
    a = 2 * np.sqrt(2 / np.pi)
    du = a + 3 * 0.044715 * a * np.clip(x64, -20, 20) ** 2
    e_s = (6 + 6 * (1 - s) * np.abs(u)) * U32 * s
    e_1ms = e_s + U32 * (1 - s)
    ds = s * (1 - s)
    e_ds = s * e_1ms + (1 - s) * e_s + U32 * ds
    e_xds = np.abs(x64) * e_ds + U32 * np.abs(x64 * ds)
    t = x64 * ds * du
    e_t = du * e_xds + np.abs(x64 * ds) * 4 * U32 * du + U32 * np.abs(t)
    e_g = e_s + e_t + U32 * np.abs(s + t)
    bound = (np.abs(d) * e_g + U32 * np.abs(d * dg)) * (1 + 1e-4) + 4 * TINY
    err = np.abs(got - d * dg)
    normal = s >= 2.0 ** -125  # the sigmoid flushes below 2**-126: there the gradient is 0
    assert (err <= bound)[normal].all(), np.max((err / bound)[normal])
    assert np.max((err / bound)[normal]) > 0.01
    assert (got[s < 2.0 ** -127] == 0).all() and (s < 2.0 ** -127).sum() > 100
    # jax's own gradient of its tanh-form GELU: the same derivative
    ref = np.asarray(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)).astype(np.float64)
    assert (np.abs(ref - dg) <= 1e-4 * np.abs(dg) + 1e-5).all()  # (jax's float32 cancels for x < 0)


def _sum_squares_by_hand(x2):
    """The documented order, written out: lane v adds the squares of elements v, v + 256, ... in order
    (fp32, one rounding per square and per addition), then lane v += lane v ^ half for half = 128 .. 1."""
    x2 = x2.astype(np.float32)
    R, K = x2.shape
    lanes = np.zeros((R, 256), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(K):
            sq = x2[:, i] * x2[:, i]
            lanes[:, i % 256] = lanes[:, i % 256] + sq
        half = 128
        while half >= 1:
            new = lanes.copy()
            for v in range(half):
                new[:, v] = lanes[:, v] + lanes[:, v ^ half]
            lanes = new
            half //= 2
    return lanes[:, 0]


def test_row_sum_squares_is_the_documented_order():
    """producers.row_sum_squares, and the kernel's rstd, equal the documented order written as a loop,
    bit for bit, with subnormal squares, overflow, inf and NaN; a plain np.sum differs (the test can
    tell orders apart)."""
    naive_differs = 0
    for K in KS:
        rng = np.random.default_rng(stable_seed("sum squares", K))
        x = _values(rng, (1, 40, K), F32)
        x2 = x[0]
        x2[3] = (rng.standard_normal(K) * 1e-22).astype(np.float32)  # squares subnormal
        x2[5] = rng.standard_normal(K).astype(np.float32) * np.float32(2e18)  # partial sums near overflow
        mine = _sum_squares_by_hand(x2)
        with np.errstate(over="ignore", invalid="ignore"):
            assert_bits_equal(producers.row_sum_squares(x2), mine, f"K={K}")
            naive = np.sum(x2 * x2, axis=-1, dtype=np.float32)
        naive_differs += int((naive.view(np.uint32) != mine.view(np.uint32)).sum())
        for eps in (1e-6, 0.0):
            inv_k = np.float32(1.0 / K)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                rstd = np.float32(1) / np.sqrt(mine * inv_k + np.float32(eps))
            fn, _ = _bind("rmsnorm", SCHEMES["compact-1x128"], eps, F32)
            got = jax.jit(fn)(x, np.ones(K, np.float32))
            _assert_same_nan_class(got[-1][0], rstd, f"kernel rstd K={K} eps={eps}")
    assert naive_differs > 0


# ---- 3. the jax.numpy contract under jax.jit gives NumPy's bits ----------------------------------------
def _normal_range(rng, shape, dtype):
    """Values in [2**-8, 2**8) in magnitude, signs random: no subnormal intermediate or result."""
    v = rng.uniform(1, 2, shape) * 2.0 ** rng.integers(-8, 8, shape) * rng.choice([-1, 1], shape)
    return v.astype(np.float32).astype(dtype)


@pytest.fixture
def on_cpu():
    """The jax.numpy contract's exactness under jit is XLA:CPU's, where it runs when no kernel does: XLA's
    GPU compiler rounds float32 division and sqrt otherwise than IEEE (on CUDA the producers always run
    on our kernels)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_jnp_contract_under_jit_matches_numpy(producer, dtype, on_cpu):
    rng = np.random.default_rng(stable_seed("jnp contract", producer, dtype))
    B, M, K = 2, 64, 1000
    if producer == "rmsnorm":
        args = [_normal_range(rng, (B, M, K), dtype), _normal_range(rng, (K,), BF16)]
    elif producer == "layernorm":
        args = [_normal_range(rng, (B, M, K), dtype) + 3, _normal_range(rng, (K,), BF16), _normal_range(rng, (K,), F32)]
    elif producer == "swiglu":
        args = [_normal_range(rng, (B, M, 2 * K), dtype)]
        args[0][..., :K] = (rng.uniform(-40, 40, (B, M, K))).astype(np.float32).astype(dtype)
    elif producer == "swiglu_grad":
        h = _normal_range(rng, (B, M, 2 * K), dtype)
        h[..., :K] = rng.uniform(-40, 40, (B, M, K)).astype(np.float32).astype(dtype)
        args = [_normal_range(rng, (B, M, K), dtype), h]
    elif producer in ("gelu", "gelu_grad"):
        x = rng.uniform(-5, 12, (B, M, K)).astype(np.float32).astype(dtype)  # normal results (XLA flushes)
        args = [x] if producer == "gelu" else [_normal_range(rng, (B, M, K), dtype), x]
    else:
        args = [_normal_range(rng, (B, M, K), dtype)]
    out = F32 if producer != "cast" else BF16
    kw = dict(producer=producer, eps=1e-6, out_dtype=jnp.dtype(out))
    y_np, extra_np = producers.produce(producer, *args, eps=1e-6, out_dtype=out)
    y_j, extra_j = jax.jit(lambda *a: producers.produce(producer, *a, eps=1e-6, out_dtype=out))(*args)
    assert_bits_equal(y_j, y_np, "produced values")
    assert len(extra_j) == len(extra_np)
    for a, b in zip(extra_j, extra_np):
        assert_bits_equal(a, b, "rstd")
    scheme = SCHEMES["f8-lhs"]
    q_np = producers.produce_quantize(*args, scheme=scheme, **kw)
    q_j = jax.jit(lambda *a: producers.produce_quantize(*a, scheme=scheme, **kw))(*args)
    _assert_outputs_equal(q_j, q_np, "quantized")
    if producer == "swiglu":
        x = rng.uniform(*producers.EXP_DOMAIN, 1_000_000).astype(np.float32)
        assert_bits_equal(jax.jit(producers.exp_f32)(x), producers.exp_f32(x), "exp")
        g = rng.uniform(-100, 100, 1_000_000).astype(np.float32)
        assert_bits_equal(jax.jit(producers.sigmoid_f32)(g), producers.sigmoid_f32(g), "sigmoid")


def test_the_guards_are_what_keeps_jit_exact(monkeypatch, on_cpu):
    """XLA under jit rewrites 1 / sqrt(v) as rsqrt and contracts a * b + c into an FMA (both differ from
    NumPy's separately rounded ops); producers._rounded (a select that keeps a value apart from the op
    that reads it) stops both. Without it the contract's rstd, row sum of squares and SwiGLU gradient
    differ from NumPy's under jit; with it they are equal."""
    rng = np.random.default_rng(stable_seed("guards"))
    v = _normal_range(rng, (1_000_000,), F32) ** 2
    a, b, c = (_normal_range(rng, (1_000_000,), F32) for _ in range(3))
    f32 = np.float32
    assert (np.asarray(jax.jit(lambda v: 1 / jnp.sqrt(v))(v)) != f32(1) / np.sqrt(v)).any()
    assert_bits_equal(jax.jit(lambda v: 1 / producers._rounded(jnp.sqrt(v)))(v), f32(1) / np.sqrt(v), "1/sqrt")
    assert (np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c)) != a * b + c).any()
    assert_bits_equal(jax.jit(lambda a, b, c: producers._rounded(a * b) + c)(a, b, c), a * b + c, "a*b+c")

    x = (rng.standard_normal((256, 1000)) * 3).astype(np.float32)
    h = np.concatenate([rng.uniform(-20, 20, (256, 1000)), rng.standard_normal((256, 1000))], -1).astype(np.float32)
    da = rng.standard_normal((256, 1000)).astype(np.float32)
    cases = {"rstd": ("rms_norm_rstd", (x, 1e-6)), "sum of squares": ("row_sum_squares", (x,)),
             "swiglu_grad": ("swiglu_grad", (da, h))}

    def n_diff(name, args):
        fn = getattr(producers, name)
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        rest = args[len(arrays):]
        jitted = jax.jit(lambda *arr: fn(*arr, *rest))  # a fresh function: no cached trace
        return int((np.asarray(jitted(*arrays)) != fn(*args)).sum())

    for what, (name, args) in cases.items():
        assert n_diff(name, args) == 0, what
    monkeypatch.setattr(producers, "_rounded", lambda v: v)
    for what, (name, args) in cases.items():
        assert n_diff(name, args) > 0, f"{what}: equal to NumPy's without the guards (XLA no longer rewrites it)"


# ---- 4. vmap -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("producer", PRODUCERS)
def test_vmap_equals_per_slice(producer):
    rng = np.random.default_rng(stable_seed("vmap", producer))
    V, B, M, K = 3, 2, 70, 160
    args = _inputs(rng, producer, V * B, M, K, BF16, F32)
    norm = producer in producers.NORMS  # gamma and beta shared
    args = [a if norm and i >= 1 else a.reshape(V, B, *a.shape[1:]) for i, a in enumerate(args)]
    scheme = SCHEMES["f8-lhs"]
    fn, _ = _bind(producer, scheme, 1e-5, F32)
    mapped = [0 if i == 0 or not norm else None for i in range(len(args))]
    single = jax.jit(fn)
    # x mapped along axis 0, and along axis 2 (moved there)
    for axis in (0, 2):
        moved = [np.moveaxis(a, 0, axis) if m is not None else a for a, m in zip(args, mapped)]
        got = jax.jit(jax.vmap(fn, in_axes=[None if m is None else axis for m in mapped]))(*moved)
        for v in range(V):
            want = single(*[a[v] if m is not None else a for a, m in zip(args, mapped)])
            _assert_outputs_equal([o[v] for o in got], want, f"axis {axis} slice {v}")
    # a batch of no entries: empty results of one slice's types
    got = jax.vmap(fn, in_axes=mapped)(*[a[:0] if m is not None else a for a, m in zip(args, mapped)])
    want = single(*[a[0] if m is not None else a for a, m in zip(args, mapped)])
    assert [(o.shape, o.dtype) for o in jax.tree.leaves(got)] == [((0, *w.shape), w.dtype)
                                                                   for w in jax.tree.leaves(want)]
    if producer == "swiglu_grad":  # one mapped input, the other shared
        h0 = args[1][0]
        got = jax.jit(jax.vmap(fn, in_axes=(0, None)))(args[0], h0)
        for v in range(V):
            _assert_outputs_equal([o[v] for o in got], single(args[0][v], h0), f"da mapped, slice {v}")


def test_vmap_norm_with_mapped_gamma_refuses():
    x, g = np.zeros((2, 1, 8, 128), np.float32), np.ones((2, 128), np.float32)
    fn, _ = _bind("rmsnorm", SCHEMES["f8-lhs"])
    with pytest.raises(NotImplementedError, match="gamma"):
        jax.vmap(fn)(x, g)
    fn, _ = _bind("layernorm", SCHEMES["f8-lhs"])
    with pytest.raises(NotImplementedError, match="beta"):
        jax.vmap(fn, in_axes=(0, None, 0))(x, g[0], g)


# ---- 5. shape errors -----------------------------------------------------------------------------------
def test_wrong_shapes_raise():
    s = SCHEMES["f8-lhs"]
    x = jnp.zeros((1, 8, 128), F32)
    cases = [
        ("rmsnorm", (x, jnp.ones((127,), F32)), "gamma must have shape \\(128,\\)"),
        ("rmsnorm", (x, jnp.ones((1, 128), F32)), "gamma"),
        ("swiglu", (jnp.zeros((1, 8, 129), F32),), "2F"),
        ("swiglu_grad", (jnp.zeros((1, 8, 64), F32), jnp.zeros((1, 8, 130), F32)), "da \\(B, M, F\\) and h"),
        ("swiglu_grad", (jnp.zeros((1, 8, 64), F32), jnp.zeros((1, 9, 128), F32)), "da \\(B, M, F\\) and h"),
        ("cast", (jnp.zeros((8, 128), F32),), "\\(batch, rows, cols\\)"),
        ("rmsnorm", (x,), "takes 2 inputs"),
        ("layernorm", (x, jnp.ones((128,), F32), jnp.ones((64,), F32)), "layernorm's beta must have shape \\(128,\\)"),
        ("layernorm", (x, jnp.ones((128,), F32)), "takes 3 inputs"),
        ("gelu_grad", (x, jnp.zeros((1, 8, 64), F32)), "gelu_grad takes da and x of one shape"),
    ]
    for producer, args, match in cases:
        fn, _ = _bind(producer, s)
        with pytest.raises(ValueError, match=match):
            jax.jit(fn)(*args)
    # the N-D wrapper too
    with pytest.raises(ValueError, match="gamma"):
        produce_quantize("rmsnorm", jnp.zeros((4, 128)), jnp.ones((64,)), scheme=s)
    with pytest.raises(ValueError, match="swiglu"):
        produce_quantize("swiglu", jnp.zeros((4, 2, 63)), scheme=s)
    with pytest.raises(ValueError, match="swiglu_grad"):
        produce_quantize("swiglu_grad", jnp.zeros((4, 64)), jnp.zeros((4, 64)), scheme=s)


# ---- 6. sharded jax.jit --------------------------------------------------------------------------------
def _mesh(shape, names, mode="auto"):
    devices = jax.devices("cpu")[:int(np.prod(shape))]
    if mode == "auto":
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
    return jax.make_mesh(shape, names, devices=devices)


def _sharded_inputs(producer, args, mesh, spec):
    """Every (B, M, cols) input with ``spec``; a norm's gamma and beta split as x's last dim."""
    out = []
    for i, a in enumerate(args):
        s = P(spec[2]) if producer in producers.NORMS and i >= 1 else spec
        out.append(jax.device_put(a, NamedSharding(mesh, s)))
    return out


WHY = {"rmsnorm": "RMSNorm reduces along it", "layernorm": "LayerNorm reduces along it",
       "swiglu": "SwiGLU multiplies its two halves",
       "swiglu_grad": "SwiGLU's gradient pairs the two halves of its input"}


@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("split", ["rows", "rows+batch-explicit", "last dim"])
def test_sharded_jit_equals_unsharded(producer, split):
    scheme = SCHEMES["f8-rhs" if producer == "cast" and split == "last dim" else "f8-lhs"]
    rng = np.random.default_rng(stable_seed("sharded", producer, split))
    if split == "rows":
        mesh, spec, (B, M, K) = _mesh((8,), ("data",)), P(None, "data", None), (1, 1024, 256)
    elif split == "rows+batch-explicit":
        mesh, spec, (B, M, K) = _mesh((2, 4), ("b", "data"), "default"), P("b", "data", None), (2, 512, 256)
    else:
        mesh, spec, (B, M, K) = _mesh((4, 2), ("data", "model")), P(None, "data", "model"), (1, 512, 512)
    args = _inputs(rng, producer, B, M, K // 2 if producer == "swiglu_grad" else K, BF16, F32)
    fn, _ = _bind(producer, scheme, 1e-6, BF16)
    f = jax.jit(fn)
    want = f(*[jax.device_put(a, _CPU) for a in args])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(*_sharded_inputs(producer, args, mesh, spec))
    ours = [str(w.message) for w in caught if issubclass(w.category, ShardingWarning)]
    _assert_outputs_equal(got, [np.asarray(w) for w in want], split)
    data = got[0]  # rowwise data: (B, M, K) as the input
    local = data.addressable_shards[0].data.shape
    sizes = dict(mesh.shape)
    assert local[1] == M // sizes["data"], (local, data.sharding)  # the rows stay split
    if split == "rows+batch-explicit":
        assert local[0] == 1
    if split == "last dim" and producer not in ELEMENTWISE:
        # one warning per split input dim (swiglu_grad: da's and h's), each saying why it is gathered
        assert 1 <= len(ours) <= len(args), ours
        assert all(WHY[producer] in w and "gathered" in w and "last dim" in w for w in ours), ours
    else:
        assert not ours, ours
        if split == "last dim":  # an elementwise producer stays split along its last dim
            assert local[2] == data.shape[2] // sizes["model"], (local, data.sharding)


# ---- 7. inside jax.shard_map (check_vma on) -----------------------------------------------------------
@pytest.mark.parametrize("producer", PRODUCERS)
def test_shard_map_types_and_gives_per_shard_results(producer):
    n = 8
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]), ("data",))
    rng = np.random.default_rng(stable_seed("shard_map", producer))
    B, Mloc, K = 2, 40, 200
    args = _inputs(rng, producer, B, n * Mloc, K, BF16, BF16)
    scheme = SCHEMES["f8-lhs"]
    fn, _ = _bind(producer, scheme, 1e-6, F32)
    mapped = [i == 0 or producer not in producers.NORMS for i in range(len(args))]
    in_specs = tuple(P(None, "data") if m else P() for m in mapped)
    seen = []

    def body(*a):
        outs = fn(*a)
        seen.extend(axes_of(o) for o in outs)
        return [o[None] for o in outs]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P("data")))(*args)
    assert seen and all(v == frozenset({"data"}) for v in seen), seen
    single = jax.jit(fn)
    for r in range(n):
        local = [a[:, r * Mloc:(r + 1) * Mloc] if m else a for a, m in zip(args, mapped)]
        _assert_outputs_equal([np.asarray(o)[r] for o in got], single(*local), f"rank {r}")

    # replicated inputs: replicated outputs (out_specs=P() type-checks), each rank's the same
    seen.clear()
    local = [a[:, :Mloc] if m else a for a, m in zip(args, mapped)]

    def body_rep(*a):
        outs = fn(*a)
        seen.extend(axes_of(o) for o in outs)
        return outs

    got = jax.jit(jax.shard_map(body_rep, mesh=mesh, in_specs=P(), out_specs=P()))(*local)
    assert all(v == frozenset() for v in seen), seen
    _assert_outputs_equal(got, single(*local), "replicated")
