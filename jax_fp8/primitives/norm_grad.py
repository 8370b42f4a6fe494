"""``jf_norm_grad``: the backward of RMSNorm or LayerNorm (:func:`jax_fp8.producers.norm_grad`) in one call:
dx, and the column sums dgamma (LayerNorm: and dbeta) in a fixed order (blocks of
:data:`~jax_fp8.producers.GRAD_ROWS` rows, then the blocks), so the same bits on every platform and in
every run: XLA's own reductions change with the fusion candidates its GPU autotuner picks per compile.

Inputs: x (B, M, K), gamma (K,), the forward's statistics (RMSNorm: rstd (B, M); LayerNorm: (mean, rstd)
(B, M, 2)) and dy (B, M, K). Results: dx (B, M, K) in x's dtype and the column sums (n, K) float32 (n = 1:
dgamma; LayerNorm n = 2: dgamma, dbeta).

Under ``jax.jit`` on a mesh the batch and the rows split: each device sums its own rows' columns, then a
``psum`` adds the devices' sums (a split sum's order, as XLA's). A split last dim is gathered, with a
warning: the norm reduces along it. Under ``vmap`` each mapped entry gets its own sums (``lax.map``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._compat import ShapedArray, ffi
from .. import producers
from ..vma import out_aval
from .partitioning import Dim, Rule
from .registration import define_primitive


def _sums(norm: str) -> int:
    return 2 if norm == "layernorm" else 1


def _check(shapes, norm: str) -> tuple:
    """(B, M, K) of a call, its shapes checked."""
    if norm not in producers.NORMS:
        raise ValueError(f"jf_norm_grad: norm must be one of {producers.NORMS}, got {norm!r}")
    x, gamma, stats, dy = (tuple(s) for s in shapes)
    if len(x) != 3:
        raise ValueError(f"jf_norm_grad: x must be (batch, rows, cols), got shape {x}")
    B, M, K = x
    want = producers.stats_shape(norm, (B, M))
    if dy != x or gamma != (K,) or stats != want:
        raise ValueError(f"jf_norm_grad: {norm} takes x and dy of one shape (B, M, K), gamma (K,) and statistics "
                         f"{want}; got x {x}, gamma {gamma}, statistics {stats}, dy {dy}")
    return B, M, K


def _abstract(x, gamma, stats, dy, *, norm):
    _, _, K = _check([a.shape for a in (x, gamma, stats, dy)], norm)
    return [out_aval(x.shape, x.dtype, x, gamma, stats, dy),
            out_aval((_sums(norm), K), np.float32, x, gamma, stats, dy)]


def _reference(x, gamma, stats, dy, *, norm):
    dx, *sums = producers.norm_grad(norm, x, gamma, stats, dy)
    return [dx, jnp.stack(sums)]


def _lowering(work):
    """The lowering into jf_norm_grad, with a float32 workspace result of ``work(B, M, K, n)`` floats."""
    def lower(ctx, x, gamma, stats, dy, *, norm):
        B, M, K = ctx.avals_in[0].shape
        n = _sums(norm)
        avals = list(ctx.avals_out) + [ShapedArray((work(B, M, K, n),), np.float32)]
        outs = ffi.ffi_lowering("jf_norm_grad")(ctx.replace(avals_out=avals), x, gamma, stats, dy,
                                                producer=np.int32(producers.PRODUCERS.index(norm)))
        return list(outs)[:2]
    return lower


def _cuda_work(B: int, M: int, K: int, n: int) -> int:
    """The CUDA kernels' workspace in floats: every block's n column sums (produce_args.h's
    NormGradArgs::work_needed)."""
    return B * -(-M // producers.GRAD_ROWS) * n * K


def _batch(args, dims, *, norm):
    """vmap: one call per mapped entry (``lax.map``): each entry's column sums are its own."""
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(entries):
        full = list(args)
        for i, e in zip(mapped, entries):
            full[i] = e
        return tuple(norm_grad_p.bind(*full, norm=norm))

    outs = lax.map(one, tuple(jnp.moveaxis(args[i], dims[i], 0) for i in mapped))
    return list(outs), [0, 0]


# ---- partitioning: the batch and the rows split (the column sums then psum), the last dim never ------
_NAMES = dict(b="the batch dim", m="the rows (leading dims)", k="the last dim")


def _sizes(shapes, params):
    B, M, K = _check(shapes, params["norm"])
    return dict(b=B, m=M, k=K)


def _arrays(sizes, params):
    b, m, k = Dim("b", sizes["b"]), Dim("m", sizes["m"]), Dim("k", sizes["k"])
    stats = (b, m) if params["norm"] == "rmsnorm" else (b, m, Dim(None, 2))
    return [(b, m, k), (k,), stats, (b, m, k)], [(b, m, k), (Dim(None, _sums(params["norm"])), k)]


def _why_not(label, local, sizes, params):
    return "the norm reduces along it" if label == "k" else None


def _on_shard(bind, reduce_axes, params):
    """One device's call: its rows' dx and column sums, the sums added over the split axes."""
    def run(x, gamma, stats, dy):
        dx, sums = bind(x, gamma, stats, dy, **params)
        return dx, lax.psum(sums, reduce_axes) if reduce_axes else sums
    return run


norm_grad_p = define_primitive(
    "jf_norm_grad", abstract=_abstract, reference=_reference,
    ffi_rules=dict(cpu=_lowering(lambda B, M, K, n: 0), cuda=_lowering(_cuda_work)), batch=_batch,
    rule=Rule(tuple(_NAMES), _NAMES, _sizes, _arrays, why_not=_why_not, contracted=("b", "m"), local=_on_shard),
    multiple_results=True,
    no_jvp_hint="It is the backward of jax_fp8.rms_norm / jax_fp8.layer_norm, whose VJPs use it.")
