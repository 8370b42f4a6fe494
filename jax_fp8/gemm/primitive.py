"""``jf_fp8_gemm``, the primitive of a Float8 blockwise GEMM on a backend's kernel (the contract:
:mod:`jax_fp8.gemm.contract`; the backends: :mod:`jax_fp8.gemm.backends`): its abstract evaluation,
batching (``vmap``), partitioning under ``jit`` (M and N stay split; a split K gives partial products
and a psum) and stacked operands (sequences kept apart so a split S stays split), and its lowering:
the backend's kernel where it runs (``lowerings``), else the reference math
(:func:`jax_fp8.gemm.reference.blocked_gemm`, with one :class:`Fp8GemmFallbackWarning`).

- operands ``a, a_scale, b, b_scale[, c]`` as the contract's Float8 blockwise ones; ``a`` and ``b``
  travel as bytes (uint8), their FP8 dtypes as params; ``c`` only with ``accumulate=True`` (a
  lowering may alias it with the output);
- params: ``a_block``, ``b_block`` each ``(1, 128)`` or ``(128, 128)``; ``out_dtype`` ``float32`` or
  ``bfloat16``; ``accumulate`` (bool); ``backend``, the :class:`GemmBackend` that runs it;
- shapes the backend takes with no padding left to do (its ``sizes`` returns them unchanged; for
  cuBLASLt: M, N, K >= 1, K % 16 == 0, N % 8 == 0, M % 8 == 0 when ``a`` has 1x128 blocks, not both
  operands 128x128 or E5M2). The abstract eval rejects anything else, on every platform, so the
  reference path enforces what the backend needs.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._compat import ShapedArray, ad
from ..arrays import bitcast
from ..formats import FLOAT8_BLOCK, FP8_DTYPES
from ..primitives.partitioning import Dim, Rule
from ..primitives.quantize import scale_dims
from ..primitives.registration import define_primitive
from ..scheme import GEMM_SCALE_PAD, check_block
from ..vma import out_aval
from ..warn import Fp8GemmFallbackWarning
from .contract import BLOCK_1D, OUT_DTYPES, GemmBackend, operand_scale_shape, operand_scheme
from .reference import blocked_gemm


def gemm_reference(a, a_scale, b, b_scale, *c, a_block, b_block, out_dtype, accumulate, backend=None):
    """The reference lowering of ``jf_fp8_gemm`` (see the module docstring), whatever the backend."""
    del accumulate, backend  # accumulate is implied by ``c``
    return blocked_gemm(a, a_scale, b, b_scale, *c, a_block=a_block, b_block=b_block, out_dtype=out_dtype)


# ---- the primitive ------------------------------------------------------------------------------

def _gemm_abstract(a, a_scale, b, b_scale, *c, a_block, b_block, out_dtype, accumulate, backend):
    where = "jf_fp8_gemm"
    a_block, b_block = check_block(a_block, f"{where}: a_block"), check_block(b_block, f"{where}: b_block")
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"{where}: {name} must be 2-D (rows, K), got shape {x.shape}")
        if np.dtype(x.dtype) not in FP8_DTYPES:
            raise TypeError(f"{where}: {name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
    (M, K), (N, Kb) = a.shape, b.shape
    if K != Kb:
        raise ValueError(f"{where}: a {a.shape} and b {b.shape} must share K, their last dim")
    if min(M, N, K) <= 0:
        raise ValueError(f"{where}: cannot take an empty GEMM ({M}x{N}x{K})")
    padded, why = backend.sizes(M, N, K, a_block, b_block, a.dtype, b.dtype)
    if why is not None:
        raise ValueError(f"{where}: {backend.name} cannot take {why}")
    if padded != (M, N, K):
        need = "x".join(map(str, padded))
        raise ValueError(f"{where}: {M}x{N}x{K} is not aligned for {backend.name} (needs {need}): pad with zeros "
                         "first (jax_fp8.gemm.fp8_gemm does)")
    for name, s, rows, block in (("a_scale", a_scale, M, a_block), ("b_scale", b_scale, N, b_block)):
        want = operand_scale_shape(rows, K, block)
        if s.shape != want or np.dtype(s.dtype) != np.float32:
            raise ValueError(f"{where}: {name} must be float32 {want} (GEMM-ready scales of {block[0]}x{block[1]} "
                             f"blocks of a {rows}x{K} operand), got {s.dtype}{s.shape}")
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{where}: out_dtype must be float32 or bfloat16, got {out_dtype}")
    if bool(accumulate) != bool(c):
        raise ValueError(f"{where}: accumulate={accumulate} but {len(c)} accumulator operand(s)")
    if c and (c[0].shape != (M, N) or np.dtype(c[0].dtype) != out_dtype):
        raise ValueError(f"{where}: c must be {out_dtype}{(M, N)}, got {c[0].dtype}{c[0].shape}")
    return out_aval((M, N), out_dtype, a, a_scale, b, b_scale, *c)


# ---- partitioning under jit: M and N stay split; a split K gives partial products and a psum ------
def _operand_dims(label: str, rows: int, K: int, block) -> tuple:
    """An operand's (rows, K) data and its GEMM-ready scale grid (operand_scale_shape) as op dims."""
    scale = scale_dims(operand_scheme(block), rows, K, "rowwise", m=label)
    return (Dim(label, rows), Dim("k", K)), scale


def _gemm_sizes(shapes, params) -> dict:
    (a, _, b, *_) = shapes
    if len(a) == 2:
        return dict(m=a[0], n=b[0], k=a[1])
    if len(b) == 2:  # stacked rows: "s" sequences of "m" rows
        return dict(s=a[0], m=a[1], n=b[0], k=a[2])
    return dict(j=a[1], m=a[0], n=b[0], k=a[2])  # stacked contraction: over "j" sequences of "k"


def _gemm_arrays(sizes, params):
    M, N, K = sizes["m"], sizes["n"], sizes["k"]
    out = (Dim("m", M), Dim("n", N))
    if "s" not in sizes and "j" not in sizes:
        operands = [*_operand_dims("m", M, K, params["a_block"]), *_operand_dims("n", N, K, params["b_block"])]
        return operands + [out] * bool(params["accumulate"]), [out]
    if "s" in sizes:  # a (S, M, K), its scales (K/128, S, M); out (S, M, N)
        seq = Dim("s", sizes["s"])
        (a, (k_blocks, rows)), b = _operand_dims("m", M, K, BLOCK_1D), _operand_dims("n", N, K, params["b_block"])
        out = (seq, *out)
        return [(seq, *a), (k_blocks, seq, rows), *b] + [out] * bool(params["accumulate"]), [out]
    # a (M, J, K) and b (N, J, K), scales (J, K/128, M) and (J, K/128, N): every sequence contracted
    seq = Dim("j", sizes["j"])
    (a, a_scale), (b, b_scale) = _operand_dims("m", M, K, BLOCK_1D), _operand_dims("n", N, K, BLOCK_1D)
    operands = [(a[0], seq, a[1]), (seq, *a_scale), (b[0], seq, b[1]), (seq, *b_scale)]
    return operands + [out] * bool(params["accumulate"]), [out]


def _gemm_why_not(label, local, sizes, params) -> Optional[str]:
    """The backend's alignment for a shard (what it would otherwise need padded); stacked rows, whole
    128-row blocks per sequence (:func:`_stacked_mode`)."""
    if label not in ("m", "n", "k"):
        return None
    if label == "m" and "s" in sizes and local % FLOAT8_BLOCK:
        return f"each shard's sequence length ({local}) is not a multiple of {FLOAT8_BLOCK} (stacked sequences)"
    local_sizes = {**sizes, label: local}
    backend, mnk = params["backend"], tuple(local_sizes[d] for d in "mnk")
    padded, why = backend.sizes(*mnk, tuple(params["a_block"]), tuple(params["b_block"]), params["a_dtype"],
                                params["b_dtype"])
    if why is None and padded == mnk:
        return None
    why = why or f"needs {padded}"
    return f"each shard's {label.upper()} ({local}) is not aligned for {backend.name} ({why})"


def _gemm_on_shard(bind, reduce_axes, params):
    """One device's GEMM: its FP8 bytes read as their dtypes; with a split K, its partial product in
    fp32, summed over the K axes, then ``+ c`` and rounded to ``out_dtype`` once (the sum of fp32
    partials: the reduction XLA adds for dot_general)."""
    kw = {k: v for k, v in params.items() if k not in ("a_dtype", "b_dtype")}

    def run(a, a_scale, b, b_scale, *c):
        a, b = bitcast(a, params["a_dtype"]), bitcast(b, params["b_dtype"])
        mode = _stacked_mode(a, b, params)
        stack = a.shape[:2]
        if mode is not None:
            a, a_scale, b, b_scale, *c = _fold(mode, a, a_scale, b, b_scale, *c)
        if not reduce_axes:
            out = bind(a, a_scale, b, b_scale, *c, **kw)
        else:
            out = bind(a, a_scale, b, b_scale, **dict(kw, out_dtype=np.dtype(np.float32), accumulate=False))
            out = lax.psum(out, reduce_axes)
            out = (out + c[0].astype(jnp.float32) if c else out).astype(params["out_dtype"])
        return out.reshape(*stack, -1) if mode == "rows" else out

    return run


def _gemm_bytes_abstract(a, a_scale, b, b_scale, *c, a_dtype, b_dtype, **params):
    """``jf_fp8_gemm`` takes its FP8 data as bytes (uint8), the dtypes as params: an operand that the
    partitioner gathers (an FSDP weight) then travels at one byte per element on every backend. It
    also takes stacked operands (:func:`_stacked_mode`), checked as the 2-D GEMM they fold into."""
    typed = [x.update(dtype=dt) if np.dtype(x.dtype) == np.uint8 else x for x, dt in ((a, a_dtype), (b, b_dtype))]
    mode = _stacked_mode(typed[0], typed[1], params)
    if mode is None:
        return _gemm_abstract(typed[0], a_scale, typed[1], b_scale, *c, **params)
    want = _stacked_scale_shapes(mode, a.shape, b.shape, params)
    for name, got, shape in (("a_scale", a_scale, want[0]), ("b_scale", b_scale, want[1])):
        if tuple(got.shape) != shape:
            raise ValueError(f"jf_fp8_gemm: a must be 2-D (rows, K), or stacked (sequences, rows, K) with "
                             f"per-sequence {name} {shape}; got a {a.shape}, {name} {got.shape}")
    operands = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (typed[0], a_scale, typed[1], b_scale, *c))
    folded = jax.eval_shape(partial(_fold, mode), *operands)  # the 2-D GEMM each device runs
    out = _gemm_abstract(*(ShapedArray(f.shape, f.dtype) for f in folded), **params)
    shape = (a.shape[0], a.shape[1], b.shape[0]) if mode == "rows" else out.shape
    return out_aval(shape, out.dtype, a, a_scale, b, b_scale, *c)


# ---- stacked operands: sequences (B, S, K) kept apart, so a split S stays split under jit ---------
#: Two stacked modes, each folded on every device into the 2-D GEMM of its shard by reshapes alone
#: (the layouts of ``jf_quantize``'s stacked outputs):
#: "rows": a (B, S, K) with 1x128 scales (ceil(K/128), B, S) and a 2-D b; out (and c) (B, S, N): the
#: GEMM of a's B*S rows. "contraction": a (R, B, S) and b (C, B, S), 1x128 blocks along S, scales
#: (B, S/128, roundup(R, 4)) and (B, S/128, roundup(C, 4)); out (and c) (R, C): the GEMM contracting
#: over all B*S. S % 128 == 0: every block lies inside one sequence, so the fold is the merged
#: tensor's blocking (and no scale grid carries padding).
def _stacked_mode(a, b, params) -> Optional[str]:
    if a.ndim == 3 and b.ndim == 2:
        mode = "rows"
    elif a.ndim == 3 and b.ndim == 3:
        mode = "contraction"
    else:
        return None
    blocks = {tuple(params["a_block"])} | ({tuple(params["b_block"])} if mode == "contraction" else set())
    S, need = a.shape[1 if mode == "rows" else 2], FLOAT8_BLOCK
    mismatch = mode == "contraction" and a.shape[1:] != b.shape[1:]
    if blocks != {BLOCK_1D} or S % need or mismatch:
        raise ValueError(f"jf_fp8_gemm: a must be 2-D (rows, K), or stacked ({mode}) with 1x128 blocks and a stack "
                         f"dim S a multiple of {need}, one S for both; got a {a.shape}, b {b.shape}, blocks "
                         f"{sorted(blocks)}")
    return mode


def _stacked_scale_shapes(mode, a_shape, b_shape, params):
    if mode == "rows":
        B, S, K = a_shape
        k_blocks, rows = operand_scale_shape(S, K, BLOCK_1D)
        return (k_blocks, B, rows), operand_scale_shape(b_shape[0], K, params["b_block"])
    R, B, S = a_shape
    return (B, *operand_scale_shape(R, S, BLOCK_1D)), (B, *operand_scale_shape(b_shape[0], S, BLOCK_1D))


def _fold(mode, a, a_scale, b, b_scale, *c):
    """A shard's stacked operands as its 2-D GEMM's: reshapes only."""
    if mode == "rows":
        B, S, K = a.shape
        return (a.reshape(B * S, K), a_scale.reshape(a_scale.shape[0], B * S), b, b_scale,
                *(x.reshape(B * S, -1) for x in c))

    def rows(data, scale):  # (R, B, S) -> (R, B*S); scales (B, S/128, R4) -> (B*S/128, R4)
        return data.reshape(data.shape[0], -1), scale.reshape(-1, scale.shape[-1])

    return (*rows(a, a_scale), *rows(b, b_scale), *c)


def fp8_gemm_bind(a, a_scale, b, b_scale, c=None, *, a_block, b_block, out_dtype, backend: GemmBackend):
    """Bind ``jf_fp8_gemm`` on ``backend`` (operands it takes as they are; :func:`jax_fp8.gemm.fp8_gemm`
    pads and checks)."""
    params = dict(a_block=tuple(a_block), b_block=tuple(b_block), out_dtype=np.dtype(out_dtype),
                  accumulate=c is not None, a_dtype=np.dtype(a.dtype), b_dtype=np.dtype(b.dtype), backend=backend)
    a, b = (_as_bytes(x) if np.dtype(x.dtype) in FP8_DTYPES else x for x in (a, b))
    return gemm_p.bind(a, a_scale, b, b_scale, *([] if c is None else [c]), **params)


# ---- batching -----------------------------------------------------------------------------------
def _fold_rows(data, scale, block):
    """A stack of operands (S, rows, K) as one (S*rows, K) operand, or None when its scales cannot be
    stacked (padded 1x128 scale rows; 128x128 tiles with rows % 128 != 0)."""
    S, rows, K = data.shape
    if block == BLOCK_1D and operand_scale_shape(rows, K, block)[1] != rows:
        return None
    if block == BLOCK_1D:
        scale = jnp.moveaxis(scale, 0, 1).reshape(scale.shape[1], S * rows)
    elif rows % FLOAT8_BLOCK == 0:
        scale = scale.reshape(S * scale.shape[1], scale.shape[2])
    else:
        return None
    return data.reshape(S * rows, K), scale


def _gemm_batch(args, dims, **params):
    accumulate = params["accumulate"]
    a_block, b_block = params["a_block"], params["b_block"]
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    stack = [jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
             for x, d in zip(args, dims)]
    batched = [d is not None for d in dims]
    a_side, b_side = batched[0] or batched[1], batched[2] or batched[3]
    flat = all(x.ndim - bd == 2 for x, bd in zip(args[0:3:2], batched[0:3:2]))  # 2-D a and b (not stacked)
    if a_side != b_side and flat:  # one side stacked: fold it into M (or N), one GEMM
        side = 0 if a_side else 2
        folded = _fold_rows(stack[side], stack[side + 1], (a_block, b_block)[side // 2])
        if folded is not None:
            ops = list(args)
            ops[side:side + 2] = folded
            if a_side:
                if accumulate:
                    ops[4] = stack[4].reshape(-1, stack[4].shape[-1])
                out = gemm_p.bind(*ops, **params)
                return out.reshape(size, -1, out.shape[-1]), 0
            if accumulate:
                c = jnp.moveaxis(stack[4], 0, 1)
                ops[4] = c.reshape(c.shape[0], -1)
            out = gemm_p.bind(*ops, **params)
            return out.reshape(out.shape[0], size, -1), 1
    # both sides stacked (or tiles that do not fold): one GEMM per example
    which = [i for i, b in enumerate(batched) if b]

    def one(xs):
        ops = list(args)
        for i, x in zip(which, xs):
            ops[i] = x
        return gemm_p.bind(*ops, **params)

    return lax.map(one, [stack[i] for i in which]), 0


@jax.custom_jvp
def _as_bytes(x):
    """FP8 data as the bytes ``jf_fp8_gemm`` takes; a tangent of them raises as the GEMM's own does."""
    return bitcast(x, np.uint8)


_as_bytes.defjvp(lambda primals, tangents: ad.primitive_jvps[gemm_p](primals, tangents))


# ---- lowering: the reference everywhere, the backend's kernel where it runs --------------------------
def _backend_lowering(platform: str):
    def lower(ctx, *args, backend, **params):
        return backend.lowerings[platform](ctx, *args, **params, **dict(backend.options))
    return lower


def _backend_unavailable(platform: str, params, devices, avals=None) -> Optional[str]:
    backend = params["backend"]
    if platform not in backend.lowerings:
        return f"{backend.name} has no {platform} kernel"
    return backend.unavailable(platform, devices)


gemm_p = define_primitive(
    "jf_fp8_gemm", abstract=_gemm_bytes_abstract, local_abstract=_gemm_abstract, reference=gemm_reference,
    ffi_rules={"cuda": _backend_lowering("cuda")}, unavailable=_backend_unavailable,
    fallback_warning=Fp8GemmFallbackWarning, batch=_gemm_batch,
    rule=Rule(("s", "m", "n", "j", "k"),
              dict(s="the sequences of a", m="M (the rows of a)", n="N (the rows of b)",
                   j="the contracted sequences", k="K (the contraction)"),
              _gemm_sizes, _gemm_arrays, _gemm_why_not, contracted=("j", "k"), local=_gemm_on_shard,
              pad_value=GEMM_SCALE_PAD),
    no_jvp_hint="Use jax_fp8.fp8_dot_general, whose custom VJP runs the backward GEMMs in FP8.")
