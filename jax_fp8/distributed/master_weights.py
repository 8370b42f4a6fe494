"""The distributed cast of sharded fp32 master weights (inside ``shard_map``).

``quantize_master_weights`` is the ZeRO / distributed-optimizer step (as TE's master-weight cast):
every data-parallel rank holds a flat fp32 shard of each weight, boundaries anywhere. Per weight it
computes partial block amaxes over its shard, turns them into local scales, reduces all weights'
scales with ONE ``lax.pmax`` over one packed buffer, and casts its shard with the global scales.
For MXFP8 the packed buffer is uint8 E8M0 bytes (E8M0 is monotonic in the amax, so the max of the
bytes is the byte of the max amax: half the bytes of a bf16 amax all-reduce). Float8 blockwise scales
are not monotonic bytes, so that variant reduces the fp32 amaxes, as their uint32 bit patterns.
:mod:`.shards` (``local_shards``, ``shard_windows``, ``split_masters``) gives the shards and windows
of the standard ZeRO splits. Gathering the FP8 shards (``gather_master_weights``) gives exactly
``quantize_*(full_master.astype(model_dtype))``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import vma
from ..arrays import bitcast, view_2d
from ..formats import high_dtype
from ..quantization import assemble, to_layout
from ..primitives.partial import partial_amax_p, partial_cast_p
from ..scheme import Scheme, build_scheme, unpack_grids
from .shards import check_shapes, tiling_errors

Array = Any


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizedShard:
    """One rank's part of a quantized weight.

    ``tensor`` is an MXFP8Tensor or BlockwiseTensor whose data fields hold this rank's flat FP8 shard
    (shape ``(L,)``: elements ``[offset, offset + length)`` of the row-major weight, zeros past
    ``length``) and whose scales are the global, replicated scales; ``tensor.shape`` is the full shape.
    """

    tensor: Any
    offset: Array
    length: Array

    def tree_flatten(self):
        return (self.tensor, self.offset, self.length), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _as_i32(v, name, i):
    v = jnp.asarray(v)
    if v.shape != () or not jnp.issubdtype(v.dtype, jnp.integer):
        raise ValueError(f"quantize_master_weights: {name}[{i}] must be an integer scalar, got {v.dtype}{v.shape}")
    return v.astype(jnp.int32)


def _per_weight(values, name, n):
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"quantize_master_weights: {name} must be a sequence with one entry per shard, got {values!r}")
    if len(values) != n:
        raise ValueError(f"quantize_master_weights: {len(values)} {name} for {n} shards (one per shard)")
    return list(values)


#: The keyword conveniences that build the scheme of quantize_master_weights, with their defaults.
_SCHEME_KEYWORDS = dict(fmt="mxfp8", dtype=jnp.float8_e4m3fn, rowwise=True, colwise=True, block=None,
                        pow2_scales=True, amax_epsilon=0.0)


class _Unset:
    """A keyword left out (its default applies, and it does not clash with ``scheme=``)."""

    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


def _master_scheme(scheme, given: dict, where: str) -> Scheme:
    """The scheme of a master-weight cast: ``scheme``, or one built from the keyword conveniences."""
    passed = sorted(k for k, v in given.items() if v is not _UNSET)
    if scheme is None:
        kw = {k: _SCHEME_KEYWORDS[k] if v is _UNSET else v for k, v in given.items()}
        return build_scheme(where, kw.pop("fmt"), kw.pop("dtype"), **kw)
    if not isinstance(scheme, Scheme):
        raise TypeError(f"{where}: scheme must be a jax_fp8.Scheme or None, got {scheme!r}")
    if passed:
        raise TypeError(f"{where}: pass either scheme= or the keywords that build one, not both; got scheme={scheme} "
                        f"and {', '.join(passed)}")
    if scheme.layout != "compact":
        raise ValueError(f"{where}: scheme.layout must be 'compact' (master-weight shards are flat); "
                         f"gather_master_weights(layout='gemm_ready') gives the GEMM-ready tensors, got {scheme}")
    if not scheme.saturate_inf:
        raise ValueError(f"{where}: master-weight casts take TransformerEngine's rule for infinities "
                         f"(saturate_inf=True), got {scheme}")
    return scheme


def quantize_master_weights(shards: Sequence[Array], shapes: Sequence[Sequence[int]], axis_name,
                            offsets: Optional[Sequence[Array]] = None, lengths: Optional[Sequence[Array]] = None,
                            model_dtype=jnp.bfloat16, dtype=_UNSET, fmt=_UNSET, rowwise=_UNSET, colwise=_UNSET,
                            block=_UNSET, pow2_scales=_UNSET, amax_epsilon=_UNSET, check: bool = False,
                            scheme: Optional[Scheme] = None) -> list[QuantizedShard]:
    """Quantize this rank's flat master-weight shards with globally consistent scales (inside shard_map).

    Args:
      shards: per weight, this rank's flat shard (rank 1, float32/bfloat16/float16) of length L_i.
      shapes: per weight, its full shape (viewed as 2-D ``(prod(shape[:-1]), shape[-1])``).
      axis_name: the data-parallel mesh axis the shards are split over.
      offsets: per weight, the flat index of the shard's first element (traced int scalar). Default:
        ``axis_index(axis_name) * L_i`` (even split, the last rank padded).
      lengths: per weight, how many of the L_i elements belong to the weight (default L_i; clipped to
        the weight's end, so padding past it is ignored). A shard may hold none; one whose offset is
        negative (not a valid window) is treated as holding none.
      model_dtype: the master values are first rounded to this dtype, as TE does (float32, bfloat16,
        float16, or None to keep them).
      scheme: the :class:`jax_fp8.Scheme` to quantize with (compact layout; ``saturate_inf`` True), as
        every quantizing function takes it. Or, as conveniences that build it (not together with
        ``scheme``): ``dtype`` (FP8 element dtype, default E4M3), ``fmt`` ('mxfp8', the default, or
        'blockwise': then ``block``, default (1, 128), ``pow2_scales`` (True), ``amax_epsilon`` (0.0) as
        in :func:`jax_fp8.quantize_blockwise`), ``rowwise`` and ``colwise`` (both True by default: the
        usages to produce; for 128x128 tiles one set of tiles serves both).
      check: also verify that the windows of all ranks tile every weight exactly once (no element held
        by no rank or by two); otherwise a ValueError names the weight and what is wrong. When every
        window is known while tracing (each offset and length None or a Python/NumPy int, not traced),
        it is raised at the call and costs nothing at run time. Traced windows (from ``local_shards``,
        or derived from ``axis_index``) are checked at run time after one small int32 all-gather: every
        rank stops, the error reaches the caller once, inside jax's runtime error, and the ranks at
        index 0 of the axis alone log it (one on a 1-D mesh). As for any failed ``jax.debug.callback``,
        jax raises it again at its next effects barrier and at exit.

    The windows are the caller's contract: every element of every weight held by exactly one rank.
    :func:`jax_fp8.distributed.local_shards` computes shards and windows for the standard ZeRO splits
    (each weight split evenly, or all weights in one flat buffer split evenly).

    Returns: a :class:`QuantizedShard` per weight. Exactly one all-reduce (a pmax) is issued for all
    weights' scales: uint8 E8M0 bytes for MXFP8; for blockwise, the fp32 amaxes' bit patterns as
    uint32 (integer order is float order for non-negative floats, so no platform's float reduction,
    e.g. one that flushes subnormals, can change a scale). The partial amax and the partial cast each
    run as one grouped kernel call for all weights of one dtype (on GPU one launch per 24 weights),
    and the partial amax writes the packed buffer that the pmax reduces.
    """
    where = "quantize_master_weights"
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise TypeError(f"{where}: shards must be a list with one flat shard per weight, got {type(shards).__name__}")
    shards, shapes = list(shards), check_shapes(shapes, where)
    if len(shards) != len(shapes):
        raise ValueError(f"{where}: {len(shards)} shards but {len(shapes)} shapes")
    offsets, lengths = _per_weight(offsets, "offsets", len(shards)), _per_weight(lengths, "lengths", len(shards))
    scheme = _master_scheme(scheme, dict(fmt=fmt, dtype=dtype, rowwise=rowwise, colwise=colwise, block=block,
                                         pow2_scales=pow2_scales, amax_epsilon=amax_epsilon), where)
    if model_dtype is not None:
        model_dtype = high_dtype(model_dtype, f"{where}: model_dtype")

    ranks = vma.axis_size(axis_name, where)
    rank = lax.axis_index(axis_name)
    # the windows of every rank are known while tracing unless an offset or length is traced
    concrete = not any(isinstance(v, jax.core.Tracer) for v in (offsets or []) + (lengths or []))
    xs, wins, held, table = [], [], [], []
    for i, s in enumerate(shards):
        s = jnp.asarray(s)
        if s.ndim != 1:
            raise ValueError(f"{where}: shards[{i}] must be flat (rank 1), got shape {s.shape}")
        high_dtype(s.dtype, f"{where}: shards[{i}]")
        xs.append(s.astype(model_dtype) if model_dtype is not None else s)
        off = _as_i32(offsets[i], "offsets", i) if offsets is not None else (rank * s.shape[0]).astype(jnp.int32)
        n = _as_i32(lengths[i], "lengths", i) if lengths is not None else jnp.int32(s.shape[0])
        wins.append(_valid_window(off, n))
        held.append(s.shape[0])
        if check and concrete:  # every rank's window of this weight, as the line above computes it on rank r
            r_off = np.arange(ranks) * s.shape[0] if offsets is None else np.full(ranks, np.asarray(offsets[i]))
            r_len = np.full(ranks, s.shape[0] if lengths is None else np.asarray(lengths[i]))
            table.append(_valid_window(r_off.astype(np.int32), r_len.astype(np.int32), np))
    if not xs:
        return []
    if check and concrete:
        errors = tiling_errors(np.stack(table, axis=1), held, shapes)
        if errors:
            raise ValueError(_tiling_message(errors))
    elif check:
        _check_tiling(jnp.stack(wins), rank, held, shapes, axis_name)
    shapes2d = [view_2d(shp) for shp in shapes]
    # one partial-amax call (one launch per 24 weights on GPU) per input dtype
    groups = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.dtype, []).append(i)
    groups = [(idx, jnp.stack([wins[i] for i in idx]), tuple(shapes2d[i] for i in idx)) for idx in groups.values()]
    # 1-2. partial amax -> local scales (E8M0 bytes) or amaxes, every weight's packed into one buffer
    packs = [partial_amax_p.bind(w, *[xs[i] for i in idx], shapes=shp, scheme=scheme)[0] for idx, w, shp in groups]
    # 3. one collective for every weight, on integers: E8M0 bytes, or the fp32 amaxes' bits (non-negative
    # floats order as their bit patterns; a float pmax may flush subnormal amaxes, XLA's CPU one does)
    packed = packs[0] if len(packs) == 1 else jnp.concatenate(packs)
    reduce_as = scheme.format.reduce_dtype
    if packed.dtype != reduce_as:
        packed = bitcast(lax.pmax(bitcast(packed, reduce_as), axis_name), packed.dtype)
    else:
        packed = lax.pmax(packed, axis_name)
    packs = jnp.split(packed, np.cumsum([q.size for q in packs])[:-1])
    # 4. partial cast with the global scales
    out = [None] * len(xs)
    for (idx, w, shp), glob in zip(groups, packs):
        res = partial_cast_p.bind(w, glob, *[xs[i] for i in idx], shapes=shp, scheme=scheme)
        # the reduced values where they are the scales (E8M0 bytes), else the cast's scale_inv (fp32)
        scales_from = glob if scheme.format.partials_are_scales else res[-1]
        nu = len(scheme.kernel_blocks)
        for k, (i, grids) in enumerate(zip(idx, scheme.packed_grids(shp))):
            datas = [bitcast(d, scheme.dtype) for d in res[k * nu:(k + 1) * nu]]
            t = assemble(scheme, zip(datas, unpack_grids(scales_from, grids)), shapes[i], xs[i].dtype)
            out[i] = QuantizedShard(t, wins[i][0], wins[i][1])
    return out


def _valid_window(offset, length, xp=jnp):
    """A shard's (offset, length) as an int32 pair (last axis). A negative offset is not a valid window:
    that shard then holds nothing (offset 0, length 0), as does a negative length."""
    ok = offset >= 0
    return xp.stack([xp.where(ok, offset, 0), xp.where(ok, xp.maximum(length, 0), 0)], axis=-1).astype(xp.int32)


def _tiling_message(errors):
    return ("quantize_master_weights(check=True): the shard windows do not tile every weight exactly once:\n  "
            + "\n  ".join(errors))


def _check_tiling(windows, rank, held, shapes, axis_name):
    """Raise at run time (from a host callback) unless the ranks' windows tile every weight exactly once.

    Every rank raises: a rank that returned would wait in its next collective for the ranks that stopped
    (XLA's CPU runtime then aborts the process after 40 s). The caller still gets one error (the runtime
    reports one failed rank's), and ``_log_once`` keeps jax from logging a traceback per rank."""
    def report(all_windows, rank):
        errors = tiling_errors(np.asarray(all_windows), held, shapes)
        if errors:
            e = ValueError(_tiling_message(errors))
            e._jax_fp8_quiet = int(rank) != 0
            raise e

    jax.debug.callback(report, lax.all_gather(windows, axis_name), rank)


def _log_once(record):
    """Logging filter: drop jax's "jax.debug.callback failed" record of a tiling error off rank 0."""
    return not getattr(record.exc_info[1] if record.exc_info else None, "_jax_fp8_quiet", False)


logging.getLogger("jax._src.debugging").addFilter(_log_once)  # the logger of jax.debug.callback's failures


def gather_master_weights(qshards: Sequence[QuantizedShard], axis_name, layout: str = "compact") -> list:
    """All-gather each rank's FP8 shard into the full quantized tensors (inside shard_map).

    ``qshards``: the list :func:`quantize_master_weights` returned. Returns one MXFP8Tensor or
    BlockwiseTensor per weight, with the weight's full shape, the same on every rank, in ``layout``:
    'compact', or 'gemm_ready' (for a 128x128 weight: both orientations a GEMM reads, the columnwise
    one transposed, scales in cuBLASLt's order), rearranged after the gather.
    """
    if layout not in ("compact", "gemm_ready"):
        raise ValueError(f"gather_master_weights: layout must be 'compact' or 'gemm_ready', got {layout!r}")
    vma.axis_size(axis_name, "gather_master_weights")
    if isinstance(qshards, QuantizedShard) or not isinstance(qshards, Sequence):
        raise TypeError("gather_master_weights: qshards must be the list of QuantizedShard that "
                        f"quantize_master_weights returned, got {type(qshards).__name__}")
    out = []
    for i, qs in enumerate(qshards):
        if not isinstance(qs, QuantizedShard):
            raise TypeError(f"gather_master_weights: qshards[{i}] must be a QuantizedShard (from "
                            f"quantize_master_weights), got {type(qs).__name__}")
        t = qs.tensor
        offs = lax.all_gather(qs.offset, axis_name)
        lens = lax.all_gather(qs.length, axis_name)
        M, K = view_2d(t.shape)
        fields = {}
        for usage in ("rowwise", "colwise"):
            d = getattr(t, f"{usage}_data")
            if d is None:
                continue
            if t.scheme.shared_tiles and fields:  # 128x128 tiles: the colwise data is the rowwise data
                fields["colwise_data"] = fields["rowwise_data"]
                break
            g = lax.all_gather(bitcast(d, jnp.uint8), axis_name)  # (ranks, L)
            j = jnp.arange(g.shape[1])
            pos = offs[:, None] + j[None, :]
            ok = (j[None, :] < lens[:, None]) & (pos < M * K)
            flat = jnp.zeros(M * K, jnp.uint8).at[jnp.where(ok, pos, M * K)].set(g, mode="drop")
            fields[f"{usage}_data"] = bitcast(flat.reshape(t.shape), t.scheme.dtype)
        out.append(to_layout(dataclasses.replace(t, **fields), layout))
    return out


__all__ = ["quantize_master_weights", "gather_master_weights", "QuantizedShard"]
