"""Sharded arrays under plain ``jax.jit``: ``fp8_dot_general`` partitions as ``lax.dot_general`` on the
same sharded operands, and vmap inside jit on sharded inputs (the method and the helpers:
test_sharded_jit.py's docstring)."""
from __future__ import annotations

import dataclasses
import warnings
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import Fp8GemmFallbackWarning
from jax_fp8 import ShardingWarning
from helpers import assert_bits_equal, assert_tensors_equal, random_input, stable_seed
from test_sharded_jit import (_CPU, MODES, _assert_sharded_as, _large, _mesh, _norm, _put, assert_close_reassociated,
                              collectives)

# ---- 3, 4. fp8_dot_general against lax.dot_general on the same sharded operands ------------------------
@dataclasses.dataclass(frozen=True)
class GemmCase:
    mesh: tuple
    names: tuple
    x_shape: tuple
    x_spec: P
    w_spec: P
    split: frozenset  # results whose contraction is split over devices: y (K), dx (N), dw (M)
    fsdp: bool = False  # the weight is gathered (as lax gathers it), in FP8


M, K, N = 1024, 1024, 512
DP, TP = ((8,), ("data",)), ((4, 2), ("data", "model"))
GEMM_CASES = {
    "dp": GemmCase(*DP, (M, K), P("data", None), P(), frozenset({"dw"})),
    "tp-col": GemmCase(*TP, (M, K), P("data", None), P(None, "model"), frozenset({"dx", "dw"})),
    "tp-row": GemmCase(*TP, (M, K), P("data", "model"), P("model", None), frozenset({"y", "dw"})),
    "fsdp": GemmCase(*DP, (M, K), P("data", None), P("data", None), frozenset({"dw"}), fsdp=True),
    "fsdp+tp": GemmCase(*TP, (M, K), P("data", None), P("data", "model"), frozenset({"dx", "dw"}), fsdp=True),
    # 4. a 3-D activation (B, S, K): batch-sharded, and sequence-sharded
    "3d-batch": GemmCase(*TP, (8, M // 8, K), P("data", None, None), P(None, "model"), frozenset({"dx", "dw"})),
    "3d-sequence": GemmCase(*TP, (2, M // 2, K), P(None, "data", None), P(None, "model"), frozenset({"dx", "dw"})),
}


def _dims(x_ndim):
    return (((x_ndim - 1,), (0,)), ((), ()))


def _train_step(dot, x_ndim, fixed_cotangent):
    """(loss, y), (dx, dW) of ``sum(y.astype(f32) ** 2)``; with ``fixed_cotangent`` of ``sum(y * c)``
    instead: where the forward's K is split, y (and so 2y) may differ from the one-device y in its last
    bit, and the backward is compared on the same output gradient."""
    def loss(x, w, c):
        y = dot(x, w, _dims(x_ndim))
        y32 = y.astype(jnp.float32)
        return (jnp.sum(y32 * c) if fixed_cotangent else jnp.sum(y32 ** 2)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@lru_cache(maxsize=None)
def _gemm_data(x_shape):
    """One set of operands per x shape, shared by the cases and modes of that shape: the unsharded
    reference (``_gemm_reference``) is computed once per shape."""
    rng = np.random.default_rng(stable_seed("gemm data", x_shape))
    x = rng.standard_normal(x_shape).astype(jnp.bfloat16)
    w = (rng.standard_normal((K, N)) / 32).astype(jnp.bfloat16)
    c = rng.standard_normal((*x_shape[:-1], N)).astype(np.float32)
    return x, w, c


@lru_cache(maxsize=None)
def _gemm_reference(x_shape, fixed_cotangent):
    """The fp8 step on one device, unsharded."""
    x, w, c = _gemm_data(x_shape)
    (_, y), (dx, dw) = _train_step(jf.fp8_dot_general, len(x_shape), fixed_cotangent)(
        *jax.device_put((x, w, c), _CPU))
    return {"y": np.asarray(y), "dx": np.asarray(dx), "dw": np.asarray(dw)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_fp8_dot_general_partitions_like_lax(case, mode):
    cfg = GEMM_CASES[case]
    mesh = _mesh(cfg.mesh, cfg.names, mode)
    x, w, c = _gemm_data(cfg.x_shape)
    y_spec = P(*cfg.x_spec[:-1], None)
    args = _put(x, mesh, cfg.x_spec), _put(w, mesh, cfg.w_spec), _put(c, mesh, y_spec)
    fixed = "y" in cfg.split

    fp8 = _train_step(jf.fp8_dot_general, x.ndim, fixed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)  # aligned shards: no warning
        warnings.simplefilter("error", Fp8GemmFallbackWarning)  # and every GEMM in FP8
        compiled = fp8.lower(*args).compile()
        (_, y), (dx, dw) = compiled(*args)

    # values: those of the same step on one device
    ref = _gemm_reference(cfg.x_shape, fixed)
    for what, got in (("y", y), ("dx", dx), ("dw", dw)):
        if what in cfg.split:
            assert_close_reassociated(got, ref[what], what)
        else:
            assert_bits_equal(got, ref[what], what)

    # communication: never the activations; the weight (FSDP) as FP8 bytes; no more than lax
    colls = collectives(compiled.as_text())
    assert not _large(colls, "all-to-all", "collective-permute"), colls
    gathers = _large(colls, "all-gather")
    if cfg.fsdp:
        assert gathers and all(g.dtype == "u8" for g in gathers), gathers
        assert all(g.size <= w.size for g in gathers), gathers  # a weight's bytes, never x's
    else:
        assert not gathers, gathers

    laxed = _train_step(lax.dot_general, x.ndim, fixed)
    try:
        lax_compiled = laxed.lower(*args).compile()
    except Exception as e:  # an Explicit mesh: lax asks for out_sharding where the contraction is split
        if mode == "auto" or "out_sharding" not in str(e):
            raise
        # fp8 needed none: compare with lax told to shard y as it does on an Auto mesh
        out = NamedSharding(mesh, y_spec)
        laxed = _train_step(lambda a, b, dims: lax.dot_general(a, b, dims, out_sharding=out), x.ndim, fixed)
        lax_compiled = laxed.lower(*args).compile()
    (_, y_lax), (dx_lax, dw_lax) = lax_compiled(*args)
    lax_colls = collectives(lax_compiled.as_text())
    if cfg.fsdp:
        lax_gathers = _large(lax_colls, "all-gather")
        assert sum(g.nbytes for g in gathers) <= sum(g.nbytes for g in lax_gathers), (gathers, lax_gathers)
    else:
        assert not _large(lax_colls, "all-gather"), lax_colls
    reduce = _large(colls, "all-reduce", "reduce-scatter")
    lax_reduce = _large(lax_colls, "all-reduce", "reduce-scatter")
    assert len(reduce) <= len(lax_reduce), (reduce, lax_reduce)
    assert sum(r.nbytes for r in reduce) <= sum(r.nbytes for r in lax_reduce), (reduce, lax_reduce)

    # the results are sharded as lax's
    for what, got, want in (("y", y, y_lax), ("dx", dx, dx_lax), ("dw", dw, dw_lax)):
        assert _norm(got.sharding.spec, got.ndim) == _norm(want.sharding.spec, want.ndim), \
            (what, got.sharding.spec, want.sharding.spec)

    ours, theirs = compiled.memory_analysis().temp_size_in_bytes, lax_compiled.memory_analysis().temp_size_in_bytes
    print(f"\n{case} ({mode}): temp bytes per device: fp8 {ours}, lax {theirs} ({ours / theirs:.2f}x)")
    # a guard against multiples (a gathered operand once made it 10x): the FP8 step holds its FP8 copies
    # and fp32 GEMM results beside lax's; at tp-row jax 0.12.1's lax needs 2.10 MB where 0.12.0's took
    # 2.62, ours 4.22 MB under both (2.01x and 1.61x)
    assert ours <= 2.5 * theirs, (ours, theirs)


# ---- 5. vmap inside jit on sharded inputs --------------------------------------------------------------
VMAPPED = {
    "leading axis split": ((8,), ("data",), P("data", None, None), (8, 256, 256),
                           lambda v: jf.quantize_blockwise(v, block=(128, 128), colwise=True)),
    "rows split": ((8,), ("data",), P(None, "data", None), (4, 1024, 256),
                   lambda v: jf.quantize_blockwise(v, colwise=True)),
    "rows and cols split, gemm_ready": ((4, 2), ("data", "model"), P(None, "data", "model"), (4, 512, 256),
                                        lambda v: jf.quantize_blockwise(v, colwise=True, layout="gemm_ready")),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(VMAPPED))
def test_vmap_inside_jit_on_sharded_input(case, mode):
    mesh_shape, names, spec, shape, quant = VMAPPED[case]
    mesh = _mesh(mesh_shape, names, mode)
    x = random_input(np.random.default_rng(stable_seed("vmap in jit", case, mode)), shape, jnp.bfloat16)
    xs = _put(x, mesh, spec)
    f = jax.jit(jax.vmap(lambda v: (quant(v), jf.dequantize(quant(v), usage="colwise"))))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)
        compiled = f.lower(xs).compile()
        (q, y), (q_ref, y_ref) = compiled(xs), f(jax.device_put(x, _CPU))
    assert_tensors_equal(q, q_ref)
    assert_bits_equal(y, y_ref, "dequantize")
    _assert_sharded_as(q.rowwise_data, mesh, spec, "rowwise_data")
    _assert_sharded_as(y, mesh, spec, "dequantize")
    assert not _large(collectives(compiled.as_text()), "all-gather", "all-reduce", "all-to-all",
                      "collective-permute", "reduce-scatter")
