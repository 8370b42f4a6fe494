"""``jf_fp8_gemm``: ``out = A · Bᵀ (+ C)`` on FP8 operands with Float8 block scales, the "TN" GEMM of
Hopper's FP8 tensor cores (cuBLASLt ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`` / ``BLK128x128_32F``).

Contract, the same for every lowering (the jax.numpy reference below, and each backend's kernel:
:class:`GemmBackend`, e.g. cuBLASLt on CUDA, :mod:`.cublaslt`):

- operands ``a, a_scale, b, b_scale[, c]``:

  - ``a``: (M, K) and ``b``: (N, K), both K-major (the contraction dim is the last one, contiguous),
    dtype ``float8_e4m3fn`` or ``float8_e5m2`` each, not both E5M2;
  - ``a_scale`` / ``b_scale``: fp32 ``scale_inv`` (dequantized value = data * scale) in the GEMM-ready
    order of ``Scheme.scale_shape`` (TransformerEngine's GEMM_READY), for an operand of ``rows`` rows:
    1x128 blocks ``(ceil(K/128), roundup(rows, 4))`` (transposed: rows contiguous), 128x128 blocks
    ``(ceil(rows/128), roundup(ceil(K/128), 4))``; padding entries are read by nobody (1.0 by
    convention, ``GEMM_SCALE_PAD``);
  - ``c`` (only with ``accumulate=True``): (M, N) of ``out_dtype``; ``out = A·Bᵀ + C``. A lowering may
    alias it with the output.

- params: ``a_block``, ``b_block`` each ``(1, 128)`` or ``(128, 128)``; ``out_dtype`` ``float32`` or
  ``bfloat16``; ``accumulate`` (bool); ``backend``, the :class:`GemmBackend` that runs it.
- shapes the backend takes with no padding left to do (its ``sizes`` returns them unchanged; for
  cuBLASLt: M, N, K >= 1, K % 16 == 0, N % 8 == 0, M % 8 == 0 when ``a`` has 1x128 blocks, not both
  operands 128x128 or E5M2). The abstract eval rejects anything else, on every platform, so the
  reference path enforces what the backend needs.
- result: (M, N) ``out_dtype``. The reference (:func:`blocked_gemm`) forms it as the tensor cores do:
  for each 128-wide K block, the fp32 product (``Precision.HIGHEST``) of the FP8 data, times that
  block's ``a`` row scale times its ``b`` row scale, summed over the blocks in fp32; ``+ C`` in fp32;
  rounded to ``out_dtype``. Values are scaled only after each block's product, so it overflows only
  where a scaled partial product, a scale product or the sum does (as the FP8 GEMM), never because a
  dequantized operand times another exceeds fp32. A tensor-core lowering differs from it only by
  accumulation order and precision.

"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._compat import ShapedArray, ad, ffi
from ..arrays import bitcast, cdiv, xp_of
from ..formats import FLOAT8_BLOCK, FP8_DTYPES
from .. import contracts
from ..scheme import GEMM_SCALE_PAD, Scheme, check_block
from ..vma import out_aval
from ..warn import Fp8GemmFallbackWarning
from .partitioning import Dim, Rule
from .quantize import scale_dims
from .registration import define_primitive

BLOCK_1D = (1, FLOAT8_BLOCK)
BLOCK_2D = (FLOAT8_BLOCK, FLOAT8_BLOCK)
#: Output dtypes of the primitive (others: compute in fp32 and cast).
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


#: GEMM dims are 32-bit ints in cuBLASLt, TE and CUTLASS.
MAX_DIM = 2**31 - 1
#: Padding is "cheap" while the padded GEMM does at most this many times the multiply-adds of the
#: unpadded one. Padding costs one copy of the FP8 operands (<= 15 zero columns, <= 7 zero rows) and a
#: slice of the output; the fallback (the reference: fp32 dots of the FP8 data at HIGHEST) moves >= 4x
#: the operand bytes and runs the dot on CUDA cores, ~30x slower than FP8 tensor cores on H100/H200
#: (67 vs 1979 dense TFLOP/s). Padding up to 16x the work stays ahead; the fallback is left to
#: degenerate shapes (e.g. M = N = 1, or M = 1 with K = 1).
MAX_PAD_GROWTH = 16


def refused(M: int, N: int, K: int, a_dtype, b_dtype) -> Optional[str]:
    """What no backend's FP8 GEMM takes: a dim over :data:`MAX_DIM`, both operands E5M2; else None."""
    if max(M, N, K) > MAX_DIM:
        return f"a GEMM dim over 2**31 - 1 ({M}x{N}x{K})"
    if jnp.dtype(a_dtype) == jnp.dtype(jnp.float8_e5m2) == jnp.dtype(b_dtype):
        return "E5M2 on both operands (FP8 GEMMs take at most one E5M2 operand)"
    return None


def padded_sizes(library: str, M: int, N: int, K: int, align: tuple) -> tuple[Optional[tuple], Optional[str]]:
    """``((Mp, Np, Kp), None)``: M, N, K rounded up to ``align`` = (M's, N's, K's multiple), which a
    backend's ``sizes`` gives when zero padding to them is cheap (:data:`MAX_PAD_GROWTH`); else
    ``(None, why not)`` naming ``library``."""
    Mp, Np, Kp = (cdiv(v, m) * m for v, m in zip((M, N, K), align))
    growth = (Mp * Np * Kp) / (M * N * K)
    if growth > MAX_PAD_GROWTH:
        return None, (f"padding {M}x{N}x{K} to {library}'s alignment ({Mp}x{Np}x{Kp}) would multiply the GEMM's "
                      f"work by {growth:.0f} (more than {MAX_PAD_GROWTH})")
    return (Mp, Np, Kp), None


def cuda_capabilities(devices: Optional[Sequence] = None) -> tuple[set, Optional[str]]:
    """The compute capabilities (``{"9.0"}`` on an H100/H200) of the GPUs among ``devices`` (those a
    lowering compiles for, also ahead of time on a machine without them), else of this process's CUDA
    devices; and None, or an empty set and why there are none. Never raises (a backend's
    ``unavailable`` asks it)."""
    gpus = [d for d in devices or () if d.platform in ("gpu", "cuda")]
    try:
        gpus = gpus or jax.devices("cuda")
    except Exception as e:  # no CUDA backend
        return set(), f"no CUDA device ({e})"
    caps = {str(getattr(d, "compute_capability", "?")) for d in gpus}
    return caps, None if caps else "no CUDA device"


def lower_with_workspace(target: str, ctx, workspace_bytes: int, *operands, **attrs) -> list:
    """The lowering of a GEMM backend's custom call ``target`` that takes its workspace as one more
    result, ``workspace_bytes`` of uint8, dropped here: a result buffer, unlike XLA's scratch, lives
    while a CUDA graph that captured the call replays, and XLA reuses its memory once the call has run."""
    ctx = ctx.replace(avals_out=[*ctx.avals_out, ShapedArray((workspace_bytes,), np.uint8)])
    return ffi.ffi_lowering(target)(ctx, *operands, **attrs)[:1]


def operand_scheme(block, dtype=jnp.float8_e4m3fn) -> Scheme:
    """The scheme whose rowwise usage is a GEMM operand with ``block`` blocks (GEMM-ready layout)."""
    return Scheme("blockwise", dtype, block=tuple(block), layout="gemm_ready")


def operand_scale_shape(rows: int, k: int, block) -> tuple[int, int]:
    """GEMM-ready scale shape of a (rows, k) operand, contraction over k (``Scheme.scale_shape``)."""
    return operand_scheme(block).scale_shape(rows, k, "rowwise")


@dataclasses.dataclass(frozen=True, eq=False)
class GemmBackend:
    """A library that runs ``jf_fp8_gemm``, passed to the primitive as its ``backend`` param (one
    module per backend; :mod:`jax_fp8.gemm_plan` lists them and picks one per GEMM):

    - ``sizes(M, N, K, a_block, b_block, a_dtype, b_dtype)``: ``((M, N, K) to run at, None)`` (zero
      padding up to those sizes changes no product), or ``(None, why it cannot take the problem)``;
    - ``unavailable(platform, devices=None)``: asked when lowering: None where it runs on ``devices``
      (those the lowering compiles for; None: this process's), else why not (the reference then
      lowers the call, with one :class:`Fp8GemmFallbackWarning`);
    - ``lowerings``: platform -> MLIR lowering rule of its kernel, with the primitive's operands and
      params (``backend`` excepted) and the backend's ``options`` as keywords. ``gemm_p`` dispatches
      to them on ``cuda``; a backend for another platform adds that platform to ``gemm_p``'s
      ``ffi_rules`` too (elsewhere the reference lowers it);
    - ``options``: ``((name, int), ...)``, which of the backend's kernels runs (a cuBLASLt algorithm,
      a CUTLASS configuration); ``()``: the backend's own choice. :meth:`with_options` makes them, one
      object per choice (the primitive's params compare backends by identity);
    - ``check_options(**options)``: raises ValueError or TypeError naming an option the backend does
      not know or a value out of its range."""

    name: str
    sizes: Callable
    unavailable: Callable
    lowerings: dict
    check_options: Callable = dataclasses.field(default=lambda **options: None, repr=False)
    options: tuple = ()
    base: Optional["GemmBackend"] = dataclasses.field(default=None, repr=False)

    def with_options(self, **options: int) -> "GemmBackend":
        """This backend running the kernel ``options`` name, checked (the same object for the same
        options; none: the backend with its own choice)."""
        root = self.base or self
        opts = tuple(sorted((k, int(v)) for k, v in options.items()))
        if not opts:
            return root
        key = (id(root), opts)
        if key not in _VARIANTS:
            root.check_options(**dict(opts))
            _VARIANTS[key] = dataclasses.replace(root, options=opts, base=root)
        return _VARIANTS[key]

    def __repr__(self) -> str:  # the backend as the jaxpr prints it
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.options)})"


#: (id of a backend, options) -> its variant; backends live as long as the process (module constants)
_VARIANTS: dict = {}


# ---- reference math: the one definition of the GEMM's numbers -----------------------------------
def _compact_scales(data, scale, block):
    """An operand's GEMM-ready ``scale`` as its compact grid (ceil(rows/bm), ceil(K/128))."""
    rows, k = data.shape
    return operand_scheme(block, data.dtype).scales_to_layout(xp_of(data, scale), scale, rows, k, "rowwise",
                                                               "compact")


def operand_values(data, scale, block):
    """fp32 values (rows, K) of a GEMM operand: FP8 ``data`` times its GEMM-ready block ``scale``."""
    scheme = operand_scheme(block, data.dtype)
    return contracts.dequantize_blocks(bitcast(data, np.uint8), _compact_scales(data, scale, block),
                                       scheme=scheme.only("rowwise"), out_dtype=np.float32)


def dense_gemm(a_values, b_values, c=None, *, out_dtype):
    """``a_values · b_valuesᵀ (+ c)`` in fp32 (``Precision.HIGHEST``), rounded to ``out_dtype``: for
    operands that exist only as fp32 values (FP8 operands: :func:`blocked_gemm`)."""
    out = lax.dot_general(a_values, b_values, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    if c is not None:
        out = out + c.astype(jnp.float32)
    return out.astype(out_dtype)


def blocked_gemm(a, a_scale, b, b_scale, c=None, *, a_block, b_block, out_dtype):
    """``a · bᵀ (+ c)`` of FP8 operands (``jf_fp8_gemm``'s contract, any shape) as the tensor-core GEMM
    forms it: per 128-wide K block kb, ``acc += (a_kb · b_kbᵀ) * (sa[:, kb] ⊗ sb[:, kb])``, the product
    of the unscaled FP8 data in fp32 at ``Precision.HIGHEST`` (at most 448² · 128 in size), scaled
    after it, accumulated in fp32; ``+ c`` in fp32; rounded to ``out_dtype``. A scan over the K
    blocks: memory O(M·N + (M + N)·K), not one (M, N) partial per block."""
    K = a.shape[1]
    nk = cdiv(K, FLOAT8_BLOCK)
    if nk == 0:  # nothing to contract: zeros (+ c)
        return dense_gemm(a.astype(jnp.float32), b.astype(jnp.float32), c, out_dtype=out_dtype)

    def k_blocks(data, scale, block):
        """(nk, rows, 128) FP8 data (K zero-padded: zeros add nothing) and (nk, rows) fp32 row scales."""
        rows = data.shape[0]
        s = jnp.repeat(jnp.asarray(_compact_scales(data, scale, block), jnp.float32), block[0], axis=0)[:rows]
        if K != nk * FLOAT8_BLOCK:
            data = jnp.pad(data, ((0, 0), (0, nk * FLOAT8_BLOCK - K)))
        return jnp.swapaxes(jnp.reshape(data, (rows, nk, FLOAT8_BLOCK)), 0, 1), s.T

    def scaled_partial(ak, sa, bk, sb):
        part = lax.dot_general(ak.astype(jnp.float32), bk.astype(jnp.float32), (((1,), (1,)), ((), ())),
                               precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return part * (sa[:, None] * sb[None, :])

    xs = (*k_blocks(a, a_scale, a_block), *k_blocks(b, b_scale, b_block))
    # block 0 starts the sum: the carry then has the operands' type (shard_map's varying axes)
    acc, _ = lax.scan(lambda acc, blk: (acc + scaled_partial(*blk), None), scaled_partial(*(x[0] for x in xs)),
                      tuple(x[1:] for x in xs))
    if c is not None:
        acc = acc + c.astype(jnp.float32)
    return acc.astype(out_dtype)


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


def _backend_unavailable(platform: str, params, devices) -> Optional[str]:
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
