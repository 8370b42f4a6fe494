"""The FP8 blockwise GEMM against what JAX users pick instead, in one run with one timing harness.

Per shape (M, K, N), y (M, N) = x (M, K) · W:
  GEMM alone (operands already quantized; out bf16):
    bf16 ``lax.dot_general``; ours 1x128 x 128x128 and 1x128 x 1x128 (``jax_fp8.gemm.fp8_gemm``);
    PyTorch ``F.scaled_mm`` blockwise (the same cuBLASLt kernels: the ceiling).
  One linear layer, forward + backward (y, dx, dW from x, W, dy), all quantization included:
    bf16; ours (``fp8_dot_general``, Float8BlockScaling); flax's per-tensor FP8 (``Fp8DirectDotGeneralOp``,
    delayed scaling, what JAX users pick today).
Timing, JAX and PyTorch alike: many back-to-back calls over 3 rotating input sets, one sync, median of reps.
Also: relative error against fp64 of blockwise vs per-tensor FP8 on activations with outlier channels.

  python bench/bench_gemm.py [--shapes 4096x4096x4096,...] [--iters 30]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_fp8 as jf
from _timing import jax_time
from jax_fp8 import gemm as G
from jax_fp8.primitives import cublaslt

SHAPES = "4096x4096x4096,8192x8192x8192,16384x4096x4096,16384x4096x14336,16384x14336x4096"  # MxKxN
NT = (((1,), (1,)), ((), ()))  # x (M, K) . W (N, K): contract the last dims
KN = (((1,), (0,)), ((), ()))  # x (M, K) . W (K, N): flax's Dense layout


def torch_time(fn, arg_sets, iters: int, reps: int = 5) -> float:
    """Seconds per call, the way ``jax_time`` measures it: `iters` back-to-back calls over rotating
    argument sets (so L2 holds none), one synchronize, median of reps."""
    import torch

    for a in arg_sets:
        fn(*a)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(iters):
            fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def torch_blockwise(M: int, K: int, N: int, b_tiles: bool, iters: int):
    """PyTorch's cuBLAS blockwise GEMM (``F.scaled_mm``) on 3 operand sets: seconds per call, or the
    error it raised."""
    try:
        import torch
        import torch.nn.functional as F

        ST = F.ScalingType
        one_128 = getattr(ST, "BlockWise1x128", None) or getattr(ST, "Blockwise_1x128")
        tile = getattr(ST, "BlockWise128x128", None) or getattr(ST, "Blockwise_128x128")
        dev = "cuda"
        kb = -(-K // 128)
        sets = []
        for _ in range(3):
            x = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
            w = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
            sa = torch.rand(kb, M, device=dev).t()  # (M, K/128), outer-dim-major
            if b_tiles:  # (N/128, K/128), its rows padded to a multiple of 4, passed transposed
                sb = torch.rand(-(-N // 128), -(-kb // 4) * 4, device=dev)[:, :kb].t()
            else:
                sb = torch.rand(kb, N, device=dev).t()
            sets.append((x, w.t(), sa, sb))
        recipe_b = tile if b_tiles else one_128
        return torch_time(lambda x, w, sa, sb: F.scaled_mm(x, w, sa, one_128, sb, recipe_b,
                                                            output_dtype=torch.bfloat16), sets, iters)
    except Exception as e:  # report, do not stop the run
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def flax_per_tensor():
    """flax's per-tensor FP8 dot module (``Fp8DirectDotGeneralOp``) and None, or None and why not."""
    try:
        from flax import linen as nn
    except ImportError as e:
        return None, str(e)
    op_cls = getattr(nn, "Fp8DirectDotGeneralOp", None)
    if op_cls is None:
        from flax.linen import fp8_ops
        op_cls = fp8_ops.Fp8DirectDotGeneralOp
    op = op_cls()
    return op, None


def inputs(M: int, K: int, N: int, n: int = 3):
    keys = jax.random.split(jax.random.key(M * 7 + K * 3 + N), 3 * n)
    xs = [jax.random.normal(keys[i], (M, K), jnp.bfloat16) for i in range(n)]
    ws = [(jax.random.normal(keys[n + i], (K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16) for i in range(n)]
    dys = [jax.random.normal(keys[2 * n + i], (M, N), jnp.bfloat16) for i in range(n)]
    return xs, ws, dys


def per_gemm(gemm, sets, iters):
    """Seconds per GEMM two ways: one GEMM per jitted call, and all sets' GEMMs in one call (divided by
    their number), which takes JAX's per-call cost (dispatch, executable launch) out of the time."""
    one = jax_time(gemm, sets, iters)
    all_sets = jax_time(lambda *ops: [gemm(*o) for o in ops], [sets], iters) / len(sets)
    return one, all_sets


def gemm_alone(xs, ws, iters):
    """Seconds per GEMM: bf16, ours 1x128x128x128, ours 1x128x1x128 (operands quantized beforehand);
    also each with the 3 operand sets' GEMMs in one jitted call ("3 per call")."""
    wt = [w.T for w in ws]  # (N, K)
    t = {}
    t["bf16"], t["bf16, 3 per call"] = per_gemm(lambda x, w: lax.dot_general(x, w, NT), list(zip(xs, wt)), iters)
    xq = [jf.quantize_blockwise(x, layout="gemm_ready") for x in xs]
    for name, block in (("ours 1x128 x 128x128", (128, 128)), ("ours 1x128 x 1x128", (1, 128))):
        wq = [jf.quantize_blockwise(w, block=block, layout="gemm_ready") for w in wt]
        ops = [(G.gemm_operand(a), G.gemm_operand(b)) for a, b in zip(xq, wq)]
        t[name], t[name + ", 3 per call"] = per_gemm(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16), ops, iters)
    return t


def linear_fwd_bwd(xs, ws, dys, iters):
    """Seconds per forward + backward of one linear layer (W (K, N), flax's layout)."""
    def step(dot):
        def f(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: dot(x, w, KN), x, w)
            return y, *vjp(dy)
        return f

    sets = list(zip(xs, ws, dys))
    t = {"bf16": jax_time(step(lambda x, w, d: lax.dot_general(x, w, d)), sets, iters),
         "ours fp8 blockwise": jax_time(step(lambda x, w, d: jf.fp8_dot_general(x, w, d)), sets, iters)}
    op, why = flax_per_tensor()
    if op is None:
        t["flax per-tensor fp8"] = f"unavailable: {why}"
        return t
    variables = op.init(jax.random.key(0), xs[0], ws[0], KN)

    def flax_step(v, x, w, dy):
        y, vjp = jax.vjp(lambda v, x, w: op.apply(v, x, w, KN), v, x, w)
        return y, *vjp(dy)

    t["flax per-tensor fp8"] = jax_time(flax_step, [(variables, *s) for s in sets], iters)
    return t


def outlier_error(M=2048, K=4096, N=2048):
    """Mean over tokens of the relative error vs fp64 of the forward product, activations with outlier
    channels and
    token magnitudes spread over five decades (what per-tensor scaling cannot cover: its small tokens
    fall into E4M3's subnormals)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)) * 10.0 ** rng.uniform(-5, 0, (M, 1))
    x[:, rng.choice(K, 16, replace=False)] *= 20.0  # a few outlier channels, as in LLM activations
    x = x.astype(np.float32)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    # per token (row), then the mean: in one norm the large tokens would hide the small ones
    rel = lambda y: float(np.mean(np.linalg.norm(np.asarray(y, np.float64) - exact, axis=1)
                                    / np.linalg.norm(exact, axis=1)))
    xb, wb = jnp.asarray(x), jnp.asarray(w)
    ours = jf.fp8_dot_general(xb, wb, KN, preferred_element_type=jnp.float32)
    with warnings.catch_warnings():  # off Blackwell its GEMM is the reference: the same numbers
        warnings.simplefilter("ignore")
        mx = jf.fp8_dot_general(xb, wb, KN, preferred_element_type=jnp.float32, recipe=jf.MXFP8BlockScaling())

    def per_tensor(v):  # one scale per tensor, E4M3, values as the GEMM sees them
        s = jnp.max(jnp.abs(v)) / 448.0
        return (v / s).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s

    pt = lax.dot_general(per_tensor(xb), per_tensor(wb), KN, precision=lax.Precision.HIGHEST)
    bf = lax.dot_general(xb.astype(jnp.bfloat16), wb.astype(jnp.bfloat16), KN, preferred_element_type=jnp.float32)
    return {"fp8 blockwise (ours)": rel(ours), "fp8 MXFP8 (ours)": rel(mx), "fp8 per-tensor": rel(pt), "bf16": rel(bf)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--iters", type=int, default=30, help="calls per timed run (5 runs, median)")
    args = ap.parse_args()
    warnings.simplefilter("always", G.Fp8GemmFallbackWarning)
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} jax={jax.__version__} "
          f"cuBLASLt={cublaslt.cublaslt()} fp8 GEMM on CUDA unavailable because: {cublaslt.unavailable()}")
    gpu = jax.default_backend() == "gpu"
    for shape in args.shapes.split(","):
        M, K, N = map(int, shape.split("x"))
        flops = 2 * M * K * N
        xs, ws, dys = inputs(M, K, N)
        print(f"\n== M={M} K={K} N={N}")
        t = gemm_alone(xs, ws, args.iters)
        if gpu:
            t["torch scaled_mm 1x128 x 128x128"] = torch_blockwise(M, K, N, True, args.iters)
            t["torch scaled_mm 1x128 x 1x128"] = torch_blockwise(M, K, N, False, args.iters)
        base = t["bf16"]
        for name, s in t.items():
            if isinstance(s, str):
                print(f"  GEMM   {name:34s} {s}")
            else:
                print(f"  GEMM   {name:34s} {s * 1e6:9.1f} us {flops / s / 1e12:7.1f} TFLOP/s  {base / s:5.2f}x bf16")
        for ours, theirs in (("ours 1x128 x 128x128", "torch scaled_mm 1x128 x 128x128"),
                             ("ours 1x128 x 1x128", "torch scaled_mm 1x128 x 1x128")):
            if isinstance(t.get(theirs), float):
                print(f"  GEMM   {ours} / torch: {t[ours] / t[theirs]:.3f} (time ratio; "
                      f"{t[ours + ', 3 per call'] / t[theirs]:.3f} with 3 per call)")
        t = linear_fwd_bwd(xs, ws, dys, args.iters)
        base = t["bf16"]
        for name, s in t.items():
            if isinstance(s, str):
                print(f"  LINEAR {name:34s} {s}")
            else:
                print(f"  LINEAR {name:34s} {s * 1e6:9.1f} us {3 * flops / s / 1e12:7.1f} TFLOP/s  "
                      f"{base / s:5.2f}x bf16 (fwd+bwd)")
    print("\nmean relative error per token vs fp64, x (2048, 4096) with token scales 10^U(-5, 0) and 16 outlier "
          "channels (x20), W (4096, 2048):")
    for name, e in outlier_error().items():
        print(f"  {name:22s} {e:.3e}")


if __name__ == "__main__":
    main()
