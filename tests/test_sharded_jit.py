"""Sharded arrays under plain ``jax.jit`` (no ``shard_map``): every jax_fp8 op partitions as the ``lax``
code it replaces.

Inputs are ``NamedSharding`` arrays on meshes of the 8 simulated CPU devices, built by
``jax.make_mesh`` with ``AxisType.Auto`` axes ("auto") and with its default axis types, Explicit
("default"). Each op is checked against the same call on one device:

- values: bit for bit, except where a contraction is split over devices (a sum of fp32 partial
  products in another order: within one ulp of the output dtype, plus 2**-20 of the largest value);
- placement: the data outputs are sharded as the input (the transposed GEMM-ready data transposed);
- communication, read from the compiled HLO: no collective moves the data (quantize: at most a small
  all-gather of a padded GEMM-ready fp32 scale grid); the FP8 GEMM's collectives are no more than those
  of ``lax.dot_general`` on the same operands, an FSDP weight travels as FP8 bytes (u8), and the output
  and gradient shardings and the per-device temp memory (within 2x) match lax's.

The shard_map-only collectives' errors under plain jit are covered by
``test_shard_map.py::test_collectives_under_plain_jit_say_they_need_shard_map``.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import ShardingWarning
from helpers import assert_bits_equal, assert_tensors_equal, random_input, stable_seed

_CPU = jax.devices("cpu")[0]  # the meshes are CPU devices: the unsharded references run there too
KN = (((1,), (0,)), ((), ()))  # x (M, K) @ W (K, N)
MODES = ["auto", "default"]
SMALL = 4096  # bytes: a collective at most this large moves scales, never data


def _mesh(shape, names, mode):
    devices = jax.devices("cpu")[:int(np.prod(shape))]
    if mode == "auto":
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
    return jax.make_mesh(shape, names, devices=devices)  # jax's default axis types (Explicit)


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _norm(spec, ndim):
    """A PartitionSpec as one tuple of mesh axes per dim (trailing Nones and 1-tuples normalised)."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(() if e is None else tuple(e) if isinstance(e, (tuple, list)) else (e,) for e in entries)


def _local_shape(shape, mesh, spec):
    sizes = dict(mesh.shape)
    return tuple(n // int(np.prod([sizes[a] for a in axes])) for n, axes in zip(shape, _norm(spec, len(shape))))


def _assert_sharded_as(out, mesh, spec, what):
    """``out`` is laid out as ``spec`` says: its normalised spec and its first shard's shape."""
    assert _norm(out.sharding.spec, out.ndim) == _norm(spec, out.ndim), (what, out.sharding.spec, spec)
    assert out.addressable_shards[0].data.shape == _local_shape(out.shape, mesh, spec), \
        (what, out.addressable_shards[0].data.shape, out.shape, spec)


# ---- the compiled HLO's collectives ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # all-gather, all-reduce, ...
    dtype: str  # HLO element type: f32, bf16, u8, ...
    shape: tuple

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        bits = re.search(r"\d+", self.dtype)
        return self.size * (int(bits.group()) // 8 if bits else 1)


_COLLECTIVE = re.compile(r"=\s*(\([^)]*\)|\S+)\s+(all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled module, one entry per array it produces (a combined all-reduce
    of a tuple counts each array; an async all-gather-start its outputs)."""
    out = []
    for m in _COLLECTIVE.finditer(hlo):
        arrays = _ARRAY.findall(m.group(1))
        if m.group(3) and m.group(2) == "all-gather":  # (operands, outputs)
            arrays = arrays[len(arrays) // 2:]
        out += [Collective(m.group(2), dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in arrays]
    return out


def _large(colls, *kinds):
    return [c for c in colls if c.kind in kinds and c.nbytes > SMALL]


def test_collectives_parser():
    """The HLO reader sees every collective (else the 'no gather' checks below would prove nothing):
    on lines of XLA's forms, and in what lax's own FSDP matmul compiles to."""
    hlo = """
      %all-gather = f32[1,256,200]{1,0,2} all-gather(%copy_bitcast_fusion), channel_id=1, dimensions={2}
      %all-reduce.1 = (f32[], f32[512,1024]{1,0}) all-reduce(%ynn_fusion.5, %while.8), channel_id=2
      %ags = (u8[128,1024]{1,0}, u8[1024,1024]{1,0}) all-gather-start(%p), dimensions={0}
      %agd = u8[1024,1024]{1,0} all-gather-done(%ags)
      %a2a = bf16[8,64]{1,0} all-to-all(%x), dimensions={0}
      %cp = f8e4m3fn[64,64]{1,0} collective-permute(%y), source_target_pairs={{0,1}}
    """
    assert collectives(hlo) == [
        Collective("all-gather", "f32", (1, 256, 200)), Collective("all-reduce", "f32", ()),
        Collective("all-reduce", "f32", (512, 1024)), Collective("all-gather", "u8", (1024, 1024)),
        Collective("all-to-all", "bf16", (8, 64)), Collective("collective-permute", "f8e4m3fn", (64, 64))]
    assert [c.nbytes for c in collectives(hlo)] == [204800, 4, 2 << 20, 1 << 20, 1024, 4096]

    mesh = _mesh((8,), ("data",), "auto")
    rng = np.random.default_rng(stable_seed("collectives parser"))
    x = _put(rng.standard_normal((256, 1024)).astype(np.float32), mesh, P("data", None))
    w = _put(rng.standard_normal((1024, 384)).astype(np.float32), mesh, P("data", None))
    colls = collectives(jax.jit(lambda a, b: jnp.sum(a @ b)).lower(x, w).compile().as_text())
    assert ("f32", 1024 * 384) in [(c.dtype, c.size) for c in _large(colls, "all-gather")], colls  # the weight


# ---- 1. quantize / dequantize: split where the input is, bit for bit ------------------------------------
QUANTIZERS = {
    "blockwise-1x128": lambda v, layout: jf.quantize_blockwise(v, block=(1, 128), rowwise=True, colwise=True,
                                                               layout=layout),
    "blockwise-128x128": lambda v, layout: jf.quantize_blockwise(v, block=(128, 128), rowwise=True, colwise=True,
                                                                 layout=layout),
    "mxfp8": lambda v, layout: jf.quantize_mxfp8(v, rowwise=True, colwise=True, layout=layout),
}
#: name: (mesh shape, axis names, input spec, global shape); every shard holds whole 128x128 tiles
SPLITS = {
    "rows": ((8,), ("data",), P("data", None), (1024, 256)),
    "cols": ((4, 2), ("data", "model"), P(None, "model"), (256, 512)),
    "rows+cols": ((4, 2), ("data", "model"), P("data", "model"), (512, 512)),
}


#: every split on an Auto mesh; Explicit (jax.make_mesh's default) on the one that splits both dims
SPLIT_MODES = [(split, "auto") for split in SPLITS] + [("rows+cols", "default")]


def _check_hlo_moves_only_scales(hlo, scale_bytes, what):
    """No collective but all-gathers of fp32 scale grids (each at most one whole grid's bytes)."""
    colls = collectives(hlo)
    others = [c for c in colls if c.kind != "all-gather"]
    assert not others, (what, others)
    bad = [c for c in colls if c.dtype != "f32" or c.nbytes > scale_bytes]
    assert not bad, (what, f"all-gathers beyond a {scale_bytes}-byte scale grid", bad)


def _data_specs(q, spec):
    """(data leaf, the spec it should have): the input's, transposed for GEMM-ready columnwise data."""
    out = []
    for usage in q.usage_blocks():
        data = getattr(q, f"{usage}_data")
        transposed = usage == "colwise" and q.layout == "gemm_ready"
        out.append((usage, data, P(*reversed(_norm(spec, 2))) if transposed else spec))
    return out


def _scale_bytes(q):
    return max(np.asarray(getattr(q, f"{u}_scale_inv")).nbytes for u in q.usage_blocks())


@pytest.mark.parametrize("split,mode", SPLIT_MODES)
@pytest.mark.parametrize("layout", ["compact", "gemm_ready"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantize_and_dequantize_stay_split(name, layout, split, mode):
    mesh_shape, names, spec, shape = SPLITS[split]
    mesh = _mesh(mesh_shape, names, mode)
    rng = np.random.default_rng(stable_seed("stay split", name, layout, split, mode))
    x = random_input(rng, shape, jnp.bfloat16)
    xs = _put(x, mesh, spec)
    quant = jax.jit(lambda v: QUANTIZERS[name](v, layout))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)  # aligned shards: nothing to gather
        compiled = quant.lower(xs).compile()
        q, ref = compiled(xs), quant(jax.device_put(x, _CPU))
        assert_tensors_equal(q, ref)
        for usage, data, want in _data_specs(q, spec):
            _assert_sharded_as(data, mesh, want, f"{usage}_data")
        _check_hlo_moves_only_scales(compiled.as_text(), _scale_bytes(ref), "quantize")

        # dequantize each usage of the sharded tensor (as the quantize left it), in another jit
        deq = jax.jit(lambda t: tuple(jf.dequantize(t, usage=u) for u in t.usage_blocks()))
        compiled = deq.lower(q).compile()
        ys, y_ref = compiled(q), deq(ref)
        for u, y, r in zip(q.usage_blocks(), ys, y_ref):
            assert_bits_equal(y, r, f"dequantize {u}")
            _assert_sharded_as(y, mesh, spec, f"dequantize {u}")
        _check_hlo_moves_only_scales(compiled.as_text(), _scale_bytes(ref), "dequantize")


QDQ = {
    "mxfp8": dict(fmt="mxfp8"),
    "blockwise-1x128": dict(fmt="blockwise", block=(1, 128)),
    "blockwise-128x128": dict(fmt="blockwise", block=(128, 128)),
}


@pytest.mark.parametrize("split,mode", SPLIT_MODES)
@pytest.mark.parametrize("name", list(QDQ))
def test_quantize_dequantize_stays_split(name, split, mode):
    mesh_shape, names, spec, shape = SPLITS[split]
    mesh = _mesh(mesh_shape, names, mode)
    x = random_input(np.random.default_rng(stable_seed("qdq split", name, split, mode)), shape, jnp.bfloat16)
    xs = _put(x, mesh, spec)
    f = jax.jit(lambda v: tuple(jf.quantize_dequantize(v, usage=u, **QDQ[name]) for u in ("rowwise", "colwise")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)
        compiled = f.lower(xs).compile()
        ys, refs = compiled(xs), f(jax.device_put(x, _CPU))
        for u, y, r in zip(("rowwise", "colwise"), ys, refs):
            assert_bits_equal(y, r, u)
            _assert_sharded_as(y, mesh, spec, u)
        colls = collectives(compiled.as_text())
    assert not colls, colls  # compact scales: nothing to pad, nothing to move


# ---- 2. shards that split a block: the dim is gathered, one warning names it -----------------------------
#: name: (mesh shape, axis names, spec, shape, scheme, words in the warning, {dim: local size} kept split)
MISALIGNED = {
    "last dim 200 over 2 (1x128)": ((4, 2), ("data", "model"), P(None, "model"), (256, 200),
                                    lambda v: jf.quantize_blockwise(v, colwise=True), "last dim", {}),
    "last dim 200 over 2 (mxfp8)": ((4, 2), ("data", "model"), P(None, "model"), (256, 200),
                                    lambda v: jf.quantize_mxfp8(v, colwise=True), "last dim", {}),
    "last dim 200 over 2, rows split": ((4, 2), ("data", "model"), P("data", "model"), (256, 200),
                                        lambda v: jf.quantize_blockwise(v), "last dim", {0: 64}),
    "last dim 512 over 8 (1x128)": ((8,), ("data",), P(None, "data"), (64, 512),
                                    lambda v: jf.quantize_blockwise(v), "last dim", {}),
    "96-row shards over 4, colwise": ((4, 2), ("data", "model"), P("data", "model"), (384, 256),
                                      lambda v: jf.quantize_blockwise(v, colwise=True), "rows", {1: 128}),
    "96-row shards over 8, colwise": ((8,), ("data",), P("data", None), (768, 256),
                                      lambda v: jf.quantize_blockwise(v, colwise=True), "rows", {}),
    "64-row shards over 4, colwise, cols split": ((4, 2), ("data", "model"), P("data", "model"), (256, 512),
                                                  lambda v: jf.quantize_blockwise(v, colwise=True), "rows", {1: 256}),
}


@pytest.mark.parametrize("case,mode", [(case, "auto") for case in MISALIGNED] + [
    (case, "default") for case in ("last dim 200 over 2 (1x128)", "96-row shards over 4, colwise",
                                   "96-row shards over 8, colwise")])
def test_misaligned_shards_gather_that_dim_with_one_warning(case, mode):
    mesh_shape, names, spec, shape, quant, words, kept = MISALIGNED[case]
    mesh = _mesh(mesh_shape, names, mode)
    x = random_input(np.random.default_rng(stable_seed("misaligned", case, mode)), shape, jnp.bfloat16)
    f = jax.jit(quant)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = f(_put(x, mesh, spec))
    ours = [w for w in caught if issubclass(w.category, ShardingWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert words in str(ours[0].message) and "gathered" in str(ours[0].message), str(ours[0].message)
    assert_tensors_equal(q, f(jax.device_put(x, _CPU)))
    for dim, local in kept.items():  # the other, aligned dim stays split
        assert q.rowwise_data.addressable_shards[0].data.shape[dim] == local, q.rowwise_data.sharding


def assert_close_reassociated(got, want, what):
    """``got`` equals ``want`` up to the order of an fp32 sum: within one ulp of ``got``'s dtype at the
    larger magnitude (the fp32 sums may round either way) plus 2**-20 of the largest ``|want|``."""
    mant = jnp.finfo(got.dtype).nmant
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape and np.isfinite(w).all(), what
    mag = np.maximum(np.abs(g), np.abs(w))
    ulp = np.exp2(np.floor(np.log2(np.where(mag > 0, mag, 1.0))) - mant)
    tol = ulp + 2.0 ** -20 * np.max(np.abs(w))
    bad = np.flatnonzero(~(np.abs(g - w) <= tol))
    assert bad.size == 0, (f"{what}: {bad.size} of {g.size} differ beyond reassociation; worst "
                           f"{np.max(np.abs(g - w) / tol):.3g}x the tolerance")


# ---- the edges of a scale grid's layout --------------------------------------------------------------
def test_tile_shards_whose_padding_would_sit_mid_grid():
    """128x128 tiles in the GEMM-ready layout, 3 tiles per shard: each shard pads its grid to 4, the
    whole grid pads 6 tiles to 8. The shards' grids do not tile the whole one (padding mid-grid), so
    the grid is gathered, the data stay split, and the bits are the unsharded call's; through
    fp8_dot_general, dW is the unsharded one's, and dx (on that weight's other orientation, its
    contraction over N split) too, within reassociation."""
    mesh = _mesh((2,), ("fsdp",), "auto")
    rng = np.random.default_rng(stable_seed("tile shards padding mid grid"))
    w = rng.standard_normal((256, 768)).astype(np.float32)
    scheme = jf.Float8BlockScaling().scheme("rhs")
    want = jax.jit(partial(jf.quantize, scheme=scheme))(jax.device_put(w, _CPU))
    got = jax.jit(partial(jf.quantize, scheme=scheme))(_put(w, mesh, P(None, "fsdp")))
    assert_tensors_equal(got, want)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jf.fp8_dot_general(x, w, KN) ** 2), argnums=(0, 1)))
    (dx, dw), (dx_ref, dw_ref) = (grad(_put(x, mesh, P()), _put(w, mesh, P(None, "fsdp"))),
                                  grad(jax.device_put(x, _CPU), jax.device_put(w, _CPU)))
    assert_bits_equal(np.asarray(dw), np.asarray(dw_ref), "dW")
    assert_close_reassociated(np.asarray(dx), np.asarray(dx_ref), "dx")


@pytest.mark.parametrize("mode", MODES)
def test_one_block_wide_operands(mode):
    """K = 128, one block: a scale grid of one column (no compound Shardy factor of size 1) on a mesh."""
    mesh = _mesh((8,), ("data",), mode)
    rng = np.random.default_rng(stable_seed("one block wide", mode))
    x, w = rng.standard_normal((1024, 128)).astype(np.float32), rng.standard_normal((128, 256)).astype(np.float32)
    f = jax.jit(lambda x, w: jf.fp8_dot_general(x, w, KN))
    got = f(_put(x, mesh, P("data", None)), _put(w, mesh, P()))
    assert_bits_equal(np.asarray(got), np.asarray(f(jax.device_put(x, _CPU), jax.device_put(w, _CPU))))
    _assert_sharded_as(got, mesh, P("data", None), "y")


@pytest.mark.parametrize("mode", MODES)
def test_a_split_over_two_axes_that_no_spec_can_name(mode):
    """Rows split over ("a", "b") of a (2, 4) mesh, 64 per shard, 4 columnwise blocks in all: Shardy may
    give the block grid a piece of "b" (a sub-axis no PartitionSpec names). The rule reads such a split
    as replicated: compiles, bits equal, the rows kept split over "a" alone, one warning saying why."""
    mesh = _mesh((2, 4), ("a", "b"), mode)
    rng = np.random.default_rng(stable_seed("split over two axes", mode))
    x = rng.standard_normal((512, 256)).astype(np.float32)
    f = jax.jit(lambda v: jf.quantize_blockwise(v, rowwise=True, colwise=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(_put(x, mesh, P(("a", "b"), None)))
    assert_tensors_equal(got, f(jax.device_put(x, _CPU)))
    assert any(issubclass(w.category, ShardingWarning) and "rows" in str(w.message) for w in caught)
    dims = (((1,), (0,)), ((), ()))
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jf.fp8_dot_general(x, w, dims) ** 2), argnums=(0, 1)))
    w = rng.standard_normal((256, 256)).astype(np.float32) / 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)
        got = grad(_put(x, mesh, P(("a", "b"), None)), _put(w, mesh, P(("a", "b"), None)))
    for g, r, what in zip(got, grad(jax.device_put(x, _CPU), jax.device_put(w, _CPU)), ("dx", "dw")):
        assert_close_reassociated(np.asarray(g), np.asarray(r), what)


# ---- the stacked quantize of fp8_dot_general's (B, S, K) operands ------------------------------------
def _stacked_vs_folded(x3, scheme):
    """The stacked outputs, and the folded (B*S, K) quantize's outputs reshaped to the stacked layout."""
    from jax_fp8.quantization import quantize_stacked

    B, S, K = x3.shape
    folded = jf.quantize(x3.reshape(B * S, K), scheme)
    want = {"rowwise": (folded.rowwise_data.reshape(B, S, K), folded.rowwise_scale_inv.reshape(-1, B, S)),
            "colwise": (folded.colwise_data.reshape(K, B, S), folded.colwise_scale_inv.reshape(B, S // 128, -1))}
    return quantize_stacked(x3, scheme), want


@pytest.mark.parametrize("mode", MODES)
def test_stacked_quantize_is_the_folded_one_reshaped_and_stays_split(mode):
    """``fp8_dot_general``'s stacked operands: each output of the (B, S, K) quantize is the (B*S, K)
    quantize's output reshaped (so the GEMM folds it back with no copy), bit for bit, on one device,
    under vmap, and split over B and S (2 x 4 devices) with every output split and no data moved."""
    scheme = jf.Float8BlockScaling().scheme("lhs")
    x3 = jnp.asarray(random_input(np.random.default_rng(stable_seed("stacked quantize")), (4, 512, 384), jnp.bfloat16))
    got, want = _stacked_vs_folded(x3, scheme)
    for usage in ("rowwise", "colwise"):
        for g, w, what in zip(got[usage], want[usage], ("data", "scales")):
            assert_bits_equal(g, w, f"{usage} {what}")

    batched = jax.vmap(lambda x: jf.quantization.quantize_stacked(x, scheme))(jnp.stack([x3[:2], x3[2:]]))
    b_dims = {"rowwise": (0, 1), "colwise": (1, 0)}  # where B sits in the data and the scales
    for usage in ("rowwise", "colwise"):
        for v, g, at in zip(batched[usage], got[usage], b_dims[usage]):
            assert_bits_equal(jnp.concatenate([v[0], v[1]], axis=at), g, f"vmap {usage}")

    mesh = _mesh((2, 4), ("b", "s"), mode)
    xs = _put(x3, mesh, P("b", "s", None))
    fn = jax.jit(lambda x: jf.quantization.quantize_stacked(x, scheme))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)
        compiled = fn.lower(xs).compile()
    out = compiled(xs)
    assert not _large(collectives(compiled.as_text()), "all-gather", "all-to-all", "collective-permute", "all-reduce")
    specs = {"rowwise": (P("b", "s", None), P(None, "b", "s")), "colwise": (P(None, "b", "s"), P("b", "s", None))}
    for usage in ("rowwise", "colwise"):
        for o, w, spec, what in zip(out[usage], got[usage], specs[usage], ("data", "scales")):
            assert_bits_equal(o, w, f"split {usage} {what}")
            _assert_sharded_as(o, mesh, spec, f"{usage} {what}")


def test_stacked_quantize_refuses_what_does_not_fold():
    from jax_fp8.primitives import quantize_p

    x3 = jnp.zeros((2, 192, 256), jnp.float32)
    with pytest.raises(ValueError, match="stacked sequences take GEMM-ready 1x128 blocks and rows"):
        quantize_p.bind(x3, scheme=jf.Float8BlockScaling().scheme("lhs"), stacked=True)  # S = 192
    with pytest.raises(ValueError, match="stacked sequences"):
        quantize_p.bind(x3[:, :128], scheme=jf.Float8BlockScaling().scheme("rhs"), stacked=True)  # 128x128 tiles
