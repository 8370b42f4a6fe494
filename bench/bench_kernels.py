"""Times jax_fp8's kernels against the XLA-fused jax.numpy reference and an XLA elementwise copy.

Many-dispatch timing: each jitted call is dispatched `iters` times back to back over rotating input
buffers (so L2 cannot hold the input), the device is synchronized once, and the median over `reps`
such runs is reported. GB/s counts the bytes a fused kernel must move (input read once, outputs
written once). Also checks our output against the reference bit for bit at every size it times.

  python bench/bench_kernels.py [--sizes 8192x8192,32768x16384] [--dtype bfloat16] [--per-call 3]
"""
from __future__ import annotations

import argparse
import ctypes
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8 as jf
from _timing import jax_time
from jax_fp8 import Scheme

COPY_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".bin", "libjf_device_copy.so")


def register_device_copy() -> bool:
    """Registers bench/device_copy.cu's cudaMemcpyAsync target (built by build_kernel_bench.sh), if built."""
    if not os.path.exists(COPY_LIB):
        return False
    lib = ctypes.cdll.LoadLibrary(COPY_LIB)
    jax.ffi.register_ffi_target("jf_bench_device_copy", jax.ffi.pycapsule(lib.JfDeviceCopy), platform="CUDA")
    return True


def device_copy(x):
    """cudaMemcpyAsync device-to-device (bench-only target, bench/device_copy.cu)."""
    return jax.ffi.ffi_call("jf_bench_device_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def timeit(fn, inputs, iters: int, reps: int = 7, per_call: int = 1) -> float:
    """Seconds per application of fn. per_call > 1: each jitted call applies fn to that many of the
    inputs and the time is divided by it, which takes JAX's per-call cost (dispatch, executable launch:
    11-26 us at 4096³; bench/RESULTS.md, "the model with cuDNN attention, every test, the kernels, JAX's
    per-call cost") out of kernels that run for tens of microseconds."""
    sets = [tuple(inputs[(i + j) % len(inputs)] for j in range(per_call)) for i in range(len(inputs))]
    return jax_time(lambda *xs: [fn(x) for x in xs], sets, iters, reps) / per_call


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(la, lb))


def cases(M: int, K: int, isz: int):
    """(name, ours, reference, bytes moved) for each kernel."""
    n = M * K
    mx_scale, f8_scale = n // 32, 4 * (n // 128)
    R = jf.reference
    return [
        ("mxfp8 rowwise", lambda x: jf.quantize_mxfp8(x), lambda x: R.quantize_mxfp8(x), n * isz + n + mx_scale),
        ("mxfp8 row+col", lambda x: jf.quantize_mxfp8(x, colwise=True),
         lambda x: R.quantize_mxfp8(x, colwise=True), n * isz + 2 * (n + mx_scale)),
        ("mxfp8 colwise", lambda x: jf.quantize_mxfp8(x, rowwise=False, colwise=True),
         lambda x: R.quantize_mxfp8(x, rowwise=False, colwise=True), n * isz + n + mx_scale),
        ("float8 1x128", lambda x: jf.quantize_blockwise(x), lambda x: R.quantize_blockwise(x), n * isz + n + f8_scale),
        ("float8 1x128 row+col", lambda x: jf.quantize_blockwise(x, colwise=True),
         lambda x: R.quantize_blockwise(x, colwise=True), n * isz + 2 * (n + f8_scale)),
        ("float8 128x128", lambda x: jf.quantize_blockwise(x, block=(128, 128)),
         lambda x: R.quantize_blockwise(x, block=(128, 128)), n * isz + n + 4 * (n // 16384)),
        # GEMM-ready: columnwise data transposed in the same pass, scales in cuBLASLt's order
        ("float8 1x128 row+colT", lambda x: jf.quantize_blockwise(x, colwise=True, layout="gemm_ready"),
         lambda x: R.quantize_blockwise(x, colwise=True, layout="gemm_ready"), n * isz + 2 * (n + f8_scale)),
        ("float8 128x128 row+colT", lambda x: jf.quantize_blockwise(x, block=(128, 128), colwise=True,
                                                                    layout="gemm_ready"),
         lambda x: R.quantize_blockwise(x, block=(128, 128), colwise=True, layout="gemm_ready"),
         n * isz + 2 * (n + 4 * (n // 16384))),
        ("mxfp8 row+colT", lambda x: jf.quantize_mxfp8(x, colwise=True, layout="gemm_ready"),
         lambda x: R.quantize_mxfp8(x, colwise=True, layout="gemm_ready"), n * isz + 2 * (n + mx_scale)),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192x8192,16384x16384,32768x16384")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="", help="time only kernels whose name contains this")
    ap.add_argument("--per-call", type=int, default=1,
                    help="kernels per jitted call (each on its own input; the time divided by it)")
    args = ap.parse_args()
    if args.per_call < 1:
        ap.error(f"--per-call must be >= 1, got {args.per_call}")
    dtype = jnp.dtype(args.dtype)
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} jax={jax.__version__} "
          f"kernels={jf.kernels_available()}")
    have_copy = jax.default_backend() == "gpu" and register_device_copy()
    if jax.default_backend() == "gpu" and not have_copy:
        print(f"no {COPY_LIB} (bash bench/build_kernel_bench.sh builds it): the roofline is XLA's x*2")
    if args.per_call > 1:
        print(f"{args.per_call} kernels per jitted call, each on its own input; times per kernel")
    rows = []

    def t(fn, ins):
        return timeit(fn, ins, args.iters, per_call=args.per_call)

    for size in args.sizes.split(","):
        M, K = map(int, size.split("x"))
        keys = jax.random.split(jax.random.key(M + K), 3)
        inputs = [(jax.random.normal(k, (M, K), jnp.float32) * 4).astype(dtype) for k in keys]
        n = M * K
        # roofline: a device-to-device cudaMemcpy where our CUDA module is loaded, else XLA's x*2
        t_xla = t(lambda x: x * 2, inputs)
        gpu = jax.default_backend() == "gpu" and have_copy
        t_copy = t(device_copy, inputs) if gpu else t_xla
        copy_gbs = 2 * n * dtype.itemsize / t_copy / 1e9
        rows.append((f"{M}x{K}", "device copy (memcpy)" if gpu else "copy = xla x*2", t_copy, copy_gbs, 100.0,
                     float("nan"), "-"))
        xla_gbs = 2 * n * dtype.itemsize / t_xla / 1e9
        rows.append((f"{M}x{K}", "xla elementwise x*2", t_xla, xla_gbs, 100 * xla_gbs / copy_gbs, float("nan"), "-"))
        for name, ours, ref, nbytes in [c for c in cases(M, K, dtype.itemsize) if args.only in c[0]]:
            t_o = t(ours, inputs)
            t_r = t(ref, inputs)
            exact = leaves_equal(jax.jit(ours)(inputs[0]), jax.jit(ref)(inputs[0]))
            gbs = nbytes / t_o / 1e9
            rows.append((f"{M}x{K}", name, t_o, gbs, 100 * gbs / copy_gbs, t_r / t_o, exact))
        if args.only not in "dequantize mxfp8":
            continue
        q = jax.jit(lambda x: jf.quantize_mxfp8(x))(inputs[0])
        qs = [jax.jit(lambda x: jf.quantize_mxfp8(x))(x) for x in inputs]
        t_d = t(lambda q: jf.dequantize(q), qs)
        t_dr = t(lambda q: R_deq(q), qs)
        nb = n + n // 32 + n * dtype.itemsize
        exact = leaves_equal(jax.jit(jf.dequantize)(q), jax.jit(R_deq)(q))
        rows.append((f"{M}x{K}", "dequantize mxfp8", t_d, nb / t_d / 1e9, 100 * nb / t_d / 1e9 / copy_gbs, t_dr / t_d,
                     exact))
        if not args.only:
            rows += partial_rows(M, K, inputs, copy_gbs, args.iters)
    if not args.only:
        grouped_rows(args.iters)
    print(f"\n{'size':>12} {'kernel':>22} {'time us':>9} {'GB/s':>7} {'% copy':>7} {'vs jnp':>7} {'bit-exact':>9}")
    for r in rows:
        print(f"{r[0]:>12} {r[1]:>22} {r[2] * 1e6:9.1f} {r[3]:7.0f} {r[4]:7.1f} {r[5]:7.2f} {str(r[6]):>9}")


MX_ROWCOL = Scheme("mxfp8", rowwise=True, colwise=True)


def _partial_fns(shapes, windows, scheme=MX_ROWCOL):
    """(amax, cast) over a group of shards, the cast with the reduced values of one amax call."""
    from jax_fp8.primitives.partial import partial_amax_p, partial_cast_p

    p = dict(shapes=tuple(shapes), scheme=scheme)
    amax = lambda *s: partial_amax_p.bind(windows, *s, **p)[0]  # noqa: E731
    return amax, lambda glob: (lambda *s: partial_cast_p.bind(windows, glob, *s, **p))


def partial_rows(M, K, inputs, copy_gbs, iters):
    """Master-weight kernels on one device: a rank holding half the weight (offset M*K/4)."""
    n = M * K
    L = n // 2
    amax, cast_with = _partial_fns([(M, K)], jnp.array([[n // 4, L]], jnp.int32))
    shards = [x.reshape(-1)[:L] for x in inputs]
    cast = cast_with(jax.jit(amax)(shards[0]))
    isz = inputs[0].dtype.itemsize
    out = []
    for name, fn, nbytes in [("partial amax mx r+c", amax, L * isz + 2 * (n // 32)),
                             ("partial cast mx r+c", cast, L * isz + 2 * L + 2 * (n // 32))]:
        t = timeit(fn, shards, iters)
        gbs = nbytes / t / 1e9
        out.append((f"{M}x{K}", name, t, gbs, 100 * gbs / copy_gbs, float("nan"), "tests"))  # checked by test_distributed
    return out


def grouped_rows(iters, T=64, m=1024, k=1024, ranks=8):
    """Many small weights (T of m x k, bf16, a rank's 1/ranks shard of each): the partial kernels as one
    grouped call per jitted step against one call per weight in the same step. Reports us per weight."""
    L = m * k // ranks
    keys = jax.random.split(jax.random.key(7), 3)
    inputs = [tuple(jax.random.normal(kk, (T, L), jnp.float32).astype(jnp.bfloat16)) for kk in keys]
    win = jnp.array([[3 * L, L]], jnp.int32)  # the fourth rank's window
    group_amax, group_cast = _partial_fns([(m, k)] * T, jnp.tile(win, (T, 1)))
    one_amax, one_cast = _partial_fns([(m, k)], win)
    glob = jax.jit(group_amax)(*inputs[0])
    globs = jnp.split(glob, T)
    at = [g[0][0] for g in MX_ROWCOL.packed_grids([(m, k)] * T)]
    outs = {  # every output of the step, grouped or not, for the exactness check
        "amax grouped": lambda s: group_amax(*s),
        "amax per weight": lambda s: jnp.concatenate([one_amax(x) for x in s]),
        "cast grouped": lambda s: group_cast(glob)(*s),
        "cast per weight": lambda s: [d for g, x in zip(globs, s) for d in one_cast(g)(x)],
    }
    # timed: one element of each weight's output, gathered by one small fusion in every variant, so
    # the host does not handle 64-128 output buffers per call
    fns = {
        "amax grouped": lambda s: group_amax(*s)[jnp.array(at)],
        "amax per weight": lambda s: jnp.stack([one_amax(x)[0] for x in s]),
        "cast grouped": lambda s: jnp.stack(group_cast(glob)(*s)[::2])[:, 0],
        "cast per weight": lambda s: jnp.stack([one_cast(g)(x)[0][0] for g, x in zip(globs, s)]),
    }
    exact = leaves_equal(jax.jit(outs["amax grouped"])(inputs[0]), jax.jit(outs["amax per weight"])(inputs[0]))
    exact &= leaves_equal(jax.jit(outs["cast grouped"])(inputs[0]), jax.jit(outs["cast per weight"])(inputs[0]))
    t = {name: timeit(fn, inputs, iters) for name, fn in fns.items()}
    print(f"\n{T} weights {m}x{k} bf16, 1/{ranks} shard each, one jitted step (grouped == per weight: {exact}):")
    for kind in ("amax", "cast"):
        g, s = t[f"{kind} grouped"], t[f"{kind} per weight"]
        print(f"  partial {kind}: grouped {g * 1e6 / T:6.2f} us/weight, per-weight calls {s * 1e6 / T:6.2f} us/weight "
              f"({s / g:.2f}x)")


def R_deq(q):
    return jf.reference.dequantize(q)


if __name__ == "__main__":
    main()
