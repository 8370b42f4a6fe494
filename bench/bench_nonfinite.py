"""What carrying non-finite values through ``fp8_dot_general`` costs: one linear layer's forward +
backward (jitted, bf16 activations) as the library runs it (the recipe's ``saturate_inf=False``: a
block holding an inf gets an infinite scale), next to the same layer quantizing by TE's rule (an inf
saturates: the GEMM path before non-finite operands were kept), and bf16 ``lax.dot_general``, side by side in one run.

  python bench/bench_nonfinite.py [--shapes 8192x4096x4096,8192x4096x14336,8192x14336x4096] [--iters 50]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import jax_fp8 as jf
from jax_fp8 import gemm as G

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import jax_time  # noqa: E402

KN = (((1,), (0,)), ((), ()))


def layer(dot):
    def f(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: dot(a, b, KN, preferred_element_type=jnp.bfloat16), x, w)
        return (y, *vjp(dy))
    return jax.jit(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x4096x4096,8192x4096x14336,8192x14336x4096", help="MxKxN,...")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; kernels {jf.kernels_available()}")
    recipe_scheme = G.Float8BlockScaling.scheme
    for shape in args.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        sets = []
        for seed in range(2):  # two argument sets: L2 holds neither
            kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
            sets.append((jax.random.normal(kx, (M, K), jnp.bfloat16),
                         (jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16),
                         jax.random.normal(kd, (M, N), jnp.bfloat16)))
        times = {}
        times["fp8 (propagates non-finite)"] = jax_time(layer(jf.fp8_dot_general), sets, args.iters)
        # the same layer quantizing by TE's rule, for this timing only
        G.Float8BlockScaling.scheme = lambda self, *a, **k: dataclasses.replace(recipe_scheme(self, *a, **k),
                                                                                saturate_inf=True)
        try:
            times["fp8 (saturating, no propagation)"] = jax_time(layer(jf.fp8_dot_general), sets, args.iters)
        finally:
            G.Float8BlockScaling.scheme = recipe_scheme
        times["bf16 lax.dot_general"] = jax_time(layer(lax.dot_general), sets, args.iters)
        base = times["fp8 (saturating, no propagation)"]
        print(f"{M}x{K}x{N} (M x K x N), forward + backward:")
        for name, t in times.items():
            print(f"  {name:34s} {1e3 * t:8.3f} ms   {t / base:5.3f}x of the saturating layer")


if __name__ == "__main__":
    main()
