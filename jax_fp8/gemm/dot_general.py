"""``fp8_dot_general``: a drop-in ``lax.dot_general`` on the FP8 GEMM, with a training VJP whose three
GEMMs all run in FP8; it executes the plan (:mod:`jax_fp8.gemm.plan`) on the operands
(:mod:`jax_fp8.gemm.operands`).

For ``y = x · W`` with x (M, K) and W (N, K) (or (K, N), flax's kernel), with the Float8 blockwise
recipe (:class:`~jax_fp8.gemm.recipes.Float8BlockScaling`; MXFP8 the same with 1x32 / 32x1 blocks):

- fprop ``y = x · Wᵀ``: x rowwise (1x128) x W with 128x128 tiles, contraction over K;
- dgrad ``dx = dy · W``: dy rowwise (1x128) x W's other orientation (the same tiles, transposed, from
  the same quantization pass), contraction over N;
- wgrad ``dW = dyᵀ · x``: the columnwise usages of dy and x (128x1 blocks along M, stored transposed:
  K-major for a contraction over M), 1x128 x 1x128.

x and W are quantized once in the forward (both usages in one pass, GEMM-ready layout) and saved as the
operands the backward needs; dy is quantized once (rowwise and columnwise in one call).
"""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import vma
from ..arrays import view_2d
from ..formats import HIGH_DTYPES, MXFP8
from ..primitives.partitioning import explicit_sharding, spec_axes
from ..quantization import dequantize, quantize, quantize_dequantize, quantize_stacked
from ..scheme import Scheme
from ..tensors import QUANTIZED_TENSORS
from ..warn import Fp8GemmFallbackWarning, warn
from .backends import REFERENCE, implementations
from .backends.cudnn import warn_emulated
from .contract import BLOCK_1D, BLOCK_2D, GemmBackend
from .operands import GemmOperand, gemm_operand, run_gemm
from .plan import DotPlan, Step, dimension_numbers_tuple, fold_dot_general, plan_dot_general, usage_read
from .recipes import RECIPES, Float8BlockScaling, MXFP8BlockScaling

Array = Any


# ---- the linear layer with its VJP: it executes the plan ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class Linear:
    """Static description of one ``y = x · W``: the recipe, the plan of its GEMMs, the output dtype,
    and x's and W's shardings where their types carry one (an Explicit mesh): a custom VJP's gradients
    must have the primals' types."""

    recipe: Float8BlockScaling
    plan: DotPlan
    out_dtype: np.dtype
    x_sharding: Any = None
    w_sharding: Any = None


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A (B, S, K) activation or gradient quantized as its B*S rows with B and S kept apart, so that a
    split S stays split under jit (:func:`~jax_fp8.quantization.quantize_stacked`): rowwise data (B, S, K)
    with scales (K/128, B, S), columnwise data (K, B, S) with scales (B, S/128, K); the stacked
    operands of the ``jf_fp8_gemm`` primitive, folded by reshapes. With S % 128 == 0 every block lies inside one
    sequence: the same blocks, bits and GEMMs as the (B*S, K) tensor's."""

    usages: dict  # usage -> (FP8 data, fp32 scale)

    @classmethod
    def of(cls, x3, scheme: Scheme) -> "_Stacked":
        return cls(quantize_stacked(x3, scheme))

    def operand(self, contract: str) -> GemmOperand:
        data, scale = self.usages[usage_read(contract)]
        return GemmOperand(data, scale, BLOCK_1D)


def _sequences_may_split(x, free_dims: tuple) -> bool:
    """Stacking is needed only where ``x``'s sequences may be split over devices: elsewhere the folded
    GEMMs are the same kernels and bits (stacked operands fold by reshapes), with fewer constraints
    (no padding). An Explicit type says whether one of ``x``'s free dims (those that fold into M) other
    than the first is split; inside shard_map the arrays are local; otherwise (Auto axes: the split is
    decided when XLA compiles) it may be wherever jit has more than one device."""
    s = explicit_sharding(x)
    if s is not None:
        spec = tuple(s.spec) + (None,) * (x.ndim - len(tuple(s.spec)))
        return any(spec[d] is not None for d in free_dims[1:])
    types = tuple(jax.sharding.get_abstract_mesh().axis_types)
    if types and all(t == jax.sharding.AxisType.Manual for t in types):  # inside shard_map: local arrays
        return False
    return len(jax.devices()) > 1 or len(jax.devices("cpu")) > 1


def _quantized(x, scheme: Scheme):
    if isinstance(x, QUANTIZED_TENSORS):
        return x
    return _Stacked.of(x, scheme) if x.ndim == 3 else quantize(x, scheme)


def _operand(q, contract: str):
    return q.operand(contract) if isinstance(q, _Stacked) else gemm_operand(q, contract)


def _run(step: Step, tensors: dict, out_dtype):
    """One planned GEMM on the quantized ``tensors`` ('x', 'w', 'dy') its operands name."""
    a, b = (_operand_or_values(tensors[o.tensor], o.contract) for o in (step.a, step.b))
    return run_gemm(a, b, out_dtype, step.gemm)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear(x, w, cfg: Linear):
    """y (M, N) = x · W on the FP8 GEMM. x: (M, K) array or BlockwiseTensor; w: (N, K) / (K, N)."""
    fprop = cfg.plan.step("fprop")
    w_rowwise = fprop.b.contract == "last"
    xq = _quantized(x, cfg.recipe.scheme("lhs", colwise=False))
    wq = _quantized(w, cfg.recipe.scheme("rhs", rowwise=w_rowwise, colwise=not w_rowwise))
    return _run(fprop, {"x": xq, "w": wq}, cfg.out_dtype)


def _linear_fwd(x, w, cfg: Linear):
    """Forward: quantize x (1x128, both usages) and W (128x128, both orientations) once, then
    :func:`linear_forward`; the residuals add the primals' dtypes."""
    tensors = {"x": _quantized(x, cfg.recipe.scheme("lhs")), "w": _quantized(w, cfg.recipe.scheme("rhs"))}
    y, saved = linear_forward(cfg, tensors)
    return y, (saved, _dtype_of(x), _dtype_of(w))


def linear_forward(cfg: Linear, tensors: dict):
    """The fprop GEMM of the quantized tensors ``{'x', 'w'}`` (GEMM-ready, every usage the plan's
    backward reads), and the backward GEMMs' operands of x and W to save: in the orientations the plan
    gives them (xᵀ (K, M) for wgrad, W as (K, N) for dgrad). An operand the backward needs but a
    pre-quantized tensor lacks is saved as fp32 values instead."""
    y = _run(cfg.plan.step("fprop"), tensors, cfg.out_dtype)
    saved = tuple(_operand_or_values(tensors[o.tensor], o.contract)
                  for step in cfg.plan.backward for o in (step.a, step.b) if o.tensor != "dy")
    return y, saved


def _operand_or_values(q, contract: str):
    """``gemm_operand(q, contract)``, or, where ``q`` lacks that usage, its fp32 values in the same
    orientation (the backward then computes that GEMM by the reference math)."""
    op = _operand(q, contract)
    if op is not None:
        return op
    v = dequantize(q, jnp.float32).reshape(view_2d(q.shape))
    return v if contract == "last" else v.T


def _dtype_of(v):
    """A zero-size array carrying ``v``'s dtype (dtypes are not valid residuals)."""
    return None if isinstance(v, QUANTIZED_TENSORS) else jnp.zeros((0,), v.dtype)


def _linear_bwd(cfg: Linear, res, dy):
    saved, x_dtype, w_dtype = res
    with reverse_mode_only():  # under jax.hessian this runs under forward mode: say why it cannot
        dyq = _quantized(dy, cfg.recipe.scheme("grad"))  # rowwise (dgrad) and columnwise (wgrad) in one pass
    return linear_backward(cfg, saved, dyq, *(None if d is None else d.dtype for d in (x_dtype, w_dtype)))


def linear_backward(cfg: Linear, saved: tuple, dyq, x_dtype, w_dtype):
    """(dx, dW) from the quantized output gradient ``dyq`` (both usages) and :func:`linear_forward`'s
    ``saved`` operands, in ``x_dtype`` and ``w_dtype`` (None where the plan computes no such gradient)."""
    saved, grads = iter(saved), {}  # in linear_forward's order: the backward steps' x and W operands
    for step in cfg.plan.backward:  # dgrad: dx = dy · W over N; wgrad: dW = dyᵀ · x over M
        a, b = (_operand(dyq, o.contract) if o.tensor == "dy" else next(saved) for o in (step.a, step.b))
        x_grad = step.name == "dgrad"
        dtype = x_dtype if x_grad else w_dtype
        sharding = cfg.x_sharding if x_grad else cfg.w_sharding
        grads[step.name] = retyped(run_gemm(a, b, dtype, step.gemm), sharding)
    return grads.get("dgrad"), grads.get("wgrad")


def _explicit_sharding_of(v):
    """:func:`explicit_sharding` of an array operand (a pre-quantized tensor gets no gradient)."""
    return None if isinstance(v, QUANTIZED_TENSORS) else explicit_sharding(v)


def _lax_sharding(lhs, rhs, dimension_numbers):
    """The sharding an Explicit mesh types ``lax.dot_general(lhs, rhs, dimension_numbers)`` with (None
    where no operand's type names one, or where lax itself would ask for an ``out_sharding``)."""
    ops = [dequantize(v) if isinstance(v, QUANTIZED_TENSORS) else v for v in (lhs, rhs)]
    if all(explicit_sharding(v) is None for v in ops):
        return None
    typed = []
    try:
        jax.eval_shape(lambda a, b: typed.append(jax.typeof(lax.dot_general(a, b, dimension_numbers)).sharding), *ops)
    except Exception:  # noqa: BLE001  (lax's ShardingTypeError: no type to match)
        return None
    return typed[0]


def reduction_order_reason(reduction_order) -> Optional[str]:
    """Why a call with jax 0.12's ``reduction_order`` cannot run on the FP8 GEMMs (None where they satisfy
    it: none given, or "unordered", any order): they sum in an order of their own."""
    if reduction_order is None or getattr(reduction_order, "name", reduction_order) == "unordered":
        return None
    return f"reduction_order={reduction_order!r} is given (the FP8 GEMM sums in an order of its own)"


def lax_keywords(**kw) -> dict:
    """The keyword arguments given (not None), for the lax function a fallback calls: one that this jax's
    lax lacks (``reduction_order`` before jax 0.12) is passed only where the caller gave it."""
    return {k: v for k, v in kw.items() if v is not None}


def _mesh_and_spec(sharding):
    """(mesh, PartitionSpec) of a NamedSharding, or of a PartitionSpec of the mesh in context."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh, sharding.spec
    return jax.sharding.get_abstract_mesh(), sharding


def lax_takes_out_sharding(sharding) -> bool:
    """Whether lax's functions take ``sharding`` as their ``out_sharding``: it names Explicit mesh axes only
    (lax rejects Auto and Manual ones; :func:`retyped` places a result on them instead)."""
    mesh, spec = _mesh_and_spec(sharding)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return all(types.get(a) == jax.sharding.AxisType.Explicit for dim in spec_axes(spec, len(spec)) for a in dim)


def lax_call(f, *args, out_sharding=None, reduction_order=None, **kw):
    """``f(*args, **kw)`` of a fallback, with ``out_sharding`` as lax takes it (Explicit axes) or, where lax
    rejects it (Auto axes), as :func:`retyped` places it; ``reduction_order`` only where given."""
    to_lax = out_sharding if out_sharding is not None and lax_takes_out_sharding(out_sharding) else None
    y = f(*args, **kw, **lax_keywords(out_sharding=to_lax, reduction_order=reduction_order))
    return y if to_lax is not None else retyped(y, out_sharding)


def retyped(v, sharding):
    """``v`` placed as ``sharding`` (a NamedSharding, or a PartitionSpec of the mesh in context), as lax's
    ``out_sharding``: a type on an Explicit mesh (``reshard``), a constraint on an Auto one."""
    if sharding is None or jax.typeof(v).sharding == sharding:
        return v
    mesh, _ = _mesh_and_spec(sharding)
    if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
        return jax.sharding.reshard(v, sharding)
    return lax.with_sharding_constraint(v, sharding)


@contextlib.contextmanager
def reverse_mode_only(where: str = "fp8_dot_general"):
    """Turn jax's forward-mode error inside ``where``'s FP8 GEMM path into one that names it."""
    try:
        yield
    except TypeError as e:
        if "forward-mode" in str(e) or "is not differentiable" in str(e):
            raise TypeError(
                f"{where}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian), and a derivative "
                "of a derivative (jax.grad of jax.grad), are not supported on the FP8 GEMM path: its "
                "derivative is a custom VJP whose backward GEMMs run in FP8 on the operands quantized in the "
                "forward, a rule for first-order reverse mode only. Use reverse mode once (jax.grad, jax.vjp, "
                "jax.jacrev), or the lax function it replaces where forward mode or higher derivatives are "
                "needed."
            ) from e
        raise


_linear.defvjp(_linear_fwd, _linear_bwd)


# ---- dot_general ----------------------------------------------------------------------------------------
def fallback_operand(x, scheme: Scheme) -> tuple[Any, str]:
    """The fallback's operand, and what was done to it (for the warning): quantize-dequantize with the
    recipe's ``scheme`` for its role (rowwise blocks, TE's rule for infinities; a straight-through
    gradient), dequantized values of a quantized tensor, or the operand as it is where there is
    nothing FP8 could quantize."""
    if isinstance(x, QUANTIZED_TENSORS):
        return dequantize(x), "dequantized"
    if jnp.dtype(x.dtype) not in HIGH_DTYPES:
        return x, f"as it is ({jnp.dtype(x.dtype).name} is not a float type FP8 can quantize)"
    if x.ndim == 0 or x.size == 0:
        return x, f"as it is ({'a scalar' if x.ndim == 0 else 'empty'}: nothing to quantize)"
    qdq = quantize_dequantize(x, dataclasses.replace(scheme.only("rowwise"), layout="compact", saturate_inf=True),
                              "rowwise")
    if scheme.format is MXFP8:
        return qdq, "quantize-dequantized (MXFP8)"
    blocks = "128x128 tiles" if tuple(scheme.block) == BLOCK_2D else "x".join(map(str, scheme.block)) + " blocks"
    # infinities reach the dot, as in lax.dot_general
    return jnp.where(jnp.isfinite(x), qdq, x), f"quantize-dequantized ({blocks})"


def what_is_computed(lhs_done: str, rhs_done: str, op: str = "lax.dot_general") -> str:
    """The fallback's computation (``op`` of the operands) in words, from what was done to each operand
    (:func:`fallback_operand`)."""
    as_is = "as it is ("
    if lhs_done.startswith(as_is) and rhs_done.startswith(as_is):
        whys = dict.fromkeys(d[len(as_is):-1] for d in (lhs_done, rhs_done))
        return f"{op} on the operands as they are ({'; '.join(whys)})"
    return f"{op} of the lhs {lhs_done} and the rhs {rhs_done}"


def _call_str(lhs, rhs, dimension_numbers) -> str:
    """``lhs float32[4,8,16], rhs float32[8,16], dimension_numbers (((1, 2), (0, 1)), ((), ()))``: the
    layer's shapes, for a warning."""
    def operand(x):
        kind = f"{type(x).__name__} " if isinstance(x, QUANTIZED_TENSORS) else ""
        return f"{kind}{jnp.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"

    return f"lhs {operand(lhs)}, rhs {operand(rhs)}, dimension_numbers {dimension_numbers_tuple(dimension_numbers)}"


def _check_like_lax(lhs, rhs, dimension_numbers, precision, preferred_element_type, reduction_order) -> None:
    """Raise what ``lax.dot_general`` raises for these arguments (dimension numbers out of range or
    malformed, mismatched shapes, a bad precision or dtype): evaluate it abstractly on the operands'
    shapes and (high-precision) dtypes."""
    ops = [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x
           for x in (lhs, rhs)]  # anything else (a scalar, a Python list) goes to lax as it is
    shaped = [i for i, x in enumerate(ops) if isinstance(x, jax.ShapeDtypeStruct)]

    def dot(*avals):
        args = list(ops)
        for i, a in zip(shaped, avals):
            args[i] = a
        return lax.dot_general(*args, dimension_numbers, precision, preferred_element_type=preferred_element_type,
                               **lax_keywords(reduction_order=reduction_order))

    jax.eval_shape(dot, *(ops[i] for i in shaped))


def _as_operand(x):
    if isinstance(x, QUANTIZED_TENSORS):
        return x
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    return x


def _implementation(implementation: Optional[str], recipe) -> Optional[GemmBackend]:
    """The backend ``implementation`` names, checked: it takes the recipe's format and runs here."""
    if implementation is None:
        return None
    names = implementations()
    if not isinstance(implementation, str) or implementation not in names:
        raise ValueError(f"fp8_dot_general: implementation must be None or one of {', '.join(map(repr, names))}, "
                         f"got {implementation!r}")
    backend = names[implementation]
    fmt = recipe.scheme("lhs").format
    if not backend.takes(fmt):
        takers = [n for n, b in names.items() if b.takes(fmt)]
        raise ValueError(f"fp8_dot_general: implementation={implementation!r} does not take the "
                         f"{type(recipe).__name__} recipe's operands ({fmt.name}); for it: {', '.join(map(repr, takers))} "
                         "or None")
    why = backend.unavailable_here()
    if why is not None:
        raise ValueError(f"fp8_dot_general: implementation={implementation!r} cannot run here: {why} "
                         "(implementation=None runs what the plan picks; 'reference' runs everywhere)")
    return backend


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                    recipe: Optional[Float8BlockScaling | MXFP8BlockScaling] = None, out_sharding=None,
                    reduction_order: Any = None, implementation: Optional[str] = None):
    """``lax.dot_general`` on the FP8 GEMM, with ``lax.dot_general``'s signature: a drop-in for
    ``flax.linen.Dense(dot_general=...)``, ``flax.nnx.Linear(dot_general=...)`` and
    ``jnp.einsum(..., _dot_general=...)``.

    High-precision operands (float32, bfloat16, float16) are quantized with ``recipe`` (default
    :class:`Float8BlockScaling`): ``lhs`` (activations) in 1x128 blocks, ``rhs`` (weights) in 128x128
    tiles; a :class:`~jax_fp8.BlockwiseTensor` is used as it is (any layout, converted exactly; it gets
    no gradient). With :class:`MXFP8BlockScaling` every operand is quantized in blocks of 32 along the
    contraction of each GEMM (both usages in one pass) and an :class:`~jax_fp8.MXFP8Tensor` is used as
    it is; its GEMMs run on cuDNN where the GPUs are Blackwell, else as their reference (a bf16 GEMM of
    the dequantized operands, fp32 accumulation) with one ``MXFP8GemmFallbackWarning``. Differentiable
    through a custom VJP whose dgrad and wgrad GEMMs run in FP8 too, on the operands quantized in the
    forward (see the module docstring); gradients come back in the primal dtypes. Works under ``jit``
    (sharded operands split as ``lax.dot_general``'s; README, "Sharded jit"), ``vmap``, ``grad``,
    ``jax.checkpoint`` and ``shard_map``.

    Taken by the GEMM: every call that is a 2-D product ``x (M, K) · W`` by reshapes alone (no transpose,
    no copy; the rules: :func:`~jax_fp8.gemm.plan.fold_dot_general`): ``lhs``'s contracting dims are its
    trailing dims and fold into K, its leading (free) dims into M; ``rhs``'s contracting dims are
    adjacent, paired with ``lhs``'s in the same order, and come before its free dims ((K, N), as flax's
    kernel, or flax's ``DenseGeneral`` q/k/v kernel (d, heads, head_dim) as (d, heads * head_dim)) or
    after them ((N, K), e.g. an out projection kernel (heads, head_dim, d) contracted over (heads,
    head_dim) as (heads * head_dim, d) with the lhs (..., heads, head_dim) as (M, heads * head_dim));
    no batch dims (size 1 only); dims of size 1 do not count. The output is the (M, N) product reshaped
    to ``lax.dot_general``'s shape, and gradients come back in the operands' own shapes (the reshapes'
    transposes). An N-D weight's 128x128 tiles are those of its folded 2-D view: a (d, heads,
    head_dim) kernel is quantized as the (d, heads * head_dim) matrix, its tiles spanning heads when
    head_dim is not a multiple of 128. A pre-quantized operand folds where its own 2-D view
    (prod(shape[:-1]), shape[-1]) is the folded one. An lhs whose free dims are (..., S) with S %
    128 == 0 and K, N multiples of 16 runs as stacked sequences of S rows, each device folding its own:
    the same bits, and a split S stays split under ``jit``. Shapes are padded to the GEMM backend's
    alignment (:func:`~jax_fp8.gemm.plan.plan_gemm`). Anything else (batch dims, non-adjacent or
    differently ordered contracting dims, non-float operands, ...) is computed as ``lax.dot_general`` of
    quantize-dequantized operands (dequantized ones for quantized inputs; non-float operands as they
    are), with one :class:`Fp8GemmFallbackWarning` per call naming the operands' shapes, the dimension
    numbers, why, and what is computed instead: always a correct answer. A single GEMM of the three that
    cannot run in FP8 (on cuBLASLt: shapes too small to pad cheaply, 2D x 2D or E5M2 x E5M2
    pre-quantized pairs; a pre-quantized operand without the usage it needs) is computed by the
    reference math on the same quantized operands; the call's one warning names each of them (dgrad
    and wgrad included, decided by the GEMM plan at the call, :func:`~jax_fp8.gemm.plan.plan_dot_general`).

    The result has ``preferred_element_type`` (default: the operands' promoted dtype); ``precision`` is
    ignored by the FP8 GEMM (it accumulates in fp32) and passed on by the fallback. A ``reduction_order``
    (jax 0.12's) other than "unordered" is the fallback's, which passes it on: the FP8 GEMM sums in an
    order of its own. ``out_sharding`` types the result on an Explicit mesh, as lax's, and where lax
    rejects it (Auto axes) constrains it instead, on the GEMM and the fallback alike. Arguments that
    ``lax.dot_general`` rejects (dimension numbers out of range, negative or malformed, mismatched
    contracted dims, an unknown ``precision``) raise what it raises.

    Non-finite values propagate as in ``lax.dot_general``: an infinity or NaN in an operand (or in the
    output gradient) makes every output (gradient) it reaches non-finite, so NaN checks and loss
    scalers see an overflow. On the GEMM path a NaN stays NaN in FP8, and a block holding an infinity
    gets an infinite scale (the recipe's ``saturate_inf=False``), so its outputs are inf or NaN; an
    infinity in a weight's 128x128 tile reaches all 128 output columns of that tile. On the
    ``lax.dot_general`` fallback an infinity reaches the dot as it is (lax's pattern exactly) and the
    rest of its block is quantized at scale 1 (TransformerEngine's rule), losing its precision.

    ``implementation`` chooses what runs the three GEMMs of the call (forward, dgrad and wgrad alike),
    as tokamax's ``implementation=``: None (default), the plan's choice per GEMM (the kernel the
    measured table names for this GPU, else the first backend that takes it and runs here, else the
    reference with a warning); ``"cublaslt"`` or ``"cutlass"`` (Float8 blockwise on Hopper),
    ``"cudnn"`` (MXFP8 on Blackwell), or ``"reference"``: the reference math
    (:mod:`jax_fp8.gemm.reference`) on the same quantized operands, on every platform and without a
    fallback warning. A named backend that does not take the recipe's format, does not run on this
    machine or cannot take one of the call's GEMMs raises a ``ValueError`` saying why; so does a call
    that is no GEMM (the ``lax.dot_general`` fallback above) with a named backend other than
    ``"reference"``. E.g. ``fp8_dot_general(x, w, dn, recipe=MXFP8BlockScaling(),
    implementation="reference")`` develops for Blackwell anywhere.

    Reverse mode only on the GEMM path (``jax.grad``, ``jax.vjp``, ``jax.jacrev``): forward mode
    (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) raises a ``TypeError`` that says why; the fallback
    (``lax.dot_general`` of straight-through quantize-dequantized operands) supports both.
    """
    recipe = Float8BlockScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"fp8_dot_general: recipe must be a Float8BlockScaling or MXFP8BlockScaling, got {recipe!r}")
    backend = _implementation(implementation, recipe)
    _check_like_lax(lhs, rhs, dimension_numbers, precision, preferred_element_type, reduction_order)
    lhs, rhs = _as_operand(lhs), _as_operand(rhs)
    quantized_lhs = isinstance(lhs, QUANTIZED_TENSORS)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs.dtype, rhs.dtype))
    # the sequences of a lhs whose free dims (those folded into M) are (..., S): stacked where they may split
    fold, _ = fold_dot_general(lhs.shape, rhs.shape, dimension_numbers)
    may_split = (fold is not None and len(fold.lhs_free) >= 2 and not quantized_lhs
                 and _sequences_may_split(lhs, fold.lhs_free))
    plan = plan_dot_general(lhs, rhs, dimension_numbers, out_dtype, recipe, may_split, backend)
    order_why = reduction_order_reason(reduction_order)
    if plan.fallback is None and order_why:
        plan = DotPlan(fallback=order_why)
    if plan.fallback is not None and backend not in (None, REFERENCE):
        raise ValueError(f"fp8_dot_general ({_call_str(lhs, rhs, dimension_numbers)}): implementation="
                         f"{implementation!r} cannot run this call, which is no FP8 GEMM: {plan.fallback}")
    if plan.fallback is None and not plan.empty:
        if plan.reasons() and backend is not REFERENCE:  # the reference, when asked for, unwarned
            _warn(f"fp8_dot_general ({_call_str(lhs, rhs, dimension_numbers)}): computing by the reference math "
                  "(same quantized operands) instead of the FP8 GEMM: " + "; ".join(plan.reasons()))
        if isinstance(recipe, MXFP8BlockScaling) and backend is None:
            warn_emulated("fp8_dot_general")
        fold = plan.fold
        # the GEMM's 2-D operands, by reshapes (quantized tensors: their own 2-D view, which the plan
        # checked is the fold's); sequences (B, S, K) kept apart where the plan stacks them
        x = lhs if quantized_lhs else fold.fold_lhs(lhs, plan.stacked)
        w = rhs if isinstance(rhs, QUANTIZED_TENSORS) else fold.fold_rhs(rhs)
        cfg = Linear(recipe, plan, out_dtype, _explicit_sharding_of(x), _explicit_sharding_of(w))
        # one varying-axes type for both operands, as lax.dot_general casts them: the cast of a
        # replicated operand transposes to the psum its gradient needs under shard_map
        x, w = vma.match(x, w)
        with reverse_mode_only():
            y = fold.unfold_out(_linear(x, w, cfg))
        # typed as lax.dot_general's result (out_sharding, or what an Explicit mesh infers for it): a
        # dim the GEMM had to gather (misaligned shards, padding) is split again
        return retyped(y, out_sharding if out_sharding is not None else _lax_sharding(lhs, rhs, dimension_numbers))
    # the fallback, and empty products (nothing to quantize, no warning)
    (a, a_done), (b, b_done) = (fallback_operand(lhs, recipe.scheme("lhs")),
                                fallback_operand(rhs, recipe.scheme("rhs")))
    if plan.fallback is not None:
        _warn(f"fp8_dot_general ({_call_str(lhs, rhs, dimension_numbers)}): not on the FP8 GEMM: {plan.fallback}; "
              f"computing {what_is_computed(a_done, b_done)} instead")
    return lax_call(lax.dot_general, a, b, dimension_numbers, precision, preferred_element_type=out_dtype,
                    out_sharding=out_sharding, reduction_order=reduction_order)


def _warn(msg: str) -> None:
    warn(msg, Fp8GemmFallbackWarning)
