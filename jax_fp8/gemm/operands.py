"""GEMM operands and the execution of one planned GEMM: :class:`GemmOperand` (FP8 data and its
GEMM-ready scales), :func:`gemm_operand` (the operand of a quantized tensor, either contraction),
:func:`fp8_gemm` (``a · bᵀ`` of quantized operands), and the operands of ``jax.nn.scaled_matmul``
for MXFP8 tensors."""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .._compat import E8M0_DTYPE
from ..arrays import bitcast, cdiv, view_2d
from ..formats import MX_BLOCK
from ..primitives.partitioning import pad_end
from ..quantization import to_layout
from ..scheme import GEMM_SCALE_PAD
from ..tensors import QUANTIZED_TENSORS, BlockwiseTensor, MXFP8Tensor
from ..warn import Fp8GemmFallbackWarning, warn
from .backends import REFERENCE, implementations
from .contract import BLOCK_1D, BLOCK_2D, MX_BLOCK_1D, GemmBackend, gemm_dtype, operand_scale_shape
from .plan import GemmPlan, plan_gemm, usage_read
from .primitive import fp8_gemm_bind
from .reference import dense_gemm, mx_values, operand_values

Array = Any


# ---- operands -----------------------------------------------------------------------------------
@partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=["block"])
@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """One operand of the TN GEMM: FP8 ``data`` (rows, K), contraction over its last dim, and its fp32
    GEMM-ready ``scale`` for ``block`` ((1, 128) or (128, 128)) blocks (``jf_fp8_gemm``'s contract)."""

    data: Array
    scale: Array
    block: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def values(self):
        """fp32 values (rows, K): the dequantized operand."""
        if self.block == MX_BLOCK_1D:
            return mx_values(self.data, self.scale)
        return operand_values(self.data, self.scale, self.block)

    def padded(self, rows: int, k: int) -> "GemmOperand":
        """Zero rows / columns appended (scale padding 1.0): the same product, aligned shapes."""
        r, c = self.shape
        if (rows, k) == (r, c):
            return self
        scale = pad_end(self.scale, operand_scale_shape(rows, k, self.block), GEMM_SCALE_PAD)
        return GemmOperand(pad_end(self.data, (rows, k)), scale, self.block)


def _share_tiles(q: BlockwiseTensor) -> BlockwiseTensor:
    """128x128 tiles serve both usages: fill the missing one from the other (exact)."""
    q = to_layout(q, "compact")
    src = "rowwise" if q.has_rowwise else "colwise"
    d, s = getattr(q, f"{src}_data"), getattr(q, f"{src}_scale_inv")
    both = dataclasses.replace(q.scheme, rowwise=True, colwise=True)
    return q.with_scheme(both, rowwise_data=d, rowwise_scale_inv=s, colwise_data=d, colwise_scale_inv=s)


def gemm_operand(q, contract: str = "last") -> Optional[GemmOperand]:
    """The GEMM operand of a quantized tensor, viewed as 2-D (R, C): contracted over C
    (``contract='last'``: its rowwise usage, (R, C)) or over R (``'first'``: its columnwise usage, the
    transposed (C, R)). Float8 blockwise: any layout is accepted (converted exactly), 128x128 tiles
    serve both; MXFP8: the scales along the contraction, (rows, ceil(C/32)) uint8 (block (1, 32)).
    Returns None when the tensor does not hold the usage."""
    if not isinstance(q, QUANTIZED_TENSORS):
        raise TypeError(f"gemm_operand: q must be a jax_fp8.BlockwiseTensor or MXFP8Tensor, got {type(q).__name__}")
    if contract not in ("last", "first"):
        raise ValueError(f"gemm_operand: contract must be 'last' or 'first', got {contract!r}")
    if isinstance(q, MXFP8Tensor):
        return _mx_operand(q, usage_read(contract))
    tiles = q.scheme.tiles
    usage = usage_read(contract)
    if usage not in q.usage_blocks():
        if not tiles:
            return None
        q = _share_tiles(q)
    q = to_layout(q, "gemm_ready")
    data, scale = q.usage_fields(usage, "gemm_operand")
    R, C = view_2d(q.shape)
    return GemmOperand(data.reshape(R, C) if usage == "rowwise" else data, scale, BLOCK_2D if tiles else BLOCK_1D)


def _mx_operand(q: MXFP8Tensor, usage: str) -> Optional[GemmOperand]:
    """An MXFP8 tensor's usage as the operand contracted over its blocks' dim (columnwise: transposed)."""
    if usage not in q.usage_blocks():
        return None
    data, scale = q.usage_fields(usage, "gemm_operand")
    R, C = view_2d(q.shape)
    if usage == "rowwise":
        return GemmOperand(data.reshape(R, C), scale, MX_BLOCK_1D)
    data = data if q.scheme.transposed_data(usage) else data.reshape(R, C).T
    return GemmOperand(data, scale.T, MX_BLOCK_1D)


def plan_of(a: GemmOperand, b: GemmOperand, backend=None) -> GemmPlan:
    """The plan of ``a · bᵀ`` for these operands."""
    (M, K), (N, _) = a.shape, b.shape
    if (a.block == MX_BLOCK_1D) != (b.block == MX_BLOCK_1D):
        raise ValueError(f"fp8_gemm: an MXFP8 operand with a Float8 blockwise one ({a.block} and {b.block} blocks)")
    return plan_gemm(M, N, K, a.block, b.block, a.data.dtype, b.data.dtype, backend=backend)


def run_gemm(a, b, out_dtype, plan: GemmPlan, c=None):
    """``a · bᵀ (+ c)`` as ``out_dtype``, as ``plan`` says: on its backend, padded to its sizes (a kernel
    under the ``jf_fp8_gemm`` primitive, or the backend's ``compute``), else by the reference math on the
    operands as they are; no warning here. ``a`` / ``b``: GemmOperands (stacked ones: aligned, as the
    plan checked), or fp32 values (rows, K) where no FP8 operand exists (then dequantize + fp32 dot)."""
    if not (isinstance(a, GemmOperand) and isinstance(b, GemmOperand)):
        vals = [x.values() if isinstance(x, GemmOperand) else x for x in (a, b)]
        return dense_gemm(*vals, c, out_dtype=out_dtype)
    if not plan.ok:  # the reference math on the operands as they are: no overflow the GEMM lacks
        return REFERENCE.compute(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block,
                                 out_dtype=out_dtype)
    dtype = gemm_dtype(out_dtype)
    if a.data.ndim == 3:  # stacked sequences (kernel backends only, as the plan checked)
        out = fp8_gemm_bind(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block, out_dtype=dtype,
                            backend=plan.backend)
        return out.astype(out_dtype)
    (M, N), (Mp, Np, Kp) = (plan.M, plan.N), plan.padded
    if c is not None:
        c = pad_end(c.astype(dtype), (Mp, Np))
    a, b = a.padded(Mp, Kp), b.padded(Np, Kp)
    if plan.backend.compute is not None:  # a jax function
        out = plan.backend.compute(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block,
                                   out_dtype=dtype)
    else:  # a kernel under the primitive
        out = fp8_gemm_bind(a.data, a.scale, b.data, b.scale, c, a_block=a.block, b_block=b.block, out_dtype=dtype,
                            backend=plan.backend)
    return out[:M, :N].astype(out_dtype)


def fp8_gemm(a, b, out_dtype=jnp.bfloat16, c=None, *, backend: GemmBackend | str | None = None):
    """``a · bᵀ (+ c)`` on the FP8 GEMM, for already-quantized operands.

    ``a`` (M, K) and ``b`` (N, K): :class:`GemmOperand`, :class:`~jax_fp8.BlockwiseTensor` or
    :class:`~jax_fp8.MXFP8Tensor` (2-D view, contracted over its last dim, see :func:`gemm_operand`;
    both MXFP8 or neither). Misaligned shapes are padded (:func:`~jax_fp8.gemm.plan.plan_gemm`); what
    no GEMM backend takes is computed by the reference math, with a :class:`Fp8GemmFallbackWarning`.
    ``out_dtype``: float32, bfloat16 (the GEMM's own outputs) or float16 (computed in fp32). Not
    differentiable (use :func:`jax_fp8.fp8_dot_general`). ``backend``: a
    :class:`~jax_fp8.gemm.contract.GemmBackend` (e.g. ``CUTLASS.with_options(config=1)``) or a backend's
    name (``"cublaslt"``, ``"cutlass"``, ``"cudnn"``, ``"reference"``) to run it on instead of the plan's
    choice (to compare backends); one that does not take the operands' format or shape computes the
    reference, with the warning.
    """
    ops = []
    for name, x in (("a", a), ("b", b)):
        if isinstance(x, QUANTIZED_TENSORS):
            op = gemm_operand(x, "last")
            if op is None:
                raise ValueError(f"fp8_gemm: {name} has no rowwise usage (its 1x128 blocks along the last dim)")
            x = op
        if not isinstance(x, GemmOperand):
            raise TypeError(f"fp8_gemm: {name} must be a GemmOperand, BlockwiseTensor or MXFP8Tensor, got "
                            f"{type(x).__name__}")
        ops.append(x)
    if ops[0].shape[1] != ops[1].shape[1]:
        raise ValueError(f"fp8_gemm: a {ops[0].shape} and b {ops[1].shape} must share K, their last dim")
    if isinstance(backend, str):
        names = implementations()
        if backend not in names:
            raise ValueError(f"fp8_gemm: backend must be a GemmBackend, one of {sorted(names)} or None, got "
                             f"{backend!r}")
        backend = names[backend]
    if backend is not None and not isinstance(backend, GemmBackend):
        raise TypeError(f"fp8_gemm: backend must be a GemmBackend, a backend's name or None, got "
                        f"{type(backend).__name__}")
    plan = plan_of(*ops, backend=backend)
    if not plan.ok and not plan.empty:
        warn(f"fp8_gemm: computed by the reference math: the FP8 GEMM cannot take {plan.reason}",
             Fp8GemmFallbackWarning)
    return run_gemm(*ops, jnp.dtype(out_dtype), plan, c)


# ---- MXFP8 interop (Blackwell: cuDNN through jax.nn.scaled_matmul) ---------------------------------
def mxfp8_scaled_matmul_operands(q: MXFP8Tensor, usage: str = "rowwise"):
    """An MXFP8 tensor as one operand of ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM on
    Blackwell): ``(data, scales)`` of shapes (1, rows, Kp) FP8 and (1, rows, Kp/32) ``float8_e8m0fnu``.

    ``usage='rowwise'``: the (M, K) 2-D view contracted over K (1x32 blocks); ``'colwise'``: the (K, M)
    transpose contracted over M (32x1 blocks). The contraction dim is zero-padded to a multiple of 32
    (``scaled_matmul`` infers the block size as K // K_scales), which changes no product. With
    ``a, sa = mxfp8_scaled_matmul_operands(qx)`` and ``b, sb = mxfp8_scaled_matmul_operands(qw)`` for x
    (M, K) and W (N, K), ``jax.nn.scaled_matmul(a, b, sa, sb)[0]`` is ``x̃ · W̃ᵀ`` of the dequantized
    operands. (jax 0.10 lowers ``scaled_matmul`` on CUDA and ROCm only; its ROCm rule is
    ``lax.scaled_dot`` with dimension numbers (((2,), (2,)), ((0,), (0,))), which runs anywhere.)
    """
    if not isinstance(q, MXFP8Tensor):
        raise TypeError(f"mxfp8_scaled_matmul_operands: q must be a jax_fp8.MXFP8Tensor, got {type(q).__name__}")
    if E8M0_DTYPE is None:
        raise NotImplementedError("mxfp8_scaled_matmul_operands: this jax has no float8_e8m0fnu dtype")
    if usage not in ("rowwise", "colwise"):
        raise ValueError(f"mxfp8_scaled_matmul_operands: usage must be 'rowwise' or 'colwise', got {usage!r}")
    data, scale = q.usage_fields(usage, "mxfp8_scaled_matmul_operands")
    M, K = view_2d(q.shape)
    if usage == "rowwise":
        data = data.reshape(M, K)
    else:  # columnwise: (K, M) data, contraction over M; compact scales (ceil(M/32), K) transposed
        data = data if q.scheme.transposed_data(usage) else data.reshape(M, K).T
        scale = scale.T
    k = data.shape[1]
    data = jnp.pad(data, ((0, 0), (0, cdiv(k, MX_BLOCK) * MX_BLOCK - k)))
    return data[None], bitcast(jnp.asarray(scale), E8M0_DTYPE)[None]
