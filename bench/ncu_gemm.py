"""One FP8 blockwise GEMM for Nsight Compute: builds the operands, compiles and warms up a jitted
``jax_fp8.gemm.fp8_gemm`` on one backend, then runs it --runs times between cuProfilerStart and
cuProfilerStop (ncu's ``--profile-from-start off`` then sees only those launches; add
``--kernel-name regex:...`` to drop anything else in the range).

  ncu --profile-from-start off --launch-count 1 --section SpeedOfLight ... \\
      python3 bench/ncu_gemm.py --backend cublaslt [--options algo=3] [--mnk 8192,8192,8192] [--pair 1D2D]
  --backend cutlass --table gemm_table.json: the options bench_gemm_tune.py found fastest for CUTLASS
"""
from __future__ import annotations

import argparse
import ctypes
import json

import jax
import jax.numpy as jnp

import jax_fp8 as jf
from jax_fp8 import gemm as G
from jax_fp8.gemm import table as gemm_table
from jax_fp8.gemm.backends.cublaslt import CUBLASLT

PAIRS = {"1D2D": ((1, 128), (128, 128)), "1D1D": ((1, 128), (1, 128))}


def backend_named(name: str):
    if name == CUBLASLT.name:
        return CUBLASLT
    from jax_fp8.gemm.backends.cutlass import CUTLASS  # noqa: PLC0415 - only when asked for

    if name == CUTLASS.name:
        return CUTLASS
    raise SystemExit(f"ncu_gemm: unknown backend {name!r} (cublaslt, cutlass)")


def profiler(start: bool) -> str:
    """cuProfilerStart / Stop on the device's primary context (the one XLA uses): 'ok' or why not."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        steps = (("cuInit", lambda: cu.cuInit(0)), ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), 0)),
                 ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
                 ("cuCtxPushCurrent", lambda: cu.cuCtxPushCurrent_v2(ctx)),
                 ("cuProfilerStart" if start else "cuProfilerStop",
                  lambda: cu.cuProfilerStart() if start else cu.cuProfilerStop()),
                 ("cuCtxPopCurrent", lambda: cu.cuCtxPopCurrent_v2(ctypes.byref(popped))),
                 ("cuDevicePrimaryCtxRelease", lambda: cu.cuDevicePrimaryCtxRelease_v2(dev)))
        for name, call in steps:
            rc = call()
            if rc != 0:
                return f"{name} returned CUresult {rc}"
        return "ok"
    except (OSError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cublaslt", help="cublaslt or cutlass")
    ap.add_argument("--options", default="", help="e.g. algo=3 or config=1,raster=1,swizzle=4 (default: --table's "
                                                  "best for the backend, else the backend's own choice)")
    ap.add_argument("--table", default=None, help="bench_gemm_tune.py's JSON (best_per_backend)")
    ap.add_argument("--mnk", default="8192,8192,8192", help="the GEMM's M,N,K: a (M, K) . b (N, K)ᵀ")
    ap.add_argument("--pair", default="1D2D", choices=tuple(PAIRS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    M, N, K = map(int, args.mnk.split(","))
    a_block, b_block = PAIRS[args.pair]
    backend = backend_named(args.backend)
    options = dict((k, int(v)) for k, v in (kv.split("=") for kv in args.options.split(",") if kv))
    if not args.options and args.table:
        with open(args.table) as f:
            rows = [r for r in json.load(f).get("best_per_backend", {}).get(args.pair, []) if r[1] == backend.name]
        if rows:
            options = gemm_table.nearest(rows, M, N, K)[2]
    backend = backend.with_options(**options)
    why = backend.unavailable("cuda")
    print(f"ncu_gemm: {backend!r} {args.pair} M={M} N={N} K={K} on {jax.devices()[0].device_kind}"
          + (f" -- cannot run here: {why}" if why else ""), flush=True)

    ka, kb = jax.random.split(jax.random.key(0))
    a = G.gemm_operand(jf.quantize_blockwise(jax.random.normal(ka, (M, K), jnp.bfloat16), block=a_block,
                                             layout="gemm_ready"))
    b = G.gemm_operand(jf.quantize_blockwise(jax.random.normal(kb, (N, K), jnp.bfloat16), block=b_block,
                                             layout="gemm_ready"))
    gemm = jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16, backend=backend))
    out = None
    for _ in range(args.warmup):
        out = gemm(a, b)
    jax.block_until_ready(out)
    print(f"ncu_gemm: profiler start: {profiler(True)}", flush=True)
    for _ in range(args.runs):
        out = gemm(a, b)
    jax.block_until_ready(out)
    print(f"ncu_gemm: profiler stop: {profiler(False)}", flush=True)


if __name__ == "__main__":
    main()
