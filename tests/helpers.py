"""Shared test helpers: fresh random data with special values, bitwise comparison, CPU reference."""
from __future__ import annotations

import inspect
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8 as jf

IN_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FP8_DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _seed_part(p):
    if isinstance(p, (tuple, list)):
        return tuple(_seed_part(v) for v in p)
    if p is None or isinstance(p, (bool, int, float, str)):
        return p
    if isinstance(p, (type, np.dtype)):  # jnp.float32, np.dtype('float32'), ...: by name, not by repr
        return jnp.dtype(p).name
    raise TypeError(f"stable_seed: {type(p).__name__} has no stable repr; pass a str/int/float or a dtype")


def stable_seed(*parts) -> int:
    """A 32-bit seed from test parameters that is the same in every process (``hash()`` of a str is
    salted by PYTHONHASHSEED); dtypes count by name."""
    return zlib.crc32(repr(_seed_part(parts)).encode())


#: XLA's flag that makes its GPU compiler round every value to the dtype the program gives it.
ROUND_AS_WRITTEN_FLAG = "--xla_allow_excess_precision=false"


def xla_rounds_as_written() -> bool:
    """Whether XLA here rounds each value to its declared dtype: on the CPU yes; XLA's GPU compiler by
    default (``--xla_allow_excess_precision``) may keep float32 bits through a bfloat16 / float16 value
    inside a fusion, so what it computes outside our custom calls depends on the fusions it forms."""
    return jax.default_backend() == "cpu" or ROUND_AS_WRITTEN_FLAG in os.environ.get("XLA_FLAGS", "")


def on_cpu(fn, *args, **kw):
    """Evaluate the reference ``fn`` with NumPy (IEEE subnormals; XLA's CPU runtime flushes them)."""
    return fn(*jax.tree_util.tree_map(np.asarray, args), **kw)


def deq(q, usage: str = "rowwise") -> np.ndarray:
    """fp64 values of a quantized tensor's usage, as its 2-D (M, K) view, computed here in NumPy from the
    stored arrays alone: the FP8 data decoded exactly (ml_dtypes' cast to float64), each block's scale
    (fp32 ``scale_inv``, or E8M0 bytes e as 2**(e - 127), 0xFF as NaN) repeated over its block, and the
    two multiplied (exact in fp64: 4 x 24 significand bits). No jax_fp8 dequantize, reference or layout
    code runs; the storage is read as documented (``jax_fp8.Scheme``): compact data of the tensor's
    shape and compact scale grids (ceil(M/bm), ceil(K/bk)); GEMM-ready columnwise data transposed
    (K, M), and GEMM-ready Float8 blockwise scales padded along their last axis, stored as the grid's
    transpose for 1x128 rowwise blocks and 128x128 columnwise tiles (MXFP8 scales stay compact)."""
    shape = tuple(q.shape)
    K = shape[-1] if shape else 1
    M = int(np.prod(shape[:-1], dtype=np.int64))
    bm, bk = q.usage_blocks()[usage]
    rows, cols = -(-M // bm), -(-K // bk)
    data = np.asarray(jax.device_get(getattr(q, f"{usage}_data")))
    scale = np.asarray(jax.device_get(getattr(q, f"{usage}_scale_inv")))
    gemm_ready = q.layout == "gemm_ready"
    data = data.reshape(K, M).T if gemm_ready and usage == "colwise" else data.reshape(M, K)
    if scale.dtype.itemsize == 1:  # E8M0 exponents (uint8 or float8_e8m0fnu), compact in both layouts
        e = scale.view(np.uint8).astype(np.float64)
        s = np.where(e == 255, np.nan, np.exp2(e - 127))
    else:
        s = scale.astype(np.float64)
        if gemm_ready:
            transposed = (usage == "rowwise") != (tuple(q.block) == (128, 128))
            s = s[:, :rows].T if transposed else s[:, :cols]
    s = s.reshape(rows, cols)
    with np.errstate(invalid="ignore"):  # 0 * inf (a zero in a block of infinite scale) is NaN, as intended
        return data.astype(np.float64) * np.repeat(np.repeat(s, bm, 0)[:M], bk, 1)[:, :K]


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(jax.device_get(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"uint{8 * a.dtype.itemsize}")


def assert_bits_equal(a, b, what=""):
    ba, bb = bits(a), bits(b)
    assert ba.shape == bb.shape, f"{what}: shape {ba.shape} != {bb.shape}"
    bad = np.flatnonzero(ba != bb)
    assert bad.size == 0, (f"{what}: {bad.size} of {ba.size} differ; first at {np.unravel_index(bad[0], ba.shape)}: "
                           f"{ba.flat[bad[0]]:#x} vs {bb.flat[bad[0]]:#x}")


def assert_tensors_equal(q, r):
    """Every leaf of two quantized tensors equal bit for bit, and the same static layout."""
    assert type(q) is type(r)
    assert q.tree_flatten()[1] == r.tree_flatten()[1], (q.tree_flatten()[1], r.tree_flatten()[1])
    for f in ("rowwise_data", "rowwise_scale_inv", "colwise_data", "colwise_scale_inv"):
        a, b = getattr(q, f), getattr(r, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert a.dtype == b.dtype, (f, a.dtype, b.dtype)
            assert_bits_equal(a, b, f)


def random_input(rng: np.random.Generator, shape, dtype, specials: bool = True) -> np.ndarray:
    """Normal data with per-row magnitudes over many binades; optionally zeros, subnormals, huge
    values, +-inf and NaN sprinkled in (and some all-zero and all-subnormal rows)."""
    dtype = jnp.dtype(dtype)
    fi = jnp.finfo(dtype)
    x = rng.standard_normal(shape).astype(np.float64)
    if x.ndim:
        lead = x.shape[:-1] + (1,)
        x *= 2.0 ** rng.integers(-12, 12, size=lead)
    if specials and x.size:
        flat = x.reshape(-1)
        n = flat.size
        pick = lambda k: rng.integers(0, n, size=max(1, n * k // 1000))  # noqa: E731
        flat[pick(5)] = 0.0
        flat[pick(5)] = float(fi.smallest_subnormal) * rng.integers(1, 8)
        flat[pick(3)] = float(fi.max) * rng.uniform(0.5, 1.0)
        flat[pick(3)] = rng.choice([448.0, 449.0, 464.0, 57344.0, 61440.0, 1e5])
        flat[pick(2)] = np.inf
        flat[pick(2)] = -np.inf
        flat[pick(2)] = np.nan
        if x.ndim >= 2 and x.shape[-2] > 2:
            x.reshape(-1, x.shape[-1])[0] = 0.0  # an all-zero row
            x.reshape(-1, x.shape[-1])[1] = float(fi.smallest_subnormal) * rng.integers(0, 50, x.shape[-1])
    with np.errstate(over="ignore"):
        return np.asarray(x.astype(np.float32)).astype(dtype)


def check_against_reference(quantize, reference, x, **kw):
    """quantize(x, **kw) equals the (NumPy-evaluated) reference bit for bit, and so does dequantize
    of every usage it holds. Returns the kernel's tensor."""
    q = quantize(x, **kw)
    r = on_cpu(reference, x, **kw)
    assert_tensors_equal(q, r)
    for usage in q.usage_blocks():
        assert_bits_equal(jf.dequantize(q, usage=usage), on_cpu(jf.reference.dequantize, r, usage=usage), usage)
    return q


def assert_dequantize_within_half_step(x: np.ndarray, q, fp8, scale_value) -> None:
    """|dequantize(q) - x| <= half an FP8 step at the block scale (+ fp32 output rounding) for every
    usage of q; scale_value maps a stored scale_inv grid to its float64 values."""
    M, K = x.shape
    mant, bias = (3, 7) if jnp.dtype(fp8) == jnp.float8_e4m3fn else (2, 15)
    for usage, (bm, bk) in q.usage_blocks().items():
        y = np.asarray(jf.dequantize(q, jnp.float32, usage), np.float64)
        s = np.repeat(np.repeat(scale_value(np.asarray(getattr(q, f"{usage}_scale_inv"))), bm, 0)[:M], bk, 1)[:, :K]
        bound = np.abs(x) * 2.0 ** -(mant + 1) + s * 2.0 ** (-bias - mant)
        assert (np.abs(y - x) <= bound).all(), usage


def replicated(fn, mesh, in_specs, axis):
    """``jax.jit(jax.shard_map(fn, ...))`` with its default checks, for an ``fn`` whose result is the
    same on every rank of ``axis`` but typed as varying over it, as ``lax.all_gather``'s is (so
    ``out_specs=P()`` rejects it): every rank returns its own copy. Returns ``(call, f)``: ``call(*args)``
    asserts that the copies of all ranks agree bit for bit and returns one; ``f`` is the jitted
    function (to lower)."""
    from jax.sharding import PartitionSpec as P

    f = jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda v: v[None], fn(*a)), mesh=mesh, in_specs=in_specs,
                              out_specs=P(axis)))

    def call(*args):
        # on the host: jax 0.10's indexing of a sharded FP8 array turns -0 into +0 (seen on CPU)
        out = jax.tree.map(np.asarray, f(*args))
        for leaf in jax.tree.leaves(out):
            for r in range(1, leaf.shape[0]):
                assert_bits_equal(leaf[r], leaf[0], f"rank {r} vs rank 0")
        return jax.tree.map(lambda v: v[0], out)

    return call, f


def assert_drop_in_signature(ours, theirs) -> None:
    """``ours`` takes every parameter of ``theirs`` (a lax function, as this jax has it): its positional
    ones in the same order, each with the same name, kind and default; our own ones keyword-only."""
    mine, lax_params = (list(inspect.signature(f).parameters.values()) for f in (ours, theirs))
    positional = [p for p in lax_params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default, p.kind) for p in mine[:len(positional)]] == \
        [(p.name, p.default, p.kind) for p in positional]
    by_name = {p.name: p for p in mine}
    for p in lax_params[len(positional):]:
        assert p.name in by_name, f"{ours.__name__} lacks {theirs.__name__}'s keyword {p.name!r}"
        assert (by_name[p.name].kind, by_name[p.name].default) == (p.kind, p.default), p.name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in mine[len(positional):])

