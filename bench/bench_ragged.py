"""Mixture-of-experts pieces, side by side in one run: the grouped quantize (``jf_quantize_grouped``: both
usages, columnwise blocks restarting at every group start) against the dense quantize of the same rows
(``jf_quantize``, both usages) and a device-to-device copy of the input; the grouped GEMMs alone
(forward, weight gradient) against bf16 ``lax.ragged_dot`` and a dense blockwise FP8 GEMM of the same
rows; and one MoE projection's forward + backward on ``fp8_ragged_dot`` against bf16 ``lax.ragged_dot`` and a dense layer of the same
total rows (bf16 ``lax.dot_general`` and ``fp8_dot_general``). Shapes: DeepSeek-V3-like experts
(hidden 7168, expert FFN 2048), balanced or skewed routing, each expert's rows padded to 128.

GB/s counts what the quantize must move: the input read once, the FP8 data and fp32 scales written once.

  python bench/bench_ragged.py [--experts 8,32,256] [--rows 4096,16384] [--k 7168] [--n 2048] [--iters 20] [--tune]

``--tune`` times the grouped GEMMs at every CUTLASS grouped-kernel configuration and raster order
(through the GEMM table's ``ragged_m`` / ``ragged_k`` rows) and prints the fastest as table rows, with its
gain over the default timed again in turns (the figure to trust).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_fp8 as jf
from _timing import in_turns, jax_time as _jax_time
from bench_kernels import device_copy, leaves_equal, register_device_copy
from jax_fp8 import contracts, groups
from jax_fp8.quantization import quantize, quantize_grouped

RECIPE = jf.Float8BlockScaling()


def jax_time(f, arg_sets, iters):
    """Seconds per call, or NaN where the call fails (XLA's bf16 ragged_dot runs out of memory at 256 groups)."""
    try:
        return _jax_time(f, arg_sets, iters)
    except Exception as e:  # noqa: BLE001
        print(f"    failed: {str(e).splitlines()[0][:160]}", flush=True)
        return float("nan")
LHS = RECIPE.scheme("lhs")
BF16 = jnp.bfloat16


def routing_sizes(rows: int, experts: int, skewed: bool, rng) -> np.ndarray:
    """Group sizes summing to about ``rows``, each padded to 128: even, or Zipf-like (a few experts take
    most rows)."""
    w = 1.0 / np.arange(1, experts + 1) ** 1.2 if skewed else np.ones(experts)
    sizes = np.floor(rows * w / w.sum()).astype(np.int64)
    return (-(-sizes // 128) * 128).astype(np.int32)


def bench_quantize(M: int, K: int, sizes, iters: int, copy: bool) -> None:
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((M, K)), BF16) for _ in range(3)]
    s = jnp.asarray(sizes)
    moved = M * K * 2 + 2 * M * K + 4 * (2 * M * K // 128)
    grouped = jax_time(lambda x: quantize_grouped(x, s, LHS), [(x,) for x in xs], iters)
    dense = jax_time(lambda x: quantize(x, LHS), [(x,) for x in xs], iters)
    line = (f"  QUANTIZE {M}x{K} G={len(sizes)}: grouped {grouped * 1e6:8.1f} us ({moved / grouped / 1e9:6.0f} GB/s)  "
            f"dense {dense * 1e6:8.1f} us ({moved / dense / 1e9:6.0f} GB/s)")
    if copy:
        t = jax_time(device_copy, [(x,) for x in xs], iters)
        line += f"  memcpy {t * 1e6:8.1f} us ({2 * M * K * 2 / t / 1e9:6.0f} GB/s)"
    print(line, flush=True)
    got = jax.jit(lambda x: quantize_grouped(x, s, LHS))(xs[0])
    want = contracts.quantize_grouped_usages(np.asarray(xs[0][:, :256]), np.asarray(sizes), scheme=LHS)
    print(f"    bits of the first 256 columns' columnwise data equal the contract's: "
          f"{leaves_equal(np.asarray(got['colwise'][0])[:256].view(np.uint8), want[2])}", flush=True)


def bench_layer(M: int, K: int, N: int, sizes, iters: int) -> None:
    rng = np.random.default_rng(1)
    G = len(sizes)
    s = jnp.asarray(sizes)
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), BF16)
    wd = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), BF16)

    def step(f):
        return lambda x, w: jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(), (0, 1))(x, w)

    times = {
        "bf16 ragged_dot": jax_time(step(lambda x, w: lax.ragged_dot(x, w, s)), [(x, w)], iters),
        "fp8_ragged_dot": jax_time(step(lambda x, w: jf.fp8_ragged_dot(x, w, s)), [(x, w)], iters),
        "dense bf16": jax_time(step(lambda x, w: x @ w), [(x, wd)], iters),
        "dense fp8_dot_general": jax_time(step(lambda x, w: jf.fp8_dot_general(x, w, (((1,), (0,)), ((), ())))),
                                          [(x, wd)], iters),
    }
    base = times["bf16 ragged_dot"]
    print(f"  LAYER {M}x{K}x{N} G={G} (fwd+bwd): " + "  ".join(f"{k} {v * 1e3:7.2f} ms ({base / v:4.2f}x)"
                                                               for k, v in times.items()), flush=True)


def grouped_gemms(M: int, K: int, N: int, sizes):
    """Seeded bf16 x (M, K) and w (G, K, N), and the grouped GEMMs on them, operands quantized beforehand:
    ``{"ragged_m": (table shape, call, operands), "ragged_k": ...}`` (the forward, M-grouped, bf16 out;
    the weight gradient, K-grouped, fp32 out), keyed as the GEMM table's rows."""
    from jax_fp8.gemm.backends.cutlass import ragged_key
    from jax_fp8.gemm.ragged_primitive import ragged_gemm
    from jax_fp8.quantization import quantize_each

    rng = np.random.default_rng(3)
    s = jnp.asarray(sizes)
    x, dy = (jnp.asarray(rng.standard_normal(shape), BF16) for shape in ((M, K), (M, N)))
    w = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / np.sqrt(K), BF16)
    xq, dyq = quantize_grouped(x, s, LHS), quantize_grouped(dy, s, RECIPE.scheme("grad"))
    wq = quantize_each(w, RECIPE.scheme("rhs", rowwise=False))["colwise"]
    G = len(sizes)
    return x, w, {"ragged_m": (ragged_key("m", M, N, K, G), lambda *o: ragged_gemm(*o, s, kind="m", out_dtype=BF16),
                               (*xq["rowwise"], *wq)),
                  "ragged_k": (ragged_key("k", K, N, M, G), lambda *o: ragged_gemm(*o, s, kind="k", rows=M,
                                                                                    out_dtype=jnp.float32),
                               (*xq["colwise"], *dyq["colwise"]))}


def bench_gemms(M: int, K: int, N: int, sizes, iters: int) -> None:
    """The grouped GEMMs alone (operands quantized beforehand): forward (M-grouped) and weight gradient
    (K-grouped) against bf16 ``lax.ragged_dot`` (forward) and against one dense blockwise FP8 GEMM of the
    same rows (``fp8_gemm`` on the plan's backend, 1x128 x 128x128), and on CUTLASS's own dense kernel of the
    grouped kernels' tile and schedule (configuration 0: CUTLASS's mainloop, not ours), which tells the
    grouping's cost from the mainloop's."""
    from jax_fp8 import gemm as G
    from jax_fp8.gemm.backends.cutlass import CUTLASS

    s = jnp.asarray(sizes)
    x, w, calls = grouped_gemms(M, K, N, sizes)
    (_, fwd, fwd_ops), (_, wgrad, wgrad_ops) = calls["ragged_m"], calls["ragged_k"]
    a = G.gemm_operand(jf.quantize_blockwise(x, block=(1, 128), layout="gemm_ready"))
    b = G.gemm_operand(jf.quantize_blockwise(w[0].T, block=(128, 128), layout="gemm_ready"))
    t = {"bf16 ragged_dot fwd": jax_time(lambda x, w: lax.ragged_dot(x, w, s), [(x, w)], iters),
         "fp8 grouped fwd": jax_time(fwd, [fwd_ops], iters),
         "fp8 dense fwd": jax_time(lambda a, b: G.fp8_gemm(a, b, BF16), [(a, b)], iters),
         "fp8 dense fwd cutlass c1x1": jax_time(
             lambda a, b: G.fp8_gemm(a, b, BF16, backend=CUTLASS.with_options(config=0)), [(a, b)], iters),
         "fp8 grouped wgrad": jax_time(wgrad, [wgrad_ops], iters)}
    flops = 2 * M * K * N
    print(f"  GEMMS {M}x{K}x{N} G={len(sizes)}: " + "  ".join(f"{k} {v * 1e6:8.1f} us ({flops / v / 1e12:5.0f} TF/s)"
                                                              for k, v in t.items()), flush=True)


def tune_gemms(M: int, K: int, N: int, sizes, iters: int, rounds: int = 3) -> None:
    """The grouped GEMMs alone at each CUTLASS grouped-kernel option set (configuration x raster order),
    set through the GEMM table's ``ragged_m`` / ``ragged_k`` rows; prints each time and the fastest rows.
    The fastest is then timed against the default in turns (``rounds``, the order alternating): the clocks
    drift over a sweep, and the fastest of many timings is the luckiest; its median gain is the one to trust."""
    from jax_fp8.gemm import table
    from jax_fp8.gemm.backends import cutlass

    _, _, calls = grouped_gemms(M, K, N, sizes)
    kind = table.local_device_kind()
    saved = dict(table.TABLE.get(kind, {}))
    default = (("config", 0), ("raster", 0))
    try:
        for key, (mnk, f, operands) in calls.items():
            def timed(opts):
                table.TABLE.setdefault(kind, {})[key] = [(mnk, "cutlass", dict(opts))]
                jax.clear_caches()
                return jax_time(lambda *o: f(*o), [operands], iters)

            times = {}
            for config in range(len(cutlass.RAGGED_CONFIGS)):
                for raster in (0, 2):  # 0 and 1 are both along M
                    opts = (("config", config), ("raster", raster))
                    times[opts] = t = timed(opts)
                    print(f"  TUNE {key} {'x'.join(map(str, mnk))} per group, G={len(sizes)}, {cutlass.RAGGED_CONFIGS[config]} "
                          f"raster {raster}: {t * 1e6:8.1f} us ({2 * M * K * N / t / 1e12:5.0f} TF/s)", flush=True)
            best = min(times, key=times.get)
            gains = [d / b for d, b in zip(*in_turns(timed, default, best, rounds if best != default else 0))]
            turns = f", {float(np.median(gains)):.3f}x in {rounds} turns" if gains else ""
            print(f"  BEST {key}: ({mnk}, \"cutlass\", {dict(best)}),  # {times[default] / times[best]:.3f}x the default"
                  f"{turns}", flush=True)
    finally:
        table.TABLE[kind] = saved
        jax.clear_caches()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="8,32,256")
    ap.add_argument("--rows", default="4096,16384")
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-layer", action="store_true", help="the quantize alone")
    ap.add_argument("--routing", choices=("both", "balanced", "skewed"), default="both")
    ap.add_argument("--tune", action="store_true",
                    help="also the grouped GEMMs at every CUTLASS grouped-kernel option set (the table's ragged rows)")
    args = ap.parse_args()
    copy = jax.default_backend() == "gpu" and register_device_copy()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; routed rows padded to 128 per expert")
    rng = np.random.default_rng(2)
    for rows in (int(r) for r in args.rows.split(",")):
        for experts in (int(e) for e in args.experts.split(",")):
            for skewed in {"both": (False, True), "balanced": (False,), "skewed": (True,)}[args.routing]:
                sizes = routing_sizes(rows, experts, skewed, rng)
                M = int(sizes.sum())
                print(f"rows {M} ({'skewed' if skewed else 'balanced'}, {experts} experts, largest group "
                      f"{sizes.max()}; layout bound {groups.layout_rows(rows, 1, experts, 128)})", flush=True)
                bench_quantize(M, args.k, sizes, args.iters, copy)
                if args.tune:
                    tune_gemms(M, args.k, args.n, sizes, args.iters)
                if not args.no_layer:
                    bench_gemms(M, args.k, args.n, sizes, args.iters)
                    bench_layer(M, args.k, args.n, sizes, args.iters)


if __name__ == "__main__":
    main()
