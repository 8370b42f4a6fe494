"""Times the fused producers (``jf_produce_quantize``: RMSNorm, LayerNorm, SwiGLU, GELU, their gradients and
the master weights' cast, each fused with its GEMM-ready Float8 quantization) against what an ``fp8`` step
runs for the same tensors: XLA's producer (flax's RMSNorm / LayerNorm, ``silu(gate) * up``, the tanh GELU,
their autodiff, the bf16 convert), then our quantize kernel; and the norms' backward (``jf_norm_grad``:
dx, dgamma, dbeta) against XLA's autodiff of flax's norm. GB/s counts the bytes a fused kernel must move (each input
read once, the FP8 outputs and scales written once), against a device-to-device copy. Checks the
fused kernel against the NumPy contract bit for bit on a slice of rows.

  python bench/bench_producers.py [--tokens 8192] [--widths 4096x14336,2048x8192,1024x4096] [--iters 50]
      [--ops backward,swiglu]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8 as jf
from _timing import jax_time
from bench_kernels import device_copy, leaves_equal, register_device_copy
from jax_fp8 import producers
from jax_fp8.quantization import norm_grad, produce, produce_quantize, quantize

RECIPE = jf.Float8BlockScaling()
LHS, RHS, GRAD = RECIPE.scheme("lhs"), RECIPE.scheme("rhs"), RECIPE.scheme("grad")
BF16 = jnp.bfloat16


def flax_rms_norm(x, gamma, eps=1e-6):
    """flax's nn.RMSNorm (fp32 statistics, rsqrt), rounded to x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * gamma).astype(x.dtype)


def flax_layer_norm(x, gamma, beta, eps=1e-6):
    """flax's nn.LayerNorm (fp32 statistics), rounded to x's dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    return (y * gamma + beta).astype(x.dtype)


def flax_gelu(x):
    return jax.nn.gelu(x, approximate=True)


def flax_swiglu(h):
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def leaves(q):
    return jax.tree_util.tree_leaves(q)


def cases(M: int, d: int, F: int):
    """(name, fused fn, unfused fn, input maker, bytes the fused kernel moves, contract)."""
    key = jax.random.key(M + d + F)
    k = jax.random.split(key, 4)
    fp8 = lambda n: 2 * n + 2 * 4 * (n // 128)  # noqa: E731  (row + colT FP8 data and fp32 scales)
    return [
        ("rmsnorm+quantize", (M, d),
         lambda x, g: leaves(produce_quantize("rmsnorm", x, g, scheme=LHS, eps=1e-6)),
         lambda x, g: leaves(quantize(flax_rms_norm(x, g), LHS)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[0], i), (M, d), BF16), jnp.ones((d,), jnp.float32)),
         M * d * 2 + 4 * d + fp8(M * d), "rmsnorm"),
        ("swiglu+quantize", (M, 2 * F),
         lambda h: leaves(produce_quantize("swiglu", h, scheme=LHS)),
         lambda h: leaves(quantize(flax_swiglu(h), LHS)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[1], i), (M, 2 * F), BF16),),
         M * 2 * F * 2 + fp8(M * F), "swiglu"),
        ("dswiglu+quantize", (M, 2 * F),
         lambda da, h: leaves(produce_quantize("swiglu_grad", da, h, scheme=GRAD)),
         lambda da, h: leaves(quantize(jax.vjp(flax_swiglu, h)[1](da)[0], GRAD)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[2], i), (M, F), BF16),
                    jax.random.normal(jax.random.fold_in(k[3], i), (M, 2 * F), BF16)),
         M * F * 2 + M * 2 * F * 2 + fp8(M * 2 * F), "swiglu_grad"),
        ("cast+quantize 128x128", (d, 2 * F),
         lambda w: leaves(produce_quantize("cast", w, scheme=RHS, out_dtype=BF16)),
         lambda w: leaves(quantize(w.astype(BF16), RHS)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[0], 100 + i), (d, 2 * F), jnp.float32) / 64,),
         d * 2 * F * 4 + 2 * d * 2 * F + 2 * 4 * (d * 2 * F // 16384), "cast"),
        ("layernorm+quantize", (M, d),
         lambda x, g, b: leaves(produce_quantize("layernorm", x, g, b, scheme=LHS, eps=1e-6)),
         lambda x, g, b: leaves(quantize(flax_layer_norm(x, g, b), LHS)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[0], 200 + i), (M, d), BF16) + 1,
                    jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32)),
         M * d * 2 + 8 * d + fp8(M * d), "layernorm"),
        ("gelu+quantize", (M, F),
         lambda x: leaves(produce_quantize("gelu", x, scheme=LHS)),
         lambda x: leaves(quantize(flax_gelu(x), LHS)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[1], 300 + i), (M, F), BF16),),
         M * F * 2 + fp8(M * F), "gelu"),
        ("rmsnorm backward", (M, d),
         lambda x, g, s, dy: list(norm_grad("rmsnorm", x, g, s, dy)),
         lambda x, g, s, dy: list(jax.vjp(flax_rms_norm, x, g)[1](dy)),
         lambda i: norm_inputs("rmsnorm", jax.random.fold_in(k[0], 500 + i), M, d),
         3 * M * d * 2 + 4 * M + 8 * d, "rmsnorm_grad"),
        ("layernorm backward", (M, d),
         lambda x, g, s, dy: list(norm_grad("layernorm", x, g, s, dy)),
         lambda x, g, s, dy: list(jax.vjp(lambda x, g: flax_layer_norm(x, g, jnp.zeros_like(g)), x, g)[1](dy)),
         lambda i: norm_inputs("layernorm", jax.random.fold_in(k[1], 600 + i), M, d),
         3 * M * d * 2 + 8 * M + 12 * d, "layernorm_grad"),
        ("dgelu+quantize", (M, F),
         lambda da, x: leaves(produce_quantize("gelu_grad", da, x, scheme=GRAD)),
         lambda da, x: leaves(quantize(jax.vjp(flax_gelu, x)[1](da)[0], GRAD)),
         lambda i: (jax.random.normal(jax.random.fold_in(k[2], 400 + i), (M, F), BF16),
                    jax.random.normal(jax.random.fold_in(k[3], 400 + i), (M, F), BF16)),
         2 * M * F * 2 + fp8(M * F), "gelu_grad"),
    ]


def norm_inputs(norm, key, M, d):
    """x, gamma, the forward's statistics (our kernel's), dy: a norm's backward's inputs."""
    k = jax.random.split(key, 2)
    x, g = jax.random.normal(k[0], (M, d), BF16) + 1, jnp.ones((d,), jnp.float32)
    params = (g,) if norm == "rmsnorm" else (g, jnp.zeros((d,), jnp.float32))
    stats = jax.jit(lambda x: produce(norm, x, *params, eps=1e-6)[1][0])(x)
    return x, g, stats, jax.random.normal(k[1], (M, d), BF16)


def exact_on_rows(name, producer, fused, args, rows: int = 256) -> bool:
    """The fused kernel's outputs on the first ``rows`` rows against the NumPy contract."""
    norm_grad_of = producer[:-5] if producer.endswith("_grad") and producer[:-5] in producers.NORMS else None
    # the (K,) parameters are not rows: a norm's gamma and beta, its backward's gamma
    params = {1, 2} if producer in producers.NORMS else {1} if norm_grad_of else set()
    cut = [a if i in params else a[:rows] for i, a in enumerate(args)]
    if norm_grad_of:  # dx, then the column sums
        want = producers.norm_grad(norm_grad_of, *[np.asarray(a) if i in params else np.asarray(a)[None]
                                                   for i, a in enumerate(cut)])
        got = jax.jit(lambda *a: norm_grad(norm_grad_of, *a))(*cut)
        return leaves_equal([np.ascontiguousarray(np.asarray(g)).reshape(np.shape(w)) for g, w in zip(got, want)],
                            [np.ascontiguousarray(w) for w in want])
    scheme = RHS if producer == "cast" else GRAD if producer in ("swiglu_grad", "gelu_grad") else LHS
    want = producers.produce_quantize(*[np.asarray(a) if i in params else np.asarray(a)[None] for i, a in enumerate(cut)],
                                      producer=producer, scheme=scheme, eps=1e-6,
                                      out_dtype=BF16 if producer == "cast" else None)
    got = jax.jit(lambda *a: jf.primitives.produce_quantize_p.bind(
        *[x[None] if x.ndim == 2 else x for x in a], producer=producer, scheme=scheme, eps=1e-6,
        out_dtype=jnp.dtype(BF16)))(*cut)
    return leaves_equal([np.ascontiguousarray(g) for g in got], [np.ascontiguousarray(w) for w in want])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the activations (batch x seq)")
    ap.add_argument("--widths", default="4096x14336,2048x8192,1024x4096", help="d_model x ffn pairs")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ops", default="", help="only the ops whose name contains one of these (comma-separated)")
    args = ap.parse_args(argv)
    only = [o for o in args.ops.split(",") if o]
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} jax={jax.__version__} "
          f"kernels={jf.kernels_available()}")
    have_copy = jax.default_backend() == "gpu" and register_device_copy()
    rows = []
    for width in args.widths.split(","):
        d, F = map(int, width.split("x"))
        for name, shape, fused, unfused, make, nbytes, producer in cases(args.tokens, d, F):
            if only and not any(o in name for o in only):
                continue
            sets = [make(i) for i in range(3)]
            t_f = jax_time(fused, sets, args.iters)
            t_u = jax_time(unfused, sets, args.iters)
            copy_in = [jnp.zeros((nbytes // 4,), jnp.float32) + i for i in range(3)]  # the same bytes, read + written
            t_c = jax_time(device_copy if have_copy else (lambda x: x * 2), [(c,) for c in copy_in], args.iters)
            copy_gbs = 2 * copy_in[0].size * 4 / t_c / 1e9
            gbs = nbytes / t_f / 1e9
            exact = exact_on_rows(name, producer, fused, sets[0])
            rows.append((width, name, "x".join(map(str, shape)), t_f, t_u, gbs, 100 * gbs / copy_gbs, exact))
            print(f"{rows[-1][0]:>12} {name:>22} fused {t_f * 1e6:8.1f} us, unfused {t_u * 1e6:8.1f} us", flush=True)
    print(f"\n{'d x ffn':>12} {'op':>22} {'shape':>12} {'fused us':>9} {'unfused us':>10} {'saved':>6} {'GB/s':>6} "
          f"{'% copy':>6} {'bit-exact':>9}")
    for w, name, shape, t_f, t_u, gbs, pct, exact in rows:
        print(f"{w:>12} {name:>22} {shape:>12} {t_f * 1e6:9.1f} {t_u * 1e6:10.1f} {1 - t_f / t_u:6.1%} {gbs:6.0f} "
              f"{pct:6.1f} {str(exact):>9}")
    return rows


if __name__ == "__main__":
    main()
