"""The FP8 blockwise GEMM against what JAX users pick instead, in one run with one timing harness.

Per shape (M, K, N), y (M, N) = x (M, K) · W:
  GEMM alone (operands already quantized; out bf16), for the layer's fprop (GEMM (M, N, K), x 1x128 x
  W 128x128: pair 1D2D) and its wgrad (dW = dyᵀ·x, GEMM (N, K, M), 1x128 x 1x128 along M: pair 1D1D):
    bf16 ``lax.dot_general`` at the same GEMM; ours (``jax_fp8.gemm.fp8_gemm``) on cuBLASLt's heuristic,
    on the tuned cuBLASLt algorithm and the tuned CUTLASS config (``--table``'s ``best_per_backend``, as
    bench_gemm_tune.py writes it; CUTLASS's defaults without), and on the plan's choice (the GEMM table:
    ``--table`` loaded, else ``gemm_table.TABLE``); PyTorch ``F.scaled_mm`` blockwise (the same cuBLASLt
    kernels) and per-tensor (TensorWise scales, E4M3, with and without fast accumulation).
  One linear layer, forward + backward (y, dx, dW from x, W, dy), all quantization included:
    bf16; ours (``fp8_dot_general``, Float8BlockScaling: its GEMMs as the plan picks them, so the table's
    kernels when it has rows; and with the table's rows removed, cuBLASLt's heuristic); flax's per-tensor
    FP8 (``Fp8DirectDotGeneralOp``, delayed scaling, what JAX users pick today).
Timing, JAX and PyTorch alike: many back-to-back calls over 3 rotating input sets, one sync, median of reps.
Also: relative error against fp64 of blockwise vs per-tensor FP8 on activations with outlier channels.

  python bench/bench_gemm.py [--shapes 4096x4096x4096,...] [--iters 30] [--table gemm_table.json]
  python bench/bench_gemm.py --crossover [--grid-m ...] [--grid-kn ...] [--crossover-out crossover.json]
    (the crossover table of jax_fp8.gemm.crossover: a linear layer bf16 vs FP8 over a grid of shapes)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_fp8 as jf
from _timing import jax_time
from jax_fp8 import gemm as G
from jax_fp8.gemm import table as gemm_table
from jax_fp8.gemm.backends import cublaslt
from jax_fp8.gemm.backends.cublaslt import CUBLASLT

try:
    from jax_fp8.gemm.backends.cutlass import CUTLASS
except ImportError as e:  # not written / not installed yet
    CUTLASS, CUTLASS_MISSING = None, f"jax_fp8.gemm.backends.cutlass: {e}"

SHAPES = ("2048x2048x2048,4096x4096x4096,8192x8192x8192,16384x4096x4096,16384x4096x14336,16384x14336x4096,"
          "16384x512x4096")  # MxKxN
PAIRS = {"1D2D": ((1, 128), (128, 128)), "1D1D": ((1, 128), (1, 128))}
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


def torch_per_tensor(M: int, K: int, N: int, fast_accum: bool, iters: int):
    """PyTorch's per-tensor FP8 GEMM (``F.scaled_mm`` with TensorWise scales, else ``torch._scaled_mm``):
    E4M3 x (M, K) . w (N, K)ᵀ, one fp32 scale each, bf16 out, on 3 operand sets: seconds per call, or
    the error it raised."""
    try:
        import torch
        import torch.nn.functional as F

        dev = "cuda"
        sets = [(torch.randn(M, K, device=dev).to(torch.float8_e4m3fn),
                 torch.randn(N, K, device=dev).to(torch.float8_e4m3fn).t(),
                 torch.tensor(1.0, device=dev), torch.tensor(1.0, device=dev)) for _ in range(3)]
        tensorwise = getattr(getattr(F, "ScalingType", None), "TensorWise", None)

        def new(x, w, sa, sb):
            return F.scaled_mm(x, w, sa, tensorwise, sb, tensorwise, output_dtype=torch.bfloat16,
                               use_fast_accum=fast_accum)

        def old(x, w, sa, sb):
            return torch._scaled_mm(x, w, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)

        fn = old
        if tensorwise is not None:
            try:
                new(*sets[0])
                fn = new
            except Exception:  # noqa: BLE001 - an older F.scaled_mm: the private op
                pass
        return torch_time(fn, sets, iters)
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


THREE = ", 3 per call"  # the label of all_in_one_call's times (3 operand sets)


def all_in_one_call(fn, sets, iters):
    """Seconds per call of ``fn`` with all sets' calls in one jitted call (divided by their number): JAX's
    per-call cost (dispatch, executable launch), which a training step's command buffer does not pay per
    GEMM, mostly taken out."""
    return jax_time(lambda *ops: [fn(*o) for o in ops], [sets], iters) / len(sets)


def per_gemm(gemm, sets, iters):
    """Seconds per GEMM two ways: one GEMM per jitted call, and all sets' GEMMs in one call."""
    return jax_time(gemm, sets, iters), all_in_one_call(gemm, sets, iters)


def gemm_problems(xs, ws, dys):
    """The layer's fprop and wgrad GEMMs: (role, pair, a operands (Mg, Kg), b operands (Ng, Kg)), bf16,
    materialized K-major (the transposes done here, outside the timed calls)."""
    wt = [w.T for w in ws]  # (N, K)
    dyt = [jnp.asarray(dy.T) for dy in dys]  # (N, M): wgrad's a, contraction over M
    xt = [jnp.asarray(x.T) for x in xs]  # (K, M): wgrad's b
    return [("fprop", "1D2D", xs, wt), ("wgrad", "1D1D", dyt, xt)]


def backend_of(name: str):
    return {CUBLASLT.name: CUBLASLT, **({CUTLASS.name: CUTLASS} if CUTLASS is not None else {})}.get(name)


def tuned(best_per_backend: dict, pair: str, name: str, M: int, N: int, K: int):
    """The backend (with options) bench_gemm_tune.py measured fastest of backend ``name`` for the
    nearest problem of ``pair``, and that problem; or (None, None)."""
    rows = [r for r in best_per_backend.get(pair, []) if r[1] == name]
    base = backend_of(name)
    if not rows or base is None:
        return None, None
    mnk, _, options, _ = gemm_table.nearest(rows, M, N, K)
    return base.with_options(**options), tuple(mnk)


def gemm_alone(pair, a_hi, b_hi, iters, best_per_backend):
    """Seconds per GEMM a (Mg, Kg) . b (Ng, Kg)ᵀ of one pair (or why not): bf16; ours on cuBLASLt's
    heuristic, the tuned cuBLASLt and CUTLASS kernels and the plan's choice (operands quantized
    beforehand); bf16 and the heuristic also with the 3 operand sets' GEMMs in one jitted call."""
    (Mg, Kg), Ng = a_hi[0].shape, b_hi[0].shape[0]
    a_block, b_block = PAIRS[pair]
    t = {}
    t["bf16"], t["bf16" + THREE] = per_gemm(lambda x, w: lax.dot_general(x, w, NT), list(zip(a_hi, b_hi)), iters)
    a_q = [jf.quantize_blockwise(a, block=a_block, layout="gemm_ready") for a in a_hi]
    b_q = [jf.quantize_blockwise(b, block=b_block, layout="gemm_ready") for b in b_hi]
    ops = [(G.gemm_operand(a), G.gemm_operand(b)) for a, b in zip(a_q, b_q)]
    timed = {}  # backend object -> seconds (each kernel timed once)

    def ours(label, backend, three=False):
        if backend not in timed:
            gemm = lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16, backend=backend)
            name = f"ours {label} {backend!r}"
            if three:
                t[name], t[name + THREE] = per_gemm(gemm, ops, iters)
            else:
                t[name] = jax_time(gemm, ops, iters)
            timed[backend] = t[name]
        else:
            t[f"ours {label} {backend!r}"] = f"= {timed[backend] * 1e6:.1f} us (timed above)"

    ours("heuristic", CUBLASLT, three=True)
    tag = lambda at: "tuned" if at == (Mg, Ng, Kg) else f"tuned@{'x'.join(map(str, at))}"  # the nearest row's
    lt, at = tuned(best_per_backend, pair, CUBLASLT.name, Mg, Ng, Kg)
    if lt is not None:
        ours(tag(at), lt)
    if CUTLASS is None:
        t["ours cutlass"] = f"unavailable: {CUTLASS_MISSING}"
    elif CUTLASS.unavailable("cuda") is not None and jax.default_backend() == "gpu":
        t["ours cutlass"] = f"unavailable: {CUTLASS.unavailable('cuda')}"
    else:
        cut, at = tuned(best_per_backend, pair, CUTLASS.name, Mg, Ng, Kg)
        ours(tag(at) if cut is not None else "default", cut or CUTLASS)
    plan = G.plan_gemm(Mg, Ng, Kg, a_block, b_block)
    if plan.backend is not None:
        pick = gemm_table.choose(Mg, Ng, Kg, a_block, b_block)
        if pick is None:
            note = "(no table row)"
        else:
            want = backend_of(pick[0])
            want = want.with_options(**pick[1]) if want is not None else f"{pick[0]}{pick[1]}"
            note = "(table)" if want is plan.backend else f"(table's {want!r} not taken)"
        ours(f"plan {note}", plan.backend)
    else:
        t["ours plan"] = f"no backend: {plan.reason}"
    return t


@contextlib.contextmanager
def without_table(kind: str):
    """The GEMM table without ``kind``'s rows (the plan then runs each backend's own choice)."""
    rows = gemm_table.TABLE.pop(kind, None)
    try:
        yield
    finally:
        if rows is not None:
            gemm_table.TABLE[kind] = rows


def step(dot):
    """One linear layer's forward + backward (y, dx, dW from x, W (K, N), dy) on ``dot``."""
    def f(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: dot(x, w, KN), x, w)
        return y, *vjp(dy)
    return f


def linear_fwd_bwd(xs, ws, dys, iters):
    """Seconds per forward + backward of one linear layer (W (K, N), flax's layout)."""
    sets = list(zip(xs, ws, dys))
    ours = step(lambda x, w, d: jf.fp8_dot_general(x, w, d))
    t = {"bf16": jax_time(step(lambda x, w, d: lax.dot_general(x, w, d)), sets, iters)}
    kind = jax.devices()[0].device_kind
    if gemm_table.TABLE.get(kind):
        t["ours fp8 blockwise (table)"] = jax_time(ours, sets, iters)
        with without_table(kind):
            t["ours fp8 blockwise (heuristic)"] = jax_time(ours, sets, iters)
    else:
        t["ours fp8 blockwise"] = jax_time(ours, sets, iters)
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


def show(section: str, t: dict, flops: float, base_name: str = "bf16", what: str = ""):
    """One line per measurement: section, name, us, TFLOP/s, ratio to bf16 (or the reason it has none); a
    "..., 3 per call" time against bf16's "..., 3 per call" (the same JAX per-call cost shared alike)."""
    for name, s in t.items():
        three = name.endswith(THREE) and isinstance(t.get(base_name + THREE), float)
        base = t[base_name + THREE] if three else t[base_name]
        if isinstance(s, str):
            print(f"  {section} {name:56s} {s}")
        else:
            print(f"  {section} {name:56s} {s * 1e6:9.1f} us {flops / s / 1e12:7.1f} TFLOP/s  {base / s:5.2f}x "
                  f"{base_name}{THREE if three else ''}{what}")


#: the crossover grid (d_model 512..4096, FFN 4x, 4096..16384 tokens), M x K x N
CROSSOVER_M, CROSSOVER_KN = (4096, 8192, 16384), (512, 1024, 2048, 4096, 8192, 14336)


def crossover(args) -> None:
    """The crossover table of ``jax_fp8.gemm.crossover``: per shape of a grid, a linear layer's forward +
    backward (quantization included) in bf16 and on ``fp8_dot_general`` (this GPU's GEMM table in use),
    side by side, 3 layers per jitted call (one per call, the small layers' times were JAX's dispatch:
    on the H100 a 4096x512x512 layer took 81 us in bf16); prints each ratio (bf16 time / FP8 time) and
    writes the rows (--crossover-out)."""
    from jax_fp8.gemm import crossover as X

    ms = [int(v) for v in args.grid_m.split(",")]
    kns = [int(v) for v in args.grid_kn.split(",")]
    kind = jax.devices()[0].device_kind
    rows, out = [], {"device_kind": kind, "rows": {"blockwise": []}, "iters": args.iters, "layers_per_call": 3,
                     "command": " ".join(sys.argv)}

    bf16, ours = step(lambda x, w, d: lax.dot_general(x, w, d)), step(lambda x, w, d: jf.fp8_dot_general(x, w, d))
    for M in ms:
        for K in kns:
            for N in kns:
                if max(K, N) > 4 * min(K, N):  # the model's projections: d x d, d x 4d, 4d x d (about)
                    continue
                xs, ws, dys = inputs(M, K, N)
                sets = list(zip(xs, ws, dys))
                tb, to = all_in_one_call(bf16, sets, args.iters), all_in_one_call(ours, sets, args.iters)
                rows.append([[M, K, N], round(tb / to, 4)])
                print(f"  CROSSOVER {M}x{K}x{N}  bf16 {tb * 1e6:9.1f} us  fp8 {to * 1e6:9.1f} us  "
                      f"bf16/fp8 {tb / to:5.3f} {'FP8 pays' if tb > to else 'bf16 kept'}", flush=True)
                out["rows"]["blockwise"] = rows
                if args.crossover_out:  # written as it goes: the machine may be taken back
                    with open(args.crossover_out, "w") as f:
                        json.dump(out, f, indent=1)
    X.load(out)
    print(f"crossover rows for {kind}: {len(rows)}, FP8 pays at {sum(r[1] > 1 for r in rows)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--iters", type=int, default=30, help="calls per timed run (5 runs, median)")
    ap.add_argument("--table", default=None, help="bench_gemm_tune.py's JSON: loaded into gemm_table.TABLE")
    ap.add_argument("--no-linear", action="store_true", help="GEMMs alone only")
    ap.add_argument("--crossover", action="store_true",
                    help="measure the crossover table (jax_fp8.gemm.crossover) instead: a linear layer bf16 vs FP8 on a grid")
    ap.add_argument("--crossover-out", default=None, help="write the crossover rows to this JSON (crossover.load)")
    ap.add_argument("--grid-m", default=",".join(map(str, CROSSOVER_M)), help="--crossover: the M values")
    ap.add_argument("--grid-kn", default=",".join(map(str, CROSSOVER_KN)), help="--crossover: the K and N values")
    args = ap.parse_args()
    warnings.simplefilter("always", jf.Fp8GemmFallbackWarning)
    kind = jax.devices()[0].device_kind
    print(f"backend={jax.default_backend()} device={kind} jax={jax.__version__} "
          f"cuBLASLt={cublaslt.cublaslt()} fp8 GEMM on CUDA unavailable because: {cublaslt.unavailable()}")
    best_per_backend = {}
    if args.table:
        gemm_table.load(args.table)
        with open(args.table) as f:
            data = json.load(f)
        best_per_backend = data.get("best_per_backend", {}) if data.get("device_kind") == kind else {}
        print(f"table {args.table}: device {data.get('device_kind')}, rows "
              f"{ {p: len(r) for p, r in data.get('rows', {}).items()} }"
              + ("" if data.get("device_kind") == kind else f" (not this device: {kind}, unused)"))
    print(f"GEMM table rows for {kind}: { {p: len(r) for p, r in gemm_table.TABLE.get(kind, {}).items()} or 'none'}; "
          f"CUTLASS: {CUTLASS_MISSING if CUTLASS is None else CUTLASS.unavailable('cuda') or 'runs here'}")
    if args.crossover:
        return crossover(args)
    gpu = jax.default_backend() == "gpu"
    for shape in args.shapes.split(","):
        M, K, N = map(int, shape.split("x"))
        flops = 2 * M * K * N
        xs, ws, dys = inputs(M, K, N)
        print(f"\n== M={M} K={K} N={N}", flush=True)
        for role, pair, a_hi, b_hi in gemm_problems(xs, ws, dys):
            (Mg, Kg), Ng = a_hi[0].shape, b_hi[0].shape[0]
            t = gemm_alone(pair, a_hi, b_hi, args.iters, best_per_backend)
            if gpu:
                t["torch scaled_mm blockwise"] = torch_blockwise(Mg, Kg, Ng, pair == "1D2D", args.iters)
                t["torch scaled_mm per-tensor"] = torch_per_tensor(Mg, Kg, Ng, False, args.iters)
                t["torch scaled_mm per-tensor fast-accum"] = torch_per_tensor(Mg, Kg, Ng, True, args.iters)
            show(f"GEMM {role} {pair} {Mg}x{Ng}x{Kg}", t, flops)
            theirs = t.get("torch scaled_mm blockwise")
            if isinstance(theirs, float):
                mine = f"ours heuristic {CUBLASLT!r}"
                print(f"  GEMM {role} {pair} {Mg}x{Ng}x{Kg} {mine} / torch blockwise: {t[mine] / theirs:.3f} "
                      f"(time ratio; {t[mine + THREE] / theirs:.3f} with 3 per call)")
            del t
        sys.stdout.flush()
        if not args.no_linear:
            show("LINEAR", linear_fwd_bwd(xs, ws, dys, args.iters), 3 * flops, what=" (fwd+bwd)")
        sys.stdout.flush()
    print("\nmean relative error per token vs fp64, x (2048, 4096) with token scales 10^U(-5, 0) and 16 outlier "
          "channels (x20), W (4096, 2048):")
    for name, e in outlier_error().items():
        print(f"  {name:22s} {e:.3e}")


if __name__ == "__main__":
    main()
