"""``fp8_dot_general`` on N-D operands: a call whose operands are the GEMM's 2-D problem by
reshapes alone (several contracting dims folded into one K, an N-D weight's free dims into N; the rules:
``jax_fp8.gemm.plan.fold_dot_general``) runs on the FP8 GEMM with its FP8 VJP, bit for bit as the same
call on the explicitly reshaped 2-D operands (forward and both gradients), unwarned; what cannot fold
falls back with one warning that names the call's shapes, dimension numbers and why.

The foldable cases are generated: every number of contracting dims (1-3) and of free weight dims (1-3),
the weight contracted over its leading dims ((K.., N..), flax's kernels) or its trailing ones ((N.., K..)),
an lhs with one or two leading dims, contracting dims listed in either order; the widths cycle through
common head layouts (8x64 = 512, 16x64 = 1024, 16x128 = 2048) and widths off the 128 grid (8 heads of 96,
8 of 40). Against ``lax.dot_general``, the forward is within the bound that the quantization of the
operands (computed exactly in fp64 from independent quantizations, with the recipe's blocks over the
folded 2-D views) and the two products' fp32 rounding allow. Then the layers that motivated it (flax's
``DenseGeneral`` attention projections, ``jnp.einsum`` with two contracting dims), sharded ``jit`` on 8
simulated CPU devices and ``jax.shard_map``.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8.gemm.plan import fold_dot_general
from helpers import assert_bits_equal, random_input, stable_seed
from test_dot_general_vjp import _ref64, accumulation_bound
from test_gemm import B1, B2, BF16, E4M3, F32, U_FP32, assert_within, gemm_bound, one_warning, strict  # noqa: F401
from test_sharded_jit import _norm, assert_close_reassociated, collectives

#: (heads, head_dim) of the wide side (the weight's heads * head_dim): 512, 1024 and 2048, and widths off
#: the 128 grid (768 = 8 heads of 96, 320 = 8 of 40)
LAYOUTS = [(8, 64), (16, 64), (16, 128), (8, 96), (8, 40)]
#: The other side (d_model), kept narrow so the suite stays fast: 136 = 8 x 17, 192 = 2 x 96, 256 = 4 x 64
NARROW = [(8, 17), (2, 96), (4, 64)]


def _group(layout, n: int) -> tuple:
    """``n`` dims whose product is heads * head_dim: (heads * head_dim,), (heads, head_dim) or
    (2, heads / 2, head_dim)."""
    h, d = layout
    return {1: (h * d,), 2: (h, d), 3: (2, h // 2, d) if h % 4 == 0 else (h, 2, d // 2)}[n]


@dataclasses.dataclass(frozen=True)
class Case:
    """One dot_general and the 2-D problem it must equal: lhs (M, K) by reshape, rhs (K, N) by reshape
    when ``rhs_kn`` else (N, K); the output is (M, N) reshaped."""

    name: str
    lhs: tuple
    rhs: tuple
    dn: tuple
    M: int
    K: int
    N: int
    rhs_kn: bool
    dtype: str = "float32"


def _sweep() -> list[Case]:
    """Every number of contracting dims and of free weight dims (1-3), the weight contracted over its
    leading or its trailing dims; the lhs's leading dims, the widths and the order in which the pairs
    are listed cycle over the cases."""
    cases = []
    for i, (nk, nn, k_first) in enumerate(itertools.product((1, 2, 3), (1, 2, 3), (True, False))):
        wide, narrow = LAYOUTS[i % len(LAYOUTS)], NARROW[i % len(NARROW)]
        # the wide side is heads * head_dim: N of a q/k/v kernel, K of an out projection
        kdims, ndims = (_group(narrow, nk), _group(wide, nn)) if i % 4 < 2 else (_group(wide, nk), _group(narrow, nn))
        lead = (5,) if (nk + nn) % 2 else (2, 3)
        lhs, rhs = lead + kdims, (kdims + ndims) if k_first else (ndims + kdims)
        lc = tuple(range(len(lead), len(lhs)))
        rc = tuple(range(nk)) if k_first else tuple(range(nn, nn + nk))
        if nk > 1 and i % 3 == 1:  # the same contraction, its pairs listed in another order
            lc, rc = lc[::-1], rc[::-1]
        M, K, N = int(np.prod(lead)), int(np.prod(kdims)), int(np.prod(ndims))
        name = f"lhs{lhs}-rhs{rhs}-dims{lc}{rc}"
        dtype = "bfloat16" if i % 3 == 0 else "float32"
        cases.append(Case(name, lhs, rhs, ((lc, rc), ((), ())), M, K, N, k_first, dtype))
    return cases


#: Beyond the sweep: sequences stacked under jit (S % 128 == 0); dims of size 1, which do not count.
EDGES = [
    Case("stacked-sequences", (2, 128, 8, 64), (8, 64, 256), (((2, 3), (0, 1)), ((), ())), 256, 512, 256, True),
    Case("batch-dims-of-size-1", (1, 6, 256), (1, 256, 136), (((2,), (1,)), ((0,), (0,))), 6, 256, 136, True),
    Case("size-1-free-dim-between-contracting", (6, 8, 40), (8, 1, 40, 24), (((1, 2), (0, 2)), ((), ())),
         6, 320, 24, True),
    # a matrix-vector product (N = 1): M = 8 keeps every GEMM within cuBLASLt's padding limit (no warning)
    Case("no-free-rhs-dim", (8, 8, 40), (8, 40), (((1, 2), (0, 1)), ((), ())), 8, 320, 1, True),
    Case("no-free-lhs-dim", (8, 64), (136, 8, 64), (((0, 1), (1, 2)), ((), ())), 1, 512, 136, False),
]
CASES = _sweep() + EDGES


def _operands(case: Case, seed):
    rng = np.random.default_rng(seed)
    x, w = (jnp.asarray(random_input(rng, s, F32, specials=False), case.dtype) for s in (case.lhs, case.rhs))
    out = jax.eval_shape(partial(lax.dot_general, dimension_numbers=case.dn), x, w)
    cot = jnp.asarray(random_input(rng, out.shape, F32, specials=False))
    return x, w, cot


def _value_and_grads(f, x, w, cot):
    """(y, dlhs, drhs) of ``f`` with cotangent ``cot``, by jax.grad."""
    loss = lambda x, w: jnp.sum(f(x, w).astype(F32) * cot)  # noqa: E731
    return (f(x, w), *jax.grad(loss, argnums=(0, 1))(x, w))


def _two_d(case: Case):
    """The same product written by hand on the reshaped 2-D operands (its output reshaped back)."""
    dn = (((1,), (0 if case.rhs_kn else 1,)), ((), ()))
    rhs2 = (case.K, case.N) if case.rhs_kn else (case.N, case.K)
    return lambda x, w: jf.fp8_dot_general(x.reshape(case.M, case.K), w.reshape(rhs2), dn)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_folded_equals_the_reshaped_2d_call_and_lax_within_the_fp8_bound(case, strict):
    """No warning (``strict``); y, dlhs and drhs (jax.grad, jitted) bit for bit those of the call on the
    operands reshaped to 2-D by hand, in lax.dot_general's shapes and dtypes; y within the FP8 bound of
    lax.dot_general's (module docstring)."""
    x, w, cot = _operands(case, stable_seed("fold", case.name, case.dtype))
    lax_dot = partial(lax.dot_general, dimension_numbers=case.dn, precision=lax.Precision.HIGHEST,
                      preferred_element_type=F32)
    run = jax.jit(lambda x, w, cot: (_value_and_grads(lambda x, w: jf.fp8_dot_general(x, w, case.dn), x, w, cot),
                                     _value_and_grads(_two_d(case), x, w, cot.reshape(case.M, case.N)),
                                     lax_dot(x, w)))
    (y, dx, dw), (y2, dx2, dw2), ref = run(x, w, cot)
    want = jax.eval_shape(partial(lax.dot_general, dimension_numbers=case.dn), x, w)
    assert (y.shape, y.dtype) == (want.shape, want.dtype)
    assert (dx.shape, dx.dtype, dw.shape, dw.dtype) == (x.shape, x.dtype, w.shape, w.dtype)
    assert_bits_equal(y, y2.reshape(y.shape), "y")
    assert_bits_equal(dx, dx2, "dlhs")
    assert_bits_equal(dw, dw2, "drhs")

    # against lax.dot_general: |ours - exact(Q(x) Q(W))| by the GEMM's accumulation, |exact(Q(x) Q(W)) -
    # exact(x W)| <= |Q(x) - x| |Q(W)| + |x| |Q(W) - W| (fp64, exactly), |lax - exact(x W)| by fp32's
    recipe = jf.Float8BlockScaling()
    lhs2, rhs2 = (case.M, case.K), ((case.K, case.N) if case.rhs_kn else (case.N, case.K))
    X, W = np.asarray(x, np.float64).reshape(lhs2), np.asarray(w, np.float64).reshape(rhs2)
    Xq = _ref64(np.asarray(x).reshape(lhs2), B1, E4M3, recipe)
    Wq = _ref64(np.asarray(w).reshape(rhs2), B2, E4M3, recipe)
    if case.rhs_kn:  # to (N, K): the tiles are those of the (K, N) view
        W, Wq = W.T, Wq.T
    _, acc = accumulation_bound(Xq, Wq, y.dtype)
    quant = np.abs(Xq - X) @ np.abs(Wq).T + np.abs(X) @ np.abs(Wq - W).T
    _, lax_err = gemm_bound(X, W, F32, u=U_FP32)
    assert_within(y.reshape(case.M, case.N), np.asarray(ref, np.float64).reshape(case.M, case.N),
                  acc + quant + lax_err, "y vs lax.dot_general")


def test_fold_rules_for_the_attention_kernels():
    """The plan's fold of flax's attention kernels: q/k/v (d, heads, head_dim) is (K, N) = (d, heads *
    head_dim); out (heads, head_dim, d) contracted over (heads, head_dim) is (K, N) = (heads * head_dim, d),
    the lhs (B, L, heads, head_dim) folding into (B * L, heads * head_dim); the output as lax's."""
    fold, why = fold_dot_general((2, 5, 256), (256, 8, 96), (((2,), (0,)), ((), ())))
    assert why is None and (fold.sizes(), fold.rhs_kn, fold.rhs_view, fold.out_shape) == (
        (10, 256, 768), True, (256, 768), (2, 5, 8, 96))
    fold, why = fold_dot_general((2, 5, 8, 96), (8, 96, 256), (((3, 2), (1, 0)), ((), ())))
    assert why is None and (fold.sizes(), fold.rhs_kn, fold.lhs_view, fold.out_shape) == (
        (10, 768, 256), True, (2, 5, 768), (2, 5, 256))
    fold, why = fold_dot_general((2, 5, 256), (8, 96, 256), (((2,), (2,)), ((), ())))  # (N.., K): (N, K)
    assert why is None and (fold.rhs_view, fold.out_shape) == ((768, 256), (2, 5, 8, 96))
    assert fold.sizes((1, 5, 256), (4, 96, 256)) == (5, 256, 384)  # e.g. one device's shares
    # (B, S, heads, head_dim) with S % 128 == 0, where sequences may split (8 CPU devices): stacked
    # (B, S, heads * head_dim) sequences, as EDGES' "stacked-sequences" runs them
    out_proj = partial(jf.fp8_dot_general, dimension_numbers=(((2, 3), (0, 1)), ((), ())))
    jaxpr = str(jax.make_jaxpr(out_proj)(jax.ShapeDtypeStruct((2, 128, 8, 64), F32),
                                         jax.ShapeDtypeStruct((8, 64, 256), F32)))
    assert "u8[2,128,512]" in jaxpr, jaxpr


@pytest.mark.parametrize("rhs,dims,folds", [
    ((4, 64, 136), (((1, 2), (0, 1)), ((), ())), True),  # its 2-D view (256, 136) is the fold's (K, N)
    ((256, 4, 34), (((1,), (0,)), ((), ())), False),  # its 2-D view (1024, 34) is not the fold's (256, 136)
], ids=["view-is-the-fold", "view-is-not-the-fold"])
def test_prequantized_nd_weight(rhs, dims, folds, strict):
    """A pre-quantized weight's blocks lie on its own 2-D view (prod(shape[:-1]), shape[-1]): it folds
    where that view is the fold's (the same bits as the 2-D tensor quantized from the reshaped weight);
    elsewhere no reshape can move its blocks, and the call falls back, saying so."""
    rng = np.random.default_rng(stable_seed("prequantized-nd", rhs))
    x = jnp.asarray(random_input(rng, (6, 256), F32, specials=False))
    w = jnp.asarray(random_input(rng, rhs, F32, specials=False))
    wq = jf.quantize_blockwise(w, block=B2)
    if folds:
        y = jax.jit(lambda x, wq: jf.fp8_dot_general(x.reshape(6, 4, 64), wq, dims))(x, wq)
        want = jf.fp8_dot_general(x, jf.quantize_blockwise(w.reshape(256, 136), block=B2), (((1,), (0,)), ((), ())))
        assert_bits_equal(y, want, "pre-quantized N-D weight")
    else:  # traced only: the fallback's values are test_dot_general_vjp.py's
        _, wn = one_warning(lambda: jax.make_jaxpr(partial(jf.fp8_dot_general, dimension_numbers=dims))(x, wq),
                            "a pre-quantized rhs of shape (256, 4, 34)")
        assert "not on the folded (256, 136)" in str(wn.message)


def test_mxfp8_recipe_folds_too():
    """The fold does not depend on the recipe: with MXFP8BlockScaling an out projection over (heads,
    head_dim) gives the bits of the 2-D call (forward and gradients)."""
    case = Case("mxfp8-out-projection", (2, 3, 8, 40), (8, 40, 136), (((2, 3), (0, 1)), ((), ())), 6, 320, 136, True)
    x, w, cot = _operands(case, stable_seed("fold-mxfp8"))
    recipe = jf.MXFP8BlockScaling()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jf.MXFP8GemmFallbackWarning)  # off Blackwell: the reference GEMMs
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)
        got, want = jax.jit(lambda x, w, cot: (
            _value_and_grads(lambda x, w: jf.fp8_dot_general(x, w, case.dn, recipe=recipe), x, w, cot),
            _value_and_grads(lambda x, w: jf.fp8_dot_general(x.reshape(6, 320), w.reshape(320, 136),
                                                             (((1,), (0,)), ((), ())), recipe=recipe),
                             x, w, cot.reshape(6, 136))))(x, w, cot)
    for a, b, what in zip(got, want, ("y", "dlhs", "drhs")):
        assert_bits_equal(a, b.reshape(a.shape), what)


# ---- what cannot fold: the lax fallback, with one warning naming the call ------------------------------
#: How a call fails to fold, as (lhs, rhs, dimension_numbers) of k1, k2 (two contracted widths), m and n,
#: and the words of the reason.
BREAKS = {
    "batch-dims": (lambda k1, k2, m, n: ((3, m, k1), (3, k1, n), (((2,), (1,)), ((0,), (0,)))), "batch dimensions"),
    "contracting-order-transposed": (lambda k1, k2, m, n: ((m, k1, k2), (k2, k1, n), (((1, 2), (1, 0)), ((), ()))),
                                     "in a different order"),
    "rhs-contracting-dims-apart": (lambda k1, k2, m, n: ((m, k1, k2), (k1, n, k2), (((1, 2), (0, 2)), ((), ()))),
                                   "not two adjacent groups"),
    "rhs-free-dims-apart": (lambda k1, k2, m, n: ((m, k1), (n, k1, 3), (((1,), (1,)), ((), ()))),
                            "not two adjacent groups"),
    "lhs-contracting-dim-leading": (lambda k1, k2, m, n: ((k1, m), (k1, n), (((0,), (0,)), ((), ()))),
                                    "not its trailing dims"),
    "lhs-contracting-dims-apart": (lambda k1, k2, m, n: ((k1, m, k2), (k1, k2, n), (((0, 2), (0, 1)), ((), ()))),
                                   "not its trailing dims"),
    "no-contraction": (lambda k1, k2, m, n: ((m, k1), (k2, n), (((), ()), ((), ()))), "no contracting dimensions"),
}
#: (k1, k2, m, n): heads and head_dim as in the sweep, and a width off the 128 grid
BREAK_SIZES = [(8, 64, 4, 24), (8, 40, 3, 136)]


def _fmt(shape) -> str:
    return f"float32[{','.join(map(str, shape))}]"


@pytest.mark.parametrize("sizes", BREAK_SIZES, ids=str)
@pytest.mark.parametrize("kind", BREAKS)
def test_what_cannot_fold_falls_back_with_a_warning_naming_the_call(kind, sizes):
    """Traced only (the fallback's values: test_dot_general_vjp.py::test_fallback_dimension_numbers):
    one warning that names the shapes, the dimension numbers and why; no FP8 GEMM, one dot_general."""
    make, words = BREAKS[kind]
    lshape, rshape, dn = make(*sizes)
    x, w = jax.ShapeDtypeStruct(lshape, F32), jax.ShapeDtypeStruct(rshape, F32)
    jaxpr, wn = one_warning(lambda: str(jax.make_jaxpr(partial(jf.fp8_dot_general, dimension_numbers=dn))(x, w)),
                            words)
    msg = str(wn.message)
    assert f"lhs {_fmt(lshape)}, rhs {_fmt(rshape)}, dimension_numbers {dn}" in msg, msg
    assert "jf_fp8_gemm" not in jaxpr and jaxpr.count("dot_general[") == 1, jaxpr


# ---- the layers that motivated it ----------------------------------------------------------------------
def test_flax_dense_general_attention_projections(strict):
    """flax.linen's attention projections: q/k/v ``DenseGeneral(features=(heads, head_dim), axis=-1)``
    (kernel (d, heads, head_dim)) and the out projection ``DenseGeneral(features=d, axis=(-2, -1))``
    (kernel (heads, head_dim, d), two contracting dims): on the FP8 GEMM, unwarned, output and every
    gradient bit for bit those of fp8_dot_general on the kernels reshaped to 2-D by hand."""
    nn = pytest.importorskip("flax.linen")
    B, L, d, H, D = 2, 3, 256, 8, 96
    qkv = nn.DenseGeneral(features=(H, D), axis=-1, dot_general=jf.fp8_dot_general)
    out = nn.DenseGeneral(features=d, axis=(-2, -1), dot_general=jf.fp8_dot_general)
    rng = np.random.default_rng(stable_seed("flax-dense-general"))
    x = jnp.asarray(random_input(rng, (B, L, d), BF16, specials=False))
    cot = jnp.asarray(random_input(rng, (B, L, d), F32, specials=False))
    p_qkv = jax.jit(qkv.init)(jax.random.key(0), x)
    p_out = jax.jit(out.init)(jax.random.key(1), jnp.zeros((B, L, H, D), BF16))
    assert p_qkv["params"]["kernel"].shape == (d, H, D) and p_out["params"]["kernel"].shape == (H, D, d)

    def layers(params, x):
        return out.apply(params[1], qkv.apply(params[0], x))

    def by_hand(params, x):
        (k1, b1), (k2, b2) = ((p["params"]["kernel"], p["params"]["bias"]) for p in params)
        h = jf.fp8_dot_general(x.reshape(B * L, d), k1.reshape(d, H * D), (((1,), (0,)), ((), ()))) + b1.reshape(-1)
        y = jf.fp8_dot_general(h, k2.reshape(H * D, d), (((1,), (0,)), ((), ()))) + b2
        return y.reshape(B, L, d)

    def run(f):
        loss = lambda params, x: jnp.sum(f(params, x).astype(F32) * cot)  # noqa: E731
        return f((p_qkv, p_out), x), jax.grad(loss, argnums=(0, 1))((p_qkv, p_out), x)

    got, want = jax.jit(lambda: (run(layers), run(by_hand)))()
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        assert_bits_equal(a, b, jax.tree_util.keystr(path))
    assert got[0].shape == (B, L, d) and got[0].dtype == F32


def test_einsum_with_two_contracting_dims(strict):
    """``jnp.einsum("blhk,hkd->bld", ..., _dot_general=jf.fp8_dot_general)`` (an out projection over
    (heads, head_dim)): one foldable dot_general, on the FP8 GEMM unwarned, bit for bit the 2-D call on
    the operands reshaped by hand (forward and gradients)."""
    spec, (b, l, h, k, d) = "blhk,hkd->bld", (2, 3, 8, 64, 136)
    rng = np.random.default_rng(stable_seed("einsum", spec))
    x, w, cot = (jnp.asarray(random_input(rng, s, F32, specials=False)) for s in [(b, l, h, k), (h, k, d), (b, l, d)])
    ein = lambda x, w: jnp.einsum(spec, x, w, _dot_general=jf.fp8_dot_general)  # noqa: E731
    by_hand = lambda x, w: jf.fp8_dot_general(  # noqa: E731
        x.reshape(b * l, h * k), w.reshape(h * k, d), (((1,), (0,)), ((), ()))).reshape(b, l, d)
    got, want = jax.jit(lambda: (_value_and_grads(ein, x, w, cot), _value_and_grads(by_hand, x, w, cot)))()
    for a, r, what in zip(got, want, ("y", "dlhs", "drhs")):
        assert_bits_equal(a, r, f"{spec} {what}")


# ---- sharded: jit with NamedShardings, and jax.shard_map --------------------------------------------------
#: The attention block's shapes: x (B, S, d), q/k/v kernel (d, H, Dh), out kernel (H, Dh, d); S = 128:
#: stacked sequences under jit. (M = B * S = 1024 is a contraction (wgrad) width at which
#: ``partitioning.py``'s rules once crashed: a Shardy factor used only in compound factors.)
B, S, D_MODEL, HEADS = 8, 128, 256, 8


def _attention_operands(seed, head_dim):
    rng = np.random.default_rng(seed)
    shapes = [(B, S, D_MODEL), (D_MODEL, HEADS, head_dim), (HEADS, head_dim, D_MODEL), (B, S, D_MODEL)]
    return [jnp.asarray(random_input(rng, s, F32, specials=False)) for s in shapes]


def _attention_block(x, wq, wo, cot, dot_general=jf.fp8_dot_general):
    """An attention layer's two projections (q/k/v, then out over (heads, head_dim)): y and the
    gradients of x, wq and wo."""
    def f(x, wq, wo):
        h = dot_general(x, wq, (((2,), (0,)), ((), ())))  # (B, S, H, Dh)
        return dot_general(h, wo, (((2, 3), (0, 1)), ((), ())))  # (B, S, d)

    loss = lambda *a: jnp.sum(f(*a) * cot)  # noqa: E731
    return (f(x, wq, wo), *jax.grad(loss, argnums=(0, 1, 2))(x, wq, wo))


#: name: mesh shape and axis names, head_dim, the specs of x, wq and wo (cot: as x), and the dtype that
#: the block's all-gathers above a few KiB (a scale grid) may move: None (none may), or "u8" (FP8 weights)
SHARDINGS = {
    "heads-split-over-data": ((8,), ("data",), 128, P("data"), P(None, "data"), P("data"), "u8"),  # FSDP-like
    "megatron-heads": ((4, 2), ("data", "model"), 32, P("data"), P(None, "model"), P("model"), None),
}


@pytest.mark.parametrize("name,mode", [(n, "Mesh") for n in SHARDINGS] + [("megatron-heads", "make_mesh")])
def test_sharded_jit_compiles_and_equals_the_unsharded_block(name, mode):
    """Under plain jit with NamedShardings (``Mesh`` of the 8 CPU devices: Auto axes; ``jax.make_mesh``:
    its default axis types, Explicit on jax 0.12): the folds are reshapes before the GEMM primitive, one
    group of dims at a time (what Explicit types follow), so weights split over their heads compile and
    stay split: no gather but of scale grids, FSDP-like weights gathered as FP8 bytes; the output and
    the gradients are sharded as lax.dot_general's (Auto) or as their operands (Explicit). Values: the
    unsharded block's, within the reassociation of a split contraction's fp32 sum."""
    shape, names, head_dim, *specs, gathered = SHARDINGS[name]
    devices = jax.devices("cpu")[:int(np.prod(shape))]
    mesh = (Mesh(np.array(devices).reshape(shape), names) if mode == "Mesh"
            else jax.make_mesh(shape, names, devices=devices))
    args = _attention_operands(stable_seed("sharded", name), head_dim)
    want = jax.jit(_attention_block)(*jax.device_put(args, devices[0]))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, (*specs, specs[0]))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every GEMM on the FP8 path, no dim gathered for its blocks
        compiled = jax.jit(_attention_block).lower(*placed).compile()
    got = compiled(*placed)
    big = {(c.dtype, c.shape) for c in collectives(compiled.as_text()) if c.kind == "all-gather" and c.size > 1024}
    assert all(dtype == gathered for dtype, _ in big), big
    if mode == "Mesh":  # Auto axes: XLA's choice, as for lax.dot_general
        specs = [r.sharding.spec for r in jax.jit(partial(_attention_block, dot_general=lax.dot_general))(*placed)]
    else:  # Explicit types: the gradients have their operands' types (lax itself asks for an out_sharding
        specs = [specs[0], *specs]  # of the out projection, its contraction being split)
    for g, w_, spec, what in zip(got, want, specs, ("y", "dx", "dwq", "dwo")):
        assert g.shape == w_.shape and _norm(g.sharding.spec, g.ndim) == _norm(spec, g.ndim), (what, g.sharding, spec)
        assert_close_reassociated(g, w_, what)


def test_shard_map_gradients_of_replicated_nd_weights():
    """Inside ``jax.shard_map`` (default checks) with the batch split and the N-D kernels replicated:
    y and dx are each shard's own (128 rows a shard: the unsharded blocks and bits); dwq and dwo are
    the sums over the shards (JAX's psum of a replicated operand's cotangent, DESIGN section 7), i.e. the
    unsharded gradients within reassociation, not 8 times them."""
    mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
    args = _attention_operands(stable_seed("shard_map"), 64)
    want = jax.jit(_attention_block)(*jax.device_put(args, jax.devices("cpu")[0]))
    f = jax.jit(jax.shard_map(_attention_block, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")),
                              out_specs=(P("data"), P("data"), P(), P())))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)
        got = f(*args)
    assert_bits_equal(got[0], want[0], "y")
    assert_bits_equal(got[1], want[1], "dx")
    for g, w_, what in zip(got[2:], want[2:], ("dwq", "dwo")):
        assert_close_reassociated(g, w_, what)
