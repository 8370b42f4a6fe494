"""The mixture-of-experts kernels for Nsight Compute: one grouped quantize (``jf_quantize_grouped``, both
usages) or one grouped GEMM call (the forward, M-grouped, or the weight gradient, K-grouped: its setup,
scale-fill and GEMM kernels) at bench_ragged.py's shapes, compiled and warmed up, then run --runs times
between cuProfilerStart and cuProfilerStop (ncu's ``--profile-from-start off`` sees only those launches,
so every kernel of the call is profiled and nothing of the set-up).

  ncu --profile-from-start off --section SpeedOfLight ... python3 bench/ncu_ragged.py --what forward \\
      [--experts 8] [--rows 16384] [--k 7168] [--n 2048]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench_ragged import LHS, grouped_gemms, routing_sizes
from jax_fp8.quantization import quantize_grouped
from ncu_gemm import profiler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", choices=("quantize", "forward", "wgrad"), default="forward")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--skewed", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    sizes = routing_sizes(args.rows, args.experts, args.skewed, np.random.default_rng(2))
    M = int(sizes.sum())
    print(f"ncu_ragged: {args.what} {M}x{args.k}x{args.n}, {args.experts} experts (largest group {sizes.max()}) "
          f"on {jax.devices()[0].device_kind}", flush=True)
    if args.what == "quantize":
        s = jnp.asarray(sizes)
        call = jax.jit(lambda x: quantize_grouped(x, s, LHS))
        operands = (jnp.asarray(np.random.default_rng(0).standard_normal((M, args.k)), jnp.bfloat16),)
    else:
        _, _, calls = grouped_gemms(M, args.k, args.n, sizes)
        _, f, operands = calls["ragged_m" if args.what == "forward" else "ragged_k"]
        call = jax.jit(f)
    out = None
    for _ in range(args.warmup):
        out = call(*operands)
    jax.block_until_ready(out)
    print(f"ncu_ragged: profiler start: {profiler(True)}", flush=True)
    for _ in range(args.runs):
        out = call(*operands)
    jax.block_until_ready(out)
    print(f"ncu_ragged: profiler stop: {profiler(False)}", flush=True)


if __name__ == "__main__":
    main()
