"""``jf_produce_quantize``: a producer (RMSNorm, SwiGLU, GELU, their gradients, a cast; :mod:`jax_fp8.producers`)
and the quantization of what it produces, in one kernel: the produced (B, M, K) tensor is never stored in
high precision. Its outputs are ``jf_quantize``'s for that tensor (same scheme, same layouts), then the
producer's extra outputs (a norm's statistics of every row, float32, for the backward: RMSNorm's rstd (B, M),
LayerNorm's (mean, rstd) (B, M, 2)). And
``jf_produce``: the producer alone, its tensor in its dtype (the unfused ops of :mod:`jax_fp8.fused`).

The fused CUDA kernels take what the fused layers ask (:func:`fused_kernel_takes`); any other call
runs on the GPU as ``jf_produce`` then ``jf_quantize``, the same bits in two passes.

Inputs (B, rows, cols): ``cast`` x (B, M, K); ``rmsnorm`` x (B, M, K) and gamma (K,); ``layernorm`` x (B,
M, K), gamma (K,) and beta (K,); ``swiglu`` h (B, M,
2K) = [gate | up]; ``swiglu_grad`` da (B, M, F) and h (B, M, 2F), producing (B, M, 2F) = [d_gate | d_up];
``gelu`` x (B, M, K); ``gelu_grad`` da and x (B, M, K).

Under ``jax.jit`` on a mesh it splits over the batch and the rows as ``jf_quantize`` does; the last dim
splits for the elementwise producers (``cast``, ``gelu``, ``gelu_grad``) only (RMSNorm reduces along it,
SwiGLU pairs its two halves): elsewhere a split last dim is gathered, with a warning saying why.
"""
from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np

from .._compat import ShapedArray, ffi
from .. import producers
from ..formats import BLOCKWISE, FLOAT8_BLOCK
from ..scheme import GEMM_SCALE_PAD
from ..vma import out_aval
from .partitioning import Dim, Rule
from .quantize import _quantize_ffi_lowering, scale_dims
from .registration import define_primitive

_QUANTIZE_RESULTS = 4  # the FFI target's (data, scale) x 2 slots; unused ones are empty
_DTYPE_CODE = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}


def produced_shape(producer: str, shapes) -> tuple:
    """The (B, M, K) shape a producer makes from its inputs' shapes (checked)."""
    x = shapes[0]
    if len(x) != 3:
        raise ValueError(f"jf_produce_quantize: {producer} takes (batch, rows, cols) inputs, got shape {x}")
    B, M, K = x
    for name, shape in zip(("gamma", "beta"), shapes[1:] if producer in producers.NORMS else ()):
        if tuple(shape) != (K,):
            raise ValueError(f"jf_produce_quantize: {producer}'s {name} must have shape ({K},) for x {x}, got {shape}")
    if producer == "swiglu":
        if K % 2:
            raise ValueError(f"jf_produce_quantize: swiglu takes h (B, M, 2F) = [gate | up], got shape {x}")
        return B, M, K // 2
    if producer == "swiglu_grad":
        if tuple(shapes[1]) != (B, M, 2 * K):
            raise ValueError(f"jf_produce_quantize: swiglu_grad takes da (B, M, F) and h (B, M, 2F), got {x} and "
                             f"{shapes[1]}")
        return B, M, 2 * K
    if producer == "gelu_grad" and tuple(shapes[1]) != (B, M, K):
        raise ValueError(f"jf_produce_quantize: gelu_grad takes da and x of one shape (B, M, K), got {x} and "
                         f"{shapes[1]}")
    return B, M, K


def _abstract(*args, producer, scheme, eps, out_dtype):
    if len(args) != producers.N_INPUTS[producer]:
        raise ValueError(f"jf_produce_quantize: {producer} takes {producers.N_INPUTS[producer]} inputs, got {len(args)}")
    B, M, K = produced_shape(producer, [a.shape for a in args])
    outs = []
    for data, scale in scheme.kernel_outputs((M, K)):
        outs += [out_aval((B, *data), np.uint8, *args), out_aval((B, *scale), scheme.scale_dtype, *args)]
    return outs + [out_aval(a.shape, a.dtype, *args) for a in _extra_avals(producer, B, M)]


def _reference(*args, producer, scheme, eps, out_dtype):
    return producers.produce_quantize(*args, producer=producer, scheme=scheme, eps=eps, out_dtype=out_dtype)


def _ffi_lowering(ctx, *args, producer, scheme, eps, out_dtype):
    n_quantize = 2 * len(scheme.kernel_usages)
    avals = list(ctx.avals_out)
    extra = avals[n_quantize:] or [ShapedArray((0,), np.float32)]
    padded = avals[:n_quantize] + [ShapedArray((0,), np.uint8)] * (_QUANTIZE_RESULTS - n_quantize) + extra
    outs = ffi.ffi_lowering("jf_produce_quantize")(
        ctx.replace(avals_out=padded), *args, scheme=scheme.ffi_attrs(),
        producer=np.int32(producers.PRODUCERS.index(producer)), dtype=np.int32(_DTYPE_CODE[jnp.dtype(out_dtype)]),
        eps=np.float32(eps))
    outs = list(outs)
    return outs[:n_quantize] + (outs[_QUANTIZE_RESULTS:] if producer in producers.NORMS else [])


def _batch(prim, args, dims, *, producer, **params):
    """vmap: the mapped dim folds into the batch of every (B, rows, cols) input; a norm's gamma and beta are
    shared."""
    if producer in producers.NORMS and any(d is not None for d in dims[1:]):
        raise NotImplementedError(f"jf_produce_quantize: {producer} under vmap takes one gamma (and beta) for "
                                  "every mapped x (vmap with in_axes=None for gamma and beta)")
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if producer in producers.NORMS and i >= 1:
            folded.append(a)
            continue
        a = jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        folded.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    outs = prim().bind(*folded, producer=producer, **params)
    return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs], [0] * len(outs)


def fused_kernel_takes(params: dict, in_dtypes) -> bool:
    """Whether the fused CUDA kernels take this call: they are built for what the fused layers ask (the
    recipes' schemes), float32 master weights to cast and bfloat16 inputs to the other producers (a norm's
    gamma and beta: any dtype), bfloat16 values quantized GEMM-ready in Float8 blockwise blocks with both usages
    and infinite amaxes kept infinite (``saturate_inf=False``), 128x128 tiles for a cast (a master weight)
    and 1x128 blocks for the other producers (produce_tile.cuh, with_produce)."""
    scheme, producer, out = params["scheme"], params["producer"], jnp.dtype(params["out_dtype"])
    cast = producer == "cast"
    main = [jnp.dtype(d) for d in in_dtypes][:1 if producer in producers.NORMS else None]  # not gamma, beta
    inputs = all(d == jnp.dtype(jnp.float32 if cast else jnp.bfloat16) for d in main)
    tiles = tuple(scheme.block) == (FLOAT8_BLOCK, FLOAT8_BLOCK)
    return (inputs and out == jnp.dtype(jnp.bfloat16) and scheme.format is BLOCKWISE and not scheme.saturate_inf
            and scheme.gemm_ready and scheme.rowwise and scheme.colwise and tiles == cast)


def _extra_avals(producer, B, M):
    """The producer's extra outputs: RMSNorm's rstd of every row."""
    shape = producers.stats_shape(producer, (B, M))
    return [] if shape is None else [ShapedArray(shape, np.float32)]


def _produce_ffi(ctx, args, producer, eps, y_aval):
    """The jf_produce custom call into ``y_aval``: [y, *extras]."""
    B, M = y_aval.shape[:2]
    extra = _extra_avals(producer, B, M)
    outs = ffi.ffi_lowering("jf_produce")(
        ctx.replace(avals_out=[y_aval] + (extra or [ShapedArray((0,), np.float32)])), *args,
        producer=np.int32(producers.PRODUCERS.index(producer)), eps=np.float32(eps))
    return list(outs)[:1 + len(extra)]


def _cuda_lowering(ctx, *args, producer, scheme, eps, out_dtype):
    """The fused kernel where it takes the call, else jf_produce then jf_quantize (same bits)."""
    params = dict(producer=producer, scheme=scheme, eps=eps, out_dtype=out_dtype)
    if fused_kernel_takes(params, [a.dtype for a in ctx.avals_in]):
        return _ffi_lowering(ctx, *args, **params)
    n = 2 * len(scheme.kernel_usages)
    y_aval = ShapedArray(produced_shape(producer, [a.shape for a in ctx.avals_in]), jnp.dtype(out_dtype))
    y, *extra = _produce_ffi(ctx, args, producer, eps, y_aval)
    quantized = _quantize_ffi_lowering(ctx.replace(avals_in=[y_aval], avals_out=ctx.avals_out[:n]), y, scheme=scheme)
    return list(quantized) + extra


# ---- partitioning: the batch and the rows split, the last dim only for a cast ------------------------
_NAMES = dict(b="the batch dim", m="the rows (leading dims)", k="the last dim",
              h="the last dim of SwiGLU's input", f="the last dim of SwiGLU's output gradient",
              s="LayerNorm's statistics (mean, rstd)")


#: The producers that work element by element: their last dim splits like the others.
ELEMENTWISE = ("cast", "gelu", "gelu_grad")


def _sizes(shapes, params):
    B, M, K = produced_shape(params["producer"], shapes)
    return dict(b=B, m=M, k=K, h=2 * K, f=K // 2, s=2)


def _arrays(sizes, params):
    producer, scheme = params["producer"], params["scheme"]
    b, m, k = Dim("b", sizes["b"]), Dim("m", sizes["m"]), Dim("k", sizes["k"])
    inputs = {"cast": [(b, m, k)], "rmsnorm": [(b, m, k), (k,)], "layernorm": [(b, m, k), (k,), (k,)],
              "swiglu": [(b, m, Dim("h", sizes["h"]))],
              "swiglu_grad": [(b, m, Dim("f", sizes["f"])), (b, m, k)], "gelu": [(b, m, k)],
              "gelu_grad": [(b, m, k), (b, m, k)]}[producer]
    outs = [] if scheme is not None else [(b, m, k)]  # jf_produce: the tensor itself
    for usage in (scheme.output_usages if scheme is not None else ()):
        outs += [(b, k, m) if scheme.transposed_data(usage) else (b, m, k),
                 (b, *scale_dims(scheme, m.size, k.size, usage))]
    if producer == "rmsnorm":
        outs.append((b, m))
    elif producer == "layernorm":
        outs.append((b, m, Dim("s", sizes["s"])))
    return inputs, outs


def _why_not(label, local, sizes, params):
    producer = params["producer"]
    if label in ("k", "h", "f") and producer not in ELEMENTWISE:
        return {"rmsnorm": "RMSNorm reduces along it", "layernorm": "LayerNorm reduces along it",
                "swiglu": "SwiGLU multiplies its two halves",
                "swiglu_grad": "SwiGLU's gradient pairs the two halves of its input"}[producer]
    return None


produce_quantize_p = define_primitive(
    "jf_produce_quantize", abstract=_abstract, reference=_reference,
    ffi_rules=dict(cpu=_ffi_lowering, cuda=_cuda_lowering), batch=partial(_batch, lambda: produce_quantize_p),
    rule=Rule(tuple(_NAMES), _NAMES, _sizes, _arrays, why_not=_why_not, pad_value=GEMM_SCALE_PAD),
    multiple_results=True,
    no_jvp_hint="Differentiate the fused ops of jax_fp8.fused (norm_dense, norm_mlp), whose VJPs are defined.")


# ---- jf_produce: the producer alone ------------------------------------------------------------------
def _produce_abstract(*args, producer, eps, out_dtype):
    if len(args) != producers.N_INPUTS[producer]:
        raise ValueError(f"jf_produce: {producer} takes {producers.N_INPUTS[producer]} inputs, got {len(args)}")
    B, M, K = produced_shape(producer, [a.shape for a in args])
    return [out_aval((B, M, K), out_dtype, *args)] + [out_aval(a.shape, a.dtype, *args)
                                                      for a in _extra_avals(producer, B, M)]


def _produce_reference(*args, producer, eps, out_dtype):
    return producers.produce_values(*args, producer=producer, eps=eps, out_dtype=out_dtype)


def _produce_lowering(ctx, *args, producer, eps, out_dtype):
    return _produce_ffi(ctx, args, producer, eps, ctx.avals_out[0])


def _produce_arrays(sizes, params):
    return _arrays(sizes, dict(params, scheme=None))


produce_p = define_primitive(
    "jf_produce", abstract=_produce_abstract, reference=_produce_reference,
    ffi_rules=dict(cpu=_produce_lowering, cuda=_produce_lowering), batch=partial(_batch, lambda: produce_p),
    rule=Rule(tuple(_NAMES), _NAMES, _sizes, _produce_arrays, why_not=_why_not), multiple_results=True,
    no_jvp_hint="Use jax_fp8.rms_norm / jax_fp8.swiglu / jax_fp8.gelu, whose VJPs are defined.")
