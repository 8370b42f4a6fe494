"""Distributed master-weight cast on simulated CPU devices: gathered FP8 shards equal single-device
quantization bit for bit, and the scales take exactly one all-reduce (uint8 for MXFP8)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import Scheme
from jax import shard_map
from jax_fp8.distributed import gather_master_weights, local_shards, quantize_master_weights, split_masters
from helpers import assert_bits_equal, assert_tensors_equal, on_cpu, random_input, replicated, stable_seed

SHAPES = [(64, 96), (33, 70), (1, 31), (129, 257), (5, 3), (40, 128)]


def _mesh(n):
    return Mesh(np.array(jax.devices("cpu")[:n]), ("data",))


def _split(rng, size, n, even):
    """Per-rank (offset, length) of a flat weight: an even ZeRO split or random cut points (empty shards too)."""
    if even:
        L = -(-size // n)
        return np.arange(n) * L, np.full(n, L), L
    cuts = np.sort(rng.integers(0, size + 1, n - 1))
    starts = np.r_[0, cuts]
    lens = np.r_[cuts, size] - starts
    return starts, lens, max(1, int(lens.max()))


def _run(masters, n, even, seed, **kw):
    rng = np.random.default_rng(seed)
    bufs, offs, lens = [], [], []
    for w in masters:
        flat = np.asarray(w).reshape(-1)
        o, l, L = _split(rng, flat.size, n, even)
        buf = np.zeros((n, L), np.float32)
        for r in range(n):
            seg = flat[o[r]:o[r] + l[r]]  # the even split's last rank runs past the end: lengths get clipped
            buf[r, :seg.size] = seg
        bufs.append(buf), offs.append(o.astype(np.int32)), lens.append(l.astype(np.int32))
    shapes = [w.shape for w in masters]

    def step(bufs, offs, lens):
        qs = quantize_master_weights([b[0] for b in bufs], shapes, "data", offsets=[o[0] for o in offs],
                                     lengths=[l[0] for l in lens], **kw)
        return gather_master_weights(qs, "data")

    call, f = replicated(step, _mesh(n), (P("data"), P("data"), P("data")), "data")
    return call(bufs, offs, lens), f, (bufs, offs, lens)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("even", [True, False], ids=["even", "random-cuts"])
def test_mxfp8_gathered_equals_single_device(n, even):
    rng = np.random.default_rng(stable_seed("mxfp8 gathered", n, even))
    masters = [random_input(rng, s, jnp.float32) for s in SHAPES]
    for model_dtype, fp8 in [(jnp.bfloat16, jnp.float8_e4m3fn), (None, jnp.float8_e5m2), (jnp.float16, jnp.float8_e4m3fn)]:
        got, _, _ = _run(masters, n, even, seed=stable_seed("mxfp8 gathered cuts", n, even, model_dtype, fp8),
                         model_dtype=model_dtype, dtype=fp8)
        for w, q in zip(masters, got):
            with np.errstate(over="ignore"):  # huge fp32 values become inf in fp16, as on the device
                x = w if model_dtype is None else w.astype(model_dtype)
            want = jf.quantize_mxfp8(x, fp8, rowwise=True, colwise=True)
            assert_tensors_equal(q, want)
            assert_tensors_equal(q, on_cpu(jf.reference.quantize_mxfp8, x, dtype=fp8, rowwise=True, colwise=True))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=str)
@pytest.mark.parametrize("n", [2, 8])
def test_blockwise_gathered_equals_single_device(block, n):
    rng = np.random.default_rng(stable_seed("blockwise gathered", block, n))
    masters = [random_input(rng, s, jnp.float32) for s in [(130, 300), (64, 96), (1, 200), (257, 129)]]
    got, _, _ = _run(masters, n, False, seed=stable_seed("blockwise gathered cuts", block, n), fmt="blockwise",
                     block=block, amax_epsilon=1e-6)
    for w, q in zip(masters, got):
        want = jf.quantize_blockwise(w.astype(jnp.bfloat16), block=block, amax_epsilon=1e-6, colwise=True)
        assert_tensors_equal(q, want)


def _all_reduces(hlo: str):
    return re.findall(r"= (\w+)\[(\d+)\]\{0\} all-reduce(?:-start)?\(", hlo)


def test_one_uint8_all_reduce_half_the_bytes_of_bf16():
    masters = [np.ones(s, np.float32) for s in SHAPES]
    n = 8
    shapes = [w.shape for w in masters]
    L = [-(-w.size // n) for w in masters]

    def step(*bufs):
        qs = quantize_master_weights([b[0] for b in bufs], shapes, "data")
        return [q.tensor.rowwise_data[None] for q in qs]

    f = jax.jit(shard_map(step, mesh=_mesh(n), in_specs=P("data"), out_specs=P("data")))
    hlo = f.lower(*[np.zeros((n, l), np.float32) for l in L]).compile().as_text()
    ars = _all_reduces(hlo)
    assert len(ars) == 1, ars
    dtype, count = ars[0][0], int(ars[0][1])
    n_scales = sum(-(-M // 1) * -(-K // 32) + -(-M // 32) * K for M, K in shapes)
    # one byte per block: half the payload of a bf16 amax all-reduce (2 bytes per block)
    assert dtype == "u8" and count == n_scales


def test_blockwise_reduces_amax_bits_once():
    """Blockwise: one all-reduce of the fp32 amaxes as uint32 bit patterns (a float pmax may flush
    subnormal amaxes; XLA's CPU one does)."""
    n, shapes = 4, [(130, 300), (64, 96)]

    def step(*bufs):
        qs = quantize_master_weights([b[0] for b in bufs], shapes, "data", fmt="blockwise", block=(128, 128))
        return [q.tensor.rowwise_data[None] for q in qs]

    f = jax.jit(shard_map(step, mesh=_mesh(n), in_specs=P("data"), out_specs=P("data")))
    hlo = f.lower(*[np.zeros((n, -(-M * K // n)), np.float32) for M, K in shapes]).compile().as_text()
    ars = _all_reduces(hlo)
    assert [a[0] for a in ars] == ["u32"] and int(ars[0][1]) == 2 * 3 + 1 * 1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 2.0**100, width=32, allow_subnormal=True), min_size=4 * 8, max_size=4 * 8))
def test_pmax_of_e8m0_equals_e8m0_of_pmax(values):
    """Through the real collective: max over ranks of E8M0 bytes == E8M0 of the max amax."""
    a = np.array(values, np.float32).reshape(4, 8)

    def f(a):
        return (jax.lax.pmax(jf.reference.e8m0_from_amax(a), "data"), jf.reference.e8m0_from_amax(jax.lax.pmax(a, "data")))

    g = jax.jit(shard_map(f, mesh=_mesh(4), in_specs=P("data"), out_specs=P("data")))
    s1, s2 = g(a)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))


@pytest.mark.parametrize("kw", [dict(), dict(fmt="blockwise", block=(128, 128), amax_epsilon=1e-6),
                                dict(fmt="blockwise", dtype=jnp.float8_e5m2, colwise=False)], ids=str)
def test_scheme_keyword_equals_loose_keywords(kw):
    """scheme=Scheme(...) and the keywords that build the same scheme give the same bits."""
    rng = np.random.default_rng(stable_seed("scheme keyword", str(kw)))
    masters = [random_input(rng, s, jnp.float32) for s in [(130, 300), (33, 70)]]
    seed = stable_seed("scheme keyword cuts", str(kw))
    loose, _, _ = _run(masters, 3, False, seed=seed, **kw)
    fmt = kw.get("fmt", "mxfp8")
    scheme = Scheme(fmt, kw.get("dtype", jnp.float8_e4m3fn), rowwise=True, colwise=kw.get("colwise", True),
                    **{k: v for k, v in kw.items() if k in ("block", "amax_epsilon")})
    named, _, _ = _run(masters, 3, False, seed=seed, scheme=scheme)
    for q, r, w in zip(named, loose, masters):
        assert q.scheme == scheme
        assert_tensors_equal(q, r)
        assert_tensors_equal(q, jf.quantize(w.astype(jnp.bfloat16), scheme))


def test_scheme_keyword_errors():
    """scheme= together with a keyword that builds one, a non-Scheme, a GEMM-ready or a
    saturate_inf=False scheme: errors that name the argument."""
    def call(**kw):
        shard_map(lambda b: quantize_master_weights([b[0]], [(2, 4)], "data", **kw), mesh=_mesh(2),
                  in_specs=P("data"), out_specs=P())(np.zeros((2, 4), np.float32))

    with pytest.raises(TypeError, match=r"either scheme= or the keywords.*colwise, fmt"):
        call(scheme=Scheme("mxfp8"), fmt="mxfp8", colwise=True)
    with pytest.raises(TypeError, match="scheme must be a jax_fp8.Scheme"):
        call(scheme="mxfp8")
    with pytest.raises(ValueError, match="scheme.layout must be 'compact'"):
        call(scheme=Scheme("blockwise", layout="gemm_ready"))
    with pytest.raises(ValueError, match="saturate_inf=True"):
        call(scheme=Scheme("blockwise", saturate_inf=False))


def test_empty_shards_and_errors():
    """Ranks that hold nothing of a weight still join the one pmax; bad arguments are rejected."""
    masters = [random_input(np.random.default_rng(0), (3, 40), jnp.float32)]
    got, _, _ = _run(masters, 8, False, seed=3)  # 120 elements over 8 ranks with random cuts: some empty
    assert_tensors_equal(got[0], jf.quantize_mxfp8(masters[0].astype(jnp.bfloat16), colwise=True))
    with pytest.raises(ValueError, match="shapes"):
        shard_map(lambda b: quantize_master_weights([b[0]], [], "data"), mesh=_mesh(2), in_specs=P("data"),
                  out_specs=P())(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="fmt"):
        shard_map(lambda b: quantize_master_weights([b[0]], [(2, 4)], "data", fmt="x"), mesh=_mesh(2),
                  in_specs=P("data"), out_specs=P())(np.zeros((2, 4), np.float32))


def _on_dirty_memory(f, *args):
    """f(*args) right after buffers of its outputs' sizes were filled with 0xAB and freed, so that the
    allocator likely hands them out again: outputs that a kernel leaves unwritten show up."""
    for r in jax.tree_util.tree_leaves(jax.eval_shape(f, *args)):
        dirty = jnp.full((r.size * r.dtype.itemsize,), 0xAB, jnp.uint8)
        jax.block_until_ready(dirty)
        del dirty
    return f(*args)


_SCHEMES = {"mxfp8": Scheme("mxfp8", rowwise=True, colwise=True),
            "blk1d": Scheme("blockwise", rowwise=True, colwise=True),
            "blk2d": Scheme("blockwise", block=(128, 128))}


def _rank_groups(rng, weights, n, even):
    """Per rank: the (N, 2) int32 windows and the N flat shards of a group of weights split over n ranks."""
    windows = []
    for w in weights:
        flat = np.asarray(w).reshape(-1)
        offs, lens, L = _split(rng, flat.size, n, even)
        bufs = []
        for o, l in zip(offs, lens):
            buf = np.zeros(L, flat.dtype)
            seg = flat[o:o + l]
            buf[:seg.size] = seg
            bufs.append(buf)
        windows.append((offs, lens, bufs))
    return [(np.array([[o[r], l[r]] for o, l, _ in windows], np.int32), [b[r] for _, _, b in windows])
            for r in range(n)]


def _group_kernels(shapes, scheme):
    from jax_fp8.primitives.partial import partial_amax_p, partial_cast_p

    p = dict(shapes=tuple(shapes), scheme=scheme)
    amax = jax.jit(lambda w, *s: partial_amax_p.bind(w, *s, **p)[0])
    cast = jax.jit(lambda w, g, *s: partial_cast_p.bind(w, g, *s, **p))
    return p, amax, cast


@pytest.mark.parametrize("fmt", list(_SCHEMES))
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_partial_kernels_single_device(fmt, in_dtype):
    """The grouped partial-amax and partial-cast kernels on the default device (the CUDA ones on a GPU)
    for a group of three weights and several simulated shardings: each rank's packed outputs equal
    the reference's bit for bit, and the host-reduced scales cast into exactly the single-device
    quantization of every weight."""
    from jax_fp8 import reference as R

    rng = np.random.default_rng(stable_seed("partial kernels", fmt, in_dtype))
    shapes = [(130, 300), (64, 96), (3, 40)]
    weights = [random_input(rng, s, in_dtype) for s in shapes]
    p, amax, cast = _group_kernels(shapes, _SCHEMES[fmt])
    layout = _SCHEMES[fmt].packed_grids(shapes)
    for n, even in [(3, False), (4, True), (8, False)]:
        ranks = _rank_groups(rng, weights, n, even)
        parts = [_on_dirty_memory(amax, w, *s) for w, s in ranks]
        for (w, s), got in zip(ranks, parts):
            assert_bits_equal(got, R.partial_amax_group(w, *s, **p)[0])
        glob = np.max(np.stack([np.asarray(q) for q in parts]), axis=0)
        outs = []
        for w, s in ranks:
            got = _on_dirty_memory(cast, w, glob, *s)
            want = R.partial_cast_group(w, glob, *s, **p)
            assert len(got) == len(want)
            for g, r in zip(got, want):
                assert_bits_equal(g, r)
            outs.append(got)
        # assemble the shards: equal to quantizing each whole weight on one device
        nu = len(layout[0])
        scales_from = glob if fmt == "mxfp8" else outs[0][-1]
        for i, (wt, (M, K)) in enumerate(zip(weights, shapes)):
            if fmt == "mxfp8":
                q = jf.quantize_mxfp8(wt, rowwise=True, colwise=True)
                full = [(q.rowwise_data, q.rowwise_scale_inv), (q.colwise_data, q.colwise_scale_inv)]
            else:
                q = jf.quantize_blockwise(wt, block=(128, 128) if fmt == "blk2d" else (1, 128), colwise=fmt == "blk1d")
                full = [(q.rowwise_data, q.rowwise_scale_inv)] + ([(q.colwise_data, q.colwise_scale_inv)] if fmt == "blk1d" else [])
            for u, ((data, sc), (at, (r, c))) in enumerate(zip(full, layout[i])):
                assert_bits_equal(scales_from[at:at + r * c].reshape(r, c), sc)
                asm = np.zeros(M * K, np.uint8)
                for (win, s), got in zip(ranks, outs):
                    o, l = win[i]
                    k = max(0, min(int(l), M * K - int(o), s[i].size))
                    asm[o:o + k] = np.asarray(got[i * nu + u])[:k]
                np.testing.assert_array_equal(asm, np.asarray(data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("fmt", list(_SCHEMES))
def test_partial_kernels_many_weights(fmt):
    """A group larger than one GPU launch holds (24 weights): 40 weights of random shapes, empty ones
    and single elements among them, split over 3 ranks at random cut points; packed outputs equal the
    reference bit for bit (fresh 0xAB memory under the outputs)."""
    from jax_fp8 import reference as R

    rng = np.random.default_rng(stable_seed("partial kernels many weights", fmt))
    shapes = [(int(rng.integers(1, 300)), int(rng.integers(1, 300))) for _ in range(36)]
    shapes += [(0, 40), (1, 1), (129, 1), (1, 257)]
    weights = [random_input(rng, s, jnp.bfloat16) for s in shapes]
    p, amax, cast = _group_kernels(shapes, dataclasses.replace(_SCHEMES[fmt], pow2_scales=False)
                                   if fmt != "mxfp8" else _SCHEMES[fmt])
    ranks = _rank_groups(rng, weights, 3, False)
    parts = [_on_dirty_memory(amax, w, *s) for w, s in ranks]
    for (w, s), got in zip(ranks, parts):
        assert_bits_equal(got, R.partial_amax_group(w, *s, **p)[0])
    glob = np.max(np.stack([np.asarray(q) for q in parts]), axis=0)
    for w, s in ranks:
        for g, r in zip(_on_dirty_memory(cast, w, glob, *s), R.partial_cast_group(w, glob, *s, **p)):
            assert_bits_equal(g, r)


def _subnormal_masters(rng, shapes):
    """fp32 masters whose every block holds only bf16-representable subnormals (multiples of 2^-133)
    or zeros in some rows, so that block amaxes are subnormal after the cast to bf16."""
    out = []
    for shape in shapes:
        w = random_input(rng, shape, jnp.float32, specials=False)
        sub = rng.integers(-127, 128, size=shape).astype(np.float32) * np.float32(2.0**-133)
        rows = rng.random(shape[0]) < 0.5
        w[rows] = sub[rows]
        out.append(w)
    return out


@pytest.mark.parametrize("fmt,block", [("blockwise", (1, 128)), ("blockwise", (128, 128)), ("mxfp8", None)])
@pytest.mark.parametrize("n", [2, 3])
def test_subnormal_block_amaxes_survive_the_reduction(fmt, block, n):
    """Regression: the blockwise amax pmax ran on floats, and XLA's CPU all-reduce flushes subnormals,
    so a block whose bf16 amax is subnormal got scale 1. Gathered shards equal whole-weight quantization."""
    rng = np.random.default_rng(stable_seed("subnormal amaxes", fmt, block, n))
    masters = _subnormal_masters(rng, [(6, 300), (130, 129)])
    kw = dict(fmt=fmt, block=block) if block else {}
    got, _, _ = _run(masters, n, False, seed=stable_seed("subnormal amaxes cuts", fmt, block, n), **kw)
    for w, q in zip(masters, got):
        wb = w.astype(jnp.bfloat16)
        want = (jf.quantize_blockwise(wb, block=block, colwise=True) if block
                else jf.quantize_mxfp8(wb, rowwise=True, colwise=True))
        assert_tensors_equal(q, want)
    if block == (1, 128):  # the subnormal rows really give subnormal scales
        assert (np.asarray(got[0].rowwise_scale_inv) < np.float32(2.0**-126)).any()


def test_subnormal_amax_issue_repro():
    """The reported case: weight (1, 5) = [0, 0, 7.34684e-40, 0, 0], all on rank 0 of 2."""
    w = np.array([[0, 0, 7.34684e-40, 0, 0]], np.float32)
    bufs = np.zeros((2, 5), np.float32)
    bufs[0] = w[0]

    def step(b, o, l):
        qs = quantize_master_weights([b[0]], [(1, 5)], "data", offsets=[o[0]], lengths=[l[0]], fmt="blockwise",
                                     colwise=False)
        return gather_master_weights(qs, "data")

    call, _ = replicated(step, _mesh(2), (P("data"),) * 3, "data")
    q = call(bufs, np.array([0, 5], np.int32), np.array([5, 0], np.int32))[0]
    assert np.asarray(q.rowwise_scale_inv).view(np.uint32).tolist() == [[0x00400000]]  # 2^-127
    assert np.asarray(q.rowwise_data).view(np.uint8).tolist() == [[0, 0, 0x20, 0, 0]]


@pytest.mark.parametrize("n", [2, 3])
def test_gather_master_weights_gemm_ready(n):
    """128x128 master weights gathered in the GEMM-ready layout: both orientations of each weight for
    the GEMMs (the columnwise one transposed), equal to quantizing the whole weight that way."""
    rng = np.random.default_rng(stable_seed("gather gemm_ready", n))
    masters = [random_input(rng, s, jnp.float32) for s in [(130, 300), (256, 128), (5, 7)]]
    shapes = [m.shape for m in masters]
    bufs = split_masters(masters, n)

    def step(local):
        shards, offsets, lengths = local_shards([b[0] for b in local], shapes, "data")
        qs = quantize_master_weights(shards, shapes, "data", offsets=offsets, lengths=lengths, fmt="blockwise",
                                     block=(128, 128))
        return gather_master_weights(qs, "data", layout="gemm_ready")

    got = replicated(step, _mesh(n), P("data"), "data")[0](bufs)
    for w, q in zip(masters, got):
        assert q.layout == "gemm_ready"
        assert_tensors_equal(q, jf.quantize_blockwise(w.astype(jnp.bfloat16), block=(128, 128), colwise=True,
                                                      layout="gemm_ready"))
    with pytest.raises(ValueError, match="layout"):
        shard_map(lambda b: gather_master_weights([], "data", layout="tn"), mesh=_mesh(2), in_specs=P("data"),
                  out_specs=P())(np.zeros((2, 4), np.float32))


def test_gather_master_weights_sends_shared_tiles_once():
    """A 128x128 weight's tiles serve both usages: its FP8 shard is gathered once (plus the windows)."""
    shapes = [(256, 128)]
    bufs = split_masters([np.ones(shapes[0], np.float32)], 2)

    def step(local):
        qs = quantize_master_weights([local[0][0]], shapes, "data", fmt="blockwise", block=(128, 128))
        return gather_master_weights(qs, "data")

    call, f = replicated(step, _mesh(2), P("data"), "data")
    got = call(bufs)[0]
    assert got.colwise_data is not None
    assert_tensors_equal(got, jf.quantize_blockwise(np.ones(shapes[0], jnp.bfloat16), block=(128, 128), colwise=True))
    assert len(re.findall(r'"stablehlo.all_gather"', f.lower(bufs).as_text())) == 3  # offset, length, data
