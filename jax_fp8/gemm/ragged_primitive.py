"""``jf_fp8_ragged_gemm``, the primitive of :func:`jax_fp8.fp8_ragged_dot`'s grouped FP8 GEMMs (groups:
:mod:`jax_fp8.groups`), over the Gl groups from ``group_offset`` of the G in ``group_sizes`` (G,) int32
(``lax.ragged_dot``'s group_offset: an expert-parallel shard holds Gl experts), both read on the device:

- kind ``"m"``, M-grouped (forward, dgrad): ``a`` (M, K) FP8 with GEMM-ready 1x128 scales (ceil(K/128),
  roundup(M, 4)), ``b`` (Gl, N, K) with each group's GEMM-ready 128x128 tile scales (Gl, ceil(N/128),
  roundup(ceil(K/128), 4)); out (M, N): the rows of group ``group_offset + j`` times ``b[j]ᵀ``, every
  other row 0;
- kind ``"k"``, K-grouped (wgrad): ``a`` (R, Mc) and ``b`` (N, Mc), the columnwise operands of
  ``jf_quantize_grouped`` of ``rows`` rows (Mc = ``groups.col_count(rows, G)``), scales (S, roundup(R,
  4)) and (S, roundup(N, 4)); out (Gl, R, N) with Gl = ``groups_out``: ``out[j]`` contracts the columns
  of group ``group_offset + j`` (an empty one: 0).

The math is :func:`~jax_fp8.gemm.reference.ragged_blocked_gemm` and
:func:`~jax_fp8.gemm.reference.ragged_wgrad_gemm`, the lowering on the CPU and wherever no kernel runs;
on an H100/H200 with the CUTLASS module, CUTLASS's grouped kernels
(:func:`jax_fp8.gemm.backends.cutlass.ragged_lowering`; else the reference, with one
:class:`~jax_fp8.Fp8GemmFallbackWarning` saying why).

Under ``jax.jit`` on a mesh the groups split (expert parallel: each device its experts, with its
shard's group offset; the M-grouped outputs summed over them, each row coming from one), and N, R in
128-wide shards; the rows and K are gathered, with a warning.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import groups
from ..arrays import cdiv
from ..formats import FLOAT8_BLOCK, FP8_DTYPES
from ..primitives.partitioning import Dim, Rule
from ..primitives.quantize import scale_dims
from ..primitives.registration import define_primitive
from ..scheme import GEMM_SCALE_PAD
from ..vma import out_aval
from ..warn import Fp8GemmFallbackWarning
from .backends import cutlass
from .contract import BLOCK_1D, BLOCK_2D, OUT_DTYPES, operand_scale_shape, operand_scheme
from .reference import ragged_blocked_gemm, ragged_wgrad_gemm


def _check(where: str, got, want: tuple, dtype) -> None:
    if tuple(got.shape) != tuple(want) or np.dtype(got.dtype) != np.dtype(dtype):
        raise ValueError(f"{where} must be {np.dtype(dtype).name}{tuple(want)}, got {np.dtype(got.dtype).name}"
                         f"{tuple(got.shape)}")


def _abstract(a, a_scale, b, b_scale, group_sizes, group_offset, *, kind, rows, groups_out, out_dtype):
    where = "jf_fp8_ragged_gemm"
    if np.dtype(out_dtype) not in OUT_DTYPES:
        raise TypeError(f"{where}: out_dtype must be float32 or bfloat16, got {out_dtype}")
    if group_sizes.ndim != 1 or np.dtype(group_sizes.dtype) != np.int32:
        raise ValueError(f"{where}: group_sizes must be int32 (G,), got {group_sizes.dtype}{group_sizes.shape}")
    _check(f"{where}: group_offset", group_offset, (), np.int32)
    G = group_sizes.shape[0]
    if a.ndim != 2 or np.dtype(a.dtype) not in FP8_DTYPES or np.dtype(b.dtype) not in FP8_DTYPES:
        raise ValueError(f"{where}: a must be 2-D and a, b FP8, got a {a.dtype}{a.shape}, b {b.dtype}")
    if kind == "m":
        M, K = a.shape
        if b.ndim != 3 or b.shape[2] != K:
            raise ValueError(f"{where}: b must be (Gl, N, K) with a's K {K}, got {b.shape}")
        Gl, N = b.shape[:2]
        _check(f"{where}: a_scale", a_scale, operand_scale_shape(M, K, BLOCK_1D), np.float32)
        _check(f"{where}: b_scale", b_scale, (Gl, *operand_scale_shape(N, K, BLOCK_2D)), np.float32)
        out = (M, N)
    elif kind == "k":
        R, Mc = a.shape
        if b.ndim != 2 or b.shape[1] != Mc:
            raise ValueError(f"{where}: b must be (N, Mc) with a's Mc {Mc}, got {b.shape}")
        N = b.shape[0]
        if Mc != groups.col_count(rows, G):
            raise ValueError(f"{where}: a and b must have groups.col_count({rows}, {G}) columns, got {Mc}")
        S = groups.block_slots(rows, G, FLOAT8_BLOCK)
        _check(f"{where}: a_scale", a_scale, (S, cdiv(R, 4) * 4), np.float32)
        _check(f"{where}: b_scale", b_scale, (S, cdiv(N, 4) * 4), np.float32)
        out = (groups_out, R, N)
    else:
        raise ValueError(f"{where}: kind must be 'm' (M-grouped) or 'k' (K-grouped), got {kind!r}")
    return out_aval(out, out_dtype, a, a_scale, b, b_scale, group_sizes, group_offset)


def _reference(a, a_scale, b, b_scale, group_sizes, group_offset, *, kind, rows, groups_out, out_dtype):
    if kind == "m":
        return ragged_blocked_gemm(a, a_scale, b, b_scale, group_sizes, group_offset, out_dtype=out_dtype)
    return ragged_wgrad_gemm(a, a_scale, b, b_scale, group_sizes, group_offset, rows=rows, groups_out=groups_out,
                             out_dtype=out_dtype)


def _unavailable(platform: str, params, devices, avals) -> Optional[str]:
    return cutlass.ragged_unavailable(params["kind"], avals, params["out_dtype"], devices)


# ---- partitioning: the groups split (each shard its experts at its offset); N and R in 128-wide shards ----
#: the grouped kernels' alignment (:func:`jax_fp8.gemm.backends.cutlass.ragged_unavailable`), which
#: :func:`ragged_gemm` pads to: K (kind "m") in 16-byte FP8 rows, N in 16-byte bfloat16 output rows
K_ALIGN, N_ALIGN = cutlass.K_ALIGN, cutlass.N_ALIGN

_NAMES = dict(g="the groups (experts)", n="the output's columns", r="the weight gradient's rows",
              m="the rows", k="the contraction")


def _sizes(shapes, params):
    """The op dims, and the sizes of the dims that never split: G (group_sizes), Mc and S (kind "k")."""
    a, a_scale, b, _, group_sizes, _ = shapes
    if params["kind"] == "m":
        return dict(g=b[0], n=b[1], m=a[0], k=a[1], G=group_sizes[0])
    return dict(g=params["groups_out"], n=b[0], r=a[0], G=group_sizes[0], Mc=a[1], S=a_scale[0])


def _arrays(sizes, params):
    sizes_dims = (Dim(None, sizes["G"]),)  # every shard reads all the sizes (its groups start after the others')
    if params["kind"] == "m":
        M, K, N, Gl = sizes["m"], sizes["k"], sizes["n"], sizes["g"]
        g = Dim("g", Gl)
        a_scale = scale_dims(operand_scheme(BLOCK_1D), M, K, "rowwise", m="m")
        b_scale = scale_dims(operand_scheme(BLOCK_2D), N, K, "rowwise", m="n")
        operands = [(Dim("m", M), Dim("k", K)), a_scale, (g, Dim("n", N), Dim("k", K)), (g, *b_scale)]
        out = (Dim("m", M), Dim("n", N))
    else:
        R, N, Gl = sizes["r"], sizes["n"], sizes["g"]
        cols, slots = Dim(None, sizes["Mc"]), Dim(None, sizes["S"])
        operands = [(Dim("r", R), cols), (slots, Dim("r", cdiv(R, 4) * 4, 1, 4)), (Dim("n", N), cols),
                    (slots, Dim("n", cdiv(N, 4) * 4, 1, 4))]
        out = (Dim("g", Gl), Dim("r", R), Dim("n", N))
    return operands + [sizes_dims, ()], [out]


def _why_not(label, local, sizes, params) -> Optional[str]:
    if label in ("m", "k"):
        return f"{_NAMES[label]} stay whole (a group's rows may start anywhere)"
    if label in ("n", "r") and local % FLOAT8_BLOCK:
        return f"each shard's {local} is not a multiple of {FLOAT8_BLOCK}"
    return None


def _on_shard(bind, reduce_axes, params):
    """One device's grouped GEMM: its Gl groups start at the offset of its shard of the groups (the mesh
    axes that split them: ``reduce_axes``); an M-grouped output is summed over those shards (each row
    is one shard's, 0 on the others')."""
    axes = tuple(reduce_axes)

    def run(a, a_scale, b, b_scale, group_sizes, group_offset):
        shards, index = (lax.psum(1, axes), lax.axis_index(axes)) if axes else (1, 0)
        Gl = b.shape[0] if params["kind"] == "m" else params["groups_out"] // shards
        offset = (group_offset + index * Gl).astype(jnp.int32)
        out = bind(a, a_scale, b, b_scale, group_sizes, offset,
                   **dict(params, groups_out=Gl if params["kind"] == "k" else None))
        return lax.psum(out, axes) if params["kind"] == "m" and axes else out

    return run


def _batch(args, dims, **params):
    """vmap: one grouped GEMM per entry, in sequence (``lax.map``; a grouped GEMM fills the GPU alone)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    stacked = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    return lax.map(lambda xs: ragged_gemm_p.bind(*xs, **params), stacked), 0


ragged_gemm_p = define_primitive(
    "jf_fp8_ragged_gemm", abstract=_abstract, reference=_reference,
    ffi_rules={"cuda": cutlass.ragged_lowering}, unavailable=_unavailable, fallback_warning=Fp8GemmFallbackWarning,
    batch=_batch,
    rule=Rule(("g", "n", "r", "m", "k"), _NAMES, _sizes, _arrays, why_not=_why_not, contracted=("g",),
              local=_on_shard),
    no_jvp_hint="use jax_fp8.fp8_ragged_dot, whose VJP runs it for the gradients")


def ragged_gemm(a, a_scale, b, b_scale, group_sizes, group_offset=None, *, kind: str, rows: int = 0,
                groups_out: Optional[int] = None, out_dtype) -> jnp.ndarray:
    """Bind ``jf_fp8_ragged_gemm`` (see the module docstring); ``group_offset`` default 0, ``groups_out``
    (kind "k") default G. Widths off the grouped kernels' alignment (kind "m": K % 16; N % 8; kind "k":
    R % 4) are padded with zeros inside the last scale block (no scale grid changes; no product does),
    and the result cut back. ``out_dtype`` float32 or bfloat16 (the kernels'), or another float dtype
    (float16): computed in float32 and cast, as the dense GEMM's."""
    offset = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
    Gl = group_sizes.shape[0] if groups_out is None else int(groups_out)
    if kind == "m":
        K, N = a.shape[1], b.shape[1]
        dk, dn = -K % K_ALIGN, -N % N_ALIGN
        a = jnp.pad(a, ((0, 0), (0, dk)))
        b = jnp.pad(b, ((0, 0), (0, dn), (0, dk)))
        cut = (slice(None), slice(0, N))
    else:
        R, N = a.shape[0], b.shape[0]
        dr, dn = -R % 4, -N % N_ALIGN
        a = jnp.pad(a, ((0, dr), (0, 0)))  # its scale rows are R padded to 4 already
        b = jnp.pad(b, ((0, dn), (0, 0)))
        b_scale = jnp.pad(b_scale[:, :N], ((0, 0), (0, dn)), constant_values=GEMM_SCALE_PAD)
        cut = (slice(None), slice(0, R), slice(0, N))
    gemm_dtype = np.dtype(out_dtype) if np.dtype(out_dtype) in OUT_DTYPES else np.dtype(np.float32)
    out = ragged_gemm_p.bind(a, a_scale, b, b_scale, group_sizes, offset, kind=kind, rows=int(rows),
                             groups_out=Gl if kind == "k" else None, out_dtype=gemm_dtype)
    return out[cut].astype(out_dtype)
