"""jax_fp8's FP8 GEMM: ``fp8_dot_general``, the recipes, and the backends that run the products.

The parts, from the user's call down:

- :mod:`.dot_general`: :func:`fp8_dot_general`, a drop-in ``lax.dot_general`` with an FP8 VJP; it
  quantizes the operands with the recipe (:mod:`.recipes`: :class:`Float8BlockScaling`,
  :class:`MXFP8BlockScaling`) and executes the plan, forward and backward.
- :mod:`.plan`: decided once per call from static facts: whether the ``dot_general`` folds into a 2-D
  GEMM by reshapes, its three GEMMs (fprop, dgrad, wgrad) and, per GEMM, the backend, kernel and
  padded sizes (:class:`GemmPlan`), or why the reference math computes it. :mod:`.table` holds the
  kernels measured fastest per GPU and shape; :mod:`.crossover` the shapes where FP8 paid at all
  (``where="auto"``).
- :mod:`.operands`: :class:`GemmOperand` (FP8 data and GEMM-ready scales) taken from quantized
  tensors, :func:`fp8_gemm` (``a · bᵀ`` of quantized operands) and ``run_gemm``, which runs one planned
  GEMM: on its backend, padded, or by the reference math.
- :mod:`.contract`: the product every backend computes and :class:`~.contract.GemmBackend`, what a
  backend states: the formats and shapes it takes (its padding), whether it runs here and why not, its
  lowering (a kernel under the primitive) or its computation (a jax function), its options.
- :mod:`.backends`: one module per backend (``cublaslt``, ``cutlass``: Float8 blockwise on Hopper;
  ``cudnn``: MXFP8 on Blackwell; ``reference``: everywhere) and the registry, ``BACKENDS``.
- :mod:`.primitive`: ``jf_fp8_gemm``, the primitive a kernel backend lowers under: abstract eval,
  batching, partitioning under ``jit``, stacked sequences.
- :mod:`.reference`: the reference math, the one definition of the numbers.
- :mod:`.ragged`: :func:`fp8_ragged_dot`, a drop-in ``lax.ragged_dot`` (mixture-of-experts grouped
  GEMMs) with an FP8 VJP, its rows' groups read on the device (:mod:`jax_fp8.groups`);
  :mod:`.ragged_primitive`: ``jf_fp8_ragged_gemm``, its grouped GEMMs (CUTLASS's grouped kernels on
  Hopper, the reference math elsewhere), partitioned over the experts under ``jit``.

A product flows: ``fp8_dot_general`` -> plan (fold, three GEMMs, a backend each) -> quantize x, W (and
dy in the backward) -> operands -> ``run_gemm`` -> the backend's kernel under ``jf_fp8_gemm`` (or its
jax function; or the reference math).

How to add a backend: write one module in :mod:`jax_fp8.gemm.backends` that defines a
:class:`~.contract.GemmBackend` (its ``sizes``, ``unavailable``, ``lowerings`` or ``compute``,
``formats``, options), and add its line to ``BACKENDS`` in ``backends/__init__.py``. The plan then
runs a GEMM on it where it takes it and runs here (or where :mod:`.table` names it), and users can
name it: ``fp8_dot_general(..., implementation="<its name>")``, ``fp8_gemm(..., backend=...)``.
"""
from ..warn import Fp8GemmFallbackWarning, MXFP8GemmFallbackWarning
from . import crossover, table
from .contract import GemmBackend
from .dot_general import fp8_dot_general
from .operands import GemmOperand, fp8_gemm, gemm_operand, mxfp8_scaled_matmul_operands
from .plan import GemmPlan, plan_gemm
from .ragged import fp8_ragged_dot
from .recipes import RECIPES, Float8BlockScaling, MXFP8BlockScaling

__all__ = ["fp8_dot_general", "fp8_ragged_dot", "fp8_gemm", "gemm_operand", "plan_gemm", "GemmOperand", "GemmPlan", "GemmBackend",
           "Float8BlockScaling", "MXFP8BlockScaling", "RECIPES", "Fp8GemmFallbackWarning", "MXFP8GemmFallbackWarning",
           "mxfp8_scaled_matmul_operands"]
