"""Autotuner of the FP8 blockwise GEMM (``jf_fp8_gemm``): times every candidate kernel per problem and
writes the rows of :data:`jax_fp8.gemm.table.TABLE` (JSON for ``jax_fp8.gemm.table.load``, and a Python literal).

Problems, per linear-layer shape MxKxN (y = x·Wᵀ, x (M, K), W (N, K)):
  fprop, pair 1D2D: GEMM (M, N, K), a = x in 1x128 blocks, b = W in 128x128 tiles;
  wgrad, pair 1D1D: GEMM (N, K, M), dW = dyᵀ·x: a = dyᵀ, b = xᵀ, both 1x128 blocks along M.
Candidates, each run with ``jax_fp8.gemm.fp8_gemm(a, b, bfloat16, backend=...)`` on the same operands:
  cuBLASLt's heuristic (the reference of speed and numbers); cuBLASLt ``algo=0..15`` (the heuristic's
  i-th candidate; an index past the problem's list runs the heuristic's first, so times like it);
  CUTLASS (if built and runnable): every config with its default raster (0: CUTLASS's heuristic) and
  swizzle (1), then the --cutlass-top fastest configs at every --cutlass-rasters (1 along M, 2 along N)
  x --cutlass-swizzles (1, 4, 8) (--cutlass-search full: every config at every raster x swizzle).
A candidate whose output differs from the heuristic's by more than --tol (max |diff| / max |ref|) is
WRONG and never picked. The pick is the fastest correct candidate, unless it beats cuBLASLt's heuristic
by less than --min-gain (then the heuristic: no row churn on noise). A pick other than the heuristic is
then timed against it in turns (--confirm rounds, the order alternating) and kept only if its median
gain still reaches --min-gain: the clocks drift down over a problem's sweep (cuBLASLt's heuristic timed
again at the end ran 1-12% slower on H100s), and the fastest of many candidates is the luckiest.
Timing: bench/_timing.jax_time, 3 operand sets; --per-call 3 (default) runs the 3 sets' GEMMs in one
jitted call (time / 3), which keeps JAX's per-call dispatch out of small GEMMs' times; --per-call 1
rotates the sets over one-GEMM calls. Candidates are compiled ahead, --compile-threads at a time.
The JSON (--out) is rewritten after every problem; --resume keeps its problems and tunes the rest;
--max-seconds stops the run (between candidates) and keeps what was measured.

  python bench/bench_gemm_tune.py [--shapes 8192x8192x8192,...] [--pairs 1D2D,1D1D] [--iters 20]
      [--no-cutlass | --cutlass-swizzles 1,4,8 --cutlass-rasters 1,2 --cutlass-search staged|full]
      [--max-seconds 480] [--out gemm_table.json] [--resume]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

import jax_fp8 as jf
from _timing import in_turns, jax_time
from jax_fp8 import gemm as G
from jax_fp8.gemm.backends import cublaslt
from jax_fp8.gemm.backends.cublaslt import CANDIDATES, CUBLASLT

try:
    from jax_fp8.gemm.backends.cutlass import CONFIGS, CUTLASS
    CUTLASS_MISSING = None
except ImportError as e:  # being written: tune cuBLASLt alone
    CUTLASS, CONFIGS, CUTLASS_MISSING = None, (), f"jax_fp8.gemm.backends.cutlass: {e}"

SHAPES = ("2048x2048x2048,4096x4096x4096,8192x8192x8192,16384x4096x4096,16384x4096x14336,16384x14336x4096,"
          "16384x512x4096")  # MxKxN
PAIRS = {"1D2D": ((1, 128), (128, 128)), "1D1D": ((1, 128), (1, 128))}
T0 = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def problems(shapes: str, pairs: list) -> list:
    """(pair, (M, N, K) of the GEMM, label) per shape and pair, without repeats."""
    out = []
    for shape in shapes.split(","):
        M, K, N = map(int, shape.lower().split("x"))
        for p in pairs:
            mnk, role = ((M, N, K), "fprop") if p == "1D2D" else ((N, K, M), "wgrad")
            if (p, mnk) not in [(q, m) for q, m, _ in out]:
                out.append((p, mnk, f"{role} of {shape}"))
    return out


def operands(M, N, K, a_block, b_block, n=3):
    """n sets (a (M, K), b (N, K)) of GEMM operands, quantized GEMM-ready."""
    keys = jax.random.split(jax.random.key(M * 7 + N * 3 + K + a_block[0] + b_block[0]), 2 * n)
    sets = []
    for i in range(n):
        a = jf.quantize_blockwise(jax.random.normal(keys[2 * i], (M, K), jnp.bfloat16), block=a_block,
                                  layout="gemm_ready")
        b = jf.quantize_blockwise(jax.random.normal(keys[2 * i + 1], (N, K), jnp.bfloat16), block=b_block,
                                  layout="gemm_ready")
        sets.append((G.gemm_operand(a), G.gemm_operand(b)))
    return jax.block_until_ready(sets)


@jax.jit
def rel_err(outs, refs):
    """max |out - ref| / max |ref| over all outputs (fp32)."""
    d = jnp.stack([jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))) for o, r in zip(outs, refs)])
    return jnp.max(d) / jnp.max(jnp.stack([jnp.max(jnp.abs(r.astype(jnp.float32))) for r in refs]))


class Candidate:
    def __init__(self, backend):
        self.backend, self.name = backend, repr(backend)
        self.fn = lambda *sets: [G.fp8_gemm(a, b, jnp.bfloat16, backend=backend) for a, b in sets]
        self.error = self.us = self.err = None
        self.wrong = False

    @property
    def ok(self) -> bool:
        """Ran, and matched the reference (within --tol)."""
        return self.us is not None and self.error is None and not self.wrong

    def record(self) -> list:
        return [self.name, None if self.us is None else round(self.us, 2), self.status()]

    def status(self) -> str:
        if self.error is not None:
            return f"failed: {self.error}"
        if self.us is None:
            return "not run"
        return "ok" if self.ok else f"WRONG (err {self.err:.2e})"


def short(e: BaseException) -> str:
    lines = [s for s in str(e).splitlines() if s.strip()]
    hit = next((s for s in lines if "offers" in s), lines[0] if lines else "")
    return f"{type(e).__name__}: {hit.strip()[:160]}"


class Tuner:
    def __init__(self, args, gpu: bool):
        self.args, self.gpu = args, gpu
        self.deadline = T0 + args.max_seconds if args.max_seconds > 0 else float("inf")
        self.stopped = False

    def out_of_time(self) -> bool:
        if not self.stopped and time.perf_counter() > self.deadline:
            self.stopped = True
            say(f"--max-seconds {self.args.max_seconds} reached: stopping, keeping what was measured")
        return self.stopped

    def compile(self, cands, group):
        """Compiles the candidates ahead (the jit cache then serves jax_time); a failure is kept."""
        def one(c):
            try:
                jax.jit(c.fn).lower(*group).compile()
            except Exception as e:  # noqa: BLE001 - any failure skips the candidate
                c.error = short(e)
        todo = [c for c in cands if c.error is None]
        if self.args.compile_threads > 1:
            with ThreadPoolExecutor(self.args.compile_threads) as ex:
                list(ex.map(one, todo))
        else:
            for c in todo:
                one(c)

    def batch(self, backends, done, groups, ref, flops) -> bool:
        """Compiles, checks and times the backends not yet in ``done`` (appended); False when out of time."""
        seen = {c.backend for c in done}
        cands = [Candidate(b) for b in dict.fromkeys(backends) if b not in seen]
        if self.out_of_time():
            return False
        self.compile(cands, groups[0])
        for c in cands:
            if self.out_of_time():
                return False
            self.measure(c, groups, ref, flops, done[0].us)
            done.append(c)
        return True

    def measure(self, c, groups, ref, flops, base_us):
        """Checks then times one candidate; prints its line. Returns the outputs (for the reference)."""
        outs = None
        if c.error is None:
            try:
                outs = jax.block_until_ready(jax.jit(c.fn)(*groups[0]))
                c.err = 0.0 if ref is None else float(rel_err(outs, ref))
                c.wrong = not c.err <= self.args.tol  # NaN: wrong
                c.us = self.us(c)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is reported, never picked
                c.error, c.us = short(e), None
        if c.us is None:
            say(f"  {c.name:44s} {c.status()}")
        else:
            x = base_us / c.us if base_us else 1.0
            flag = "" if c.ok else f"  WRONG err={c.err:.2e}"
            say(f"  {c.name:44s} {c.us:9.1f} us {flops / c.us / 1e6:7.1f} TFLOP/s {x:6.3f}x{flag}")
        return outs

    def tune(self, pair, M, N, K):
        a_block, b_block = PAIRS[pair]
        args, flops = self.args, 2 * M * N * K
        sets = operands(M, N, K, a_block, b_block)
        groups = [tuple(sets)] if args.per_call == 3 else [(s,) for s in sets]
        self.groups = groups  # what us() times
        fp8 = jnp.dtype(jnp.float8_e4m3fn)

        def takes(backend) -> bool:
            padded, why = backend.sizes(M, N, K, a_block, b_block, fp8, fp8)
            if why is None and tuple(padded) == (M, N, K):
                return True
            say(f"  {backend.name} skipped: {why or f'needs padding to {padded}'}")
            return False

        heur = Candidate(CUBLASLT)
        algos = [Candidate(CUBLASLT.with_options(algo=i)) for i in range(min(args.cublaslt_algos, CANDIDATES))]
        if not takes(CUBLASLT):
            return []
        self.compile([heur] + algos, groups[0])
        ref = self.measure(heur, groups, None, flops, None)
        if ref is None or not heur.ok:
            say("  cuBLASLt's heuristic failed: no reference, problem skipped")
            return [heur]
        done = [heur]
        for c in algos:
            if self.out_of_time():
                return done
            self.measure(c, groups, ref, flops, heur.us)
            done.append(c)
        if self.use_cutlass and takes(CUTLASS):
            self.cutlass(done, groups, ref, flops)
        if not self.out_of_time():  # the heuristic again, last: the first run may have met cold clocks
            again = Candidate(CUBLASLT)
            again.name = "cublaslt (again)"
            self.measure(again, groups, ref, flops, heur.us)
            if again.ok:
                heur.us = min(heur.us, again.us)
        return done

    def us(self, c) -> float:
        """Microseconds per GEMM of candidate ``c`` on the operand groups of the problem being tuned."""
        return jax_time(c.fn, self.groups, self.args.iters, self.args.reps) / len(self.groups[0]) * 1e6

    def confirm(self, pick, heur):
        """``pick`` against the heuristic ``heur`` timed in turns (--confirm rounds, each round's order the
        other way round, so a drift of the clocks favours neither): ``pick`` if its median gain reaches
        --min-gain, else ``heur``; both take their median times of these rounds."""
        rounds = self.args.confirm
        if pick is heur or rounds <= 0 or self.out_of_time():
            return pick
        t_heur, t_pick = in_turns(self.us, heur, pick, rounds)
        gains = [h / p for h, p in zip(t_heur, t_pick)]
        gain = statistics.median(gains)
        heur.us, pick.us = statistics.median(t_heur), statistics.median(t_pick)
        kept = gain >= 1 + self.args.min_gain
        say(f"  confirm {pick.name} against cuBLASLt's heuristic in turns: "
            + ", ".join(f"{g:.3f}x" for g in gains) + f"; median {gain:.3f}x: " + ("kept" if kept else "the heuristic"))
        return pick if kept else heur

    def cutlass(self, done, groups, ref, flops):
        """CUTLASS's candidates: each config with its default raster / swizzle, then the --cutlass-top
        fastest configs at every --cutlass-rasters x --cutlass-swizzles (full: every config)."""
        args = self.args
        rasters, swizzles, configs = args.cutlass_rasters, args.cutlass_swizzles, self.cutlass_configs
        grid = lambda cfgs, rs, ss: [CUTLASS.with_options(config=i, raster=r, swizzle=s)
                                     for i in cfgs for r in rs for s in ss]
        first = [CUTLASS.with_options(config=i) for i in configs]  # the other options at their defaults
        if args.cutlass_search == "full":
            self.batch(first + grid(configs, rasters, swizzles), done, groups, ref, flops)
        elif self.batch(first, done, groups, ref, flops):
            ranked = sorted((c for c in done if c.ok and c.backend.name == CUTLASS.name), key=lambda c: c.us)
            top = list(dict.fromkeys(dict(c.backend.options)["config"] for c in ranked))[:args.cutlass_top]
            self.batch(grid(top, rasters, swizzles), done, groups, ref, flops)

    def pick(self, done):
        """(the table's pick, {backend name: its fastest correct candidate}); the heuristic unless a
        candidate beats it by --min-gain."""
        heur = done[0]
        best = {}
        for c in done:
            if c.ok and (c.backend.name not in best or c.us < best[c.backend.name].us):
                best[c.backend.name] = c
        fastest = min(best.values(), key=lambda c: c.us)
        lt = best.get(CUBLASLT.name)
        if lt is not None and lt is not heur and lt.us * (1 + self.args.min_gain) > heur.us:
            best[CUBLASLT.name] = heur
        return (fastest if fastest.us * (1 + self.args.min_gain) <= heur.us else heur), best


def options_of(backend) -> dict:
    return {k: int(v) for k, v in backend.options}


def write_json(path, data):
    """``data`` as JSON, one row per line; atomically (the machine may go away mid-run)."""
    def rows(v):
        if not isinstance(v, dict) or not all(isinstance(r, list) for r in v.values()):
            return json.dumps(v)
        return "{" + ",".join(f"\n  {json.dumps(p)}: [" + ",".join(f"\n   {json.dumps(r)}" for r in rs) + "]"
                              for p, rs in v.items()) + "}"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("{" + ",".join(f"\n {json.dumps(k)}: {rows(v)}" for k, v in data.items()) + "\n}\n")
    os.replace(tmp, path)


def table_literal(kind: str, data: dict) -> str:
    """The rows as an entry of gemm_table.TABLE, ready to paste."""
    lines = [f"    {kind!r}: {{  # bench/bench_gemm_tune.py, {data.get('created', '')}, jax {data.get('jax')}, "
             f"cuBLASLt {data.get('cublaslt')}"]
    for p, rows in data["rows"].items():
        speed = {tuple(m): (r, s) for m, r, s in data.get("speedup", {}).get(p, [])}
        lines.append(f"        {p!r}: [")
        for mnk, name, opts in rows:
            note = speed.get(tuple(mnk))
            note = f"  # {note[0]:.3f}x cuBLASLt heuristic, {note[1]:.1f} us" if note else ""
            lines.append(f"            ({tuple(mnk)!r}, {name!r}, {opts!r}),{note}")
        lines.append("        ],")
    lines.append("    },")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()]
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN of linear layers (y = x·Wᵀ)")
    ap.add_argument("--pairs", default="1D2D,1D1D", help="1D2D (fprop (M, N, K)) and/or 1D1D (wgrad (N, K, M))")
    ap.add_argument("--iters", type=int, default=20, help="jitted calls per timed run (jax_time)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per candidate (median)")
    ap.add_argument("--per-call", type=int, choices=(1, 3), default=3,
                    help="GEMMs per jitted call: 3 (the 3 operand sets in one call) or 1 (rotating sets)")
    ap.add_argument("--cublaslt-algos", type=int, default=CANDIDATES, help="cuBLASLt algo indices to try (0: none)")
    ap.add_argument("--no-cutlass", action="store_true")
    ap.add_argument("--cutlass-configs", type=ints, default=None, help="config indices (default: all of CONFIGS)")
    ap.add_argument("--cutlass-rasters", type=ints, default=[1, 2],
                    help="0 CUTLASS's heuristic (the default: one of the others), 1 along M, 2 along N")
    ap.add_argument("--cutlass-swizzles", type=ints, default=[1, 4, 8])
    ap.add_argument("--cutlass-search", choices=("staged", "full"), default="staged",
                    help="staged: each config at its defaults, then the --cutlass-top configs at every "
                         "raster x swizzle; full: every config at every raster x swizzle")
    ap.add_argument("--cutlass-top", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-2, help="max |diff| / max |ref| vs cuBLASLt's heuristic")
    ap.add_argument("--min-gain", type=float, default=0.01, help="pick over the heuristic only if this much faster")
    ap.add_argument("--confirm", type=int, default=3,
                    help="rounds of the pick against the heuristic in turns before it is kept (0: none)")
    ap.add_argument("--max-seconds", type=float, default=480, help="stop after this long (0: no limit)")
    ap.add_argument("--compile-threads", type=int, default=8)
    ap.add_argument("--out", default="gemm_table.json")
    ap.add_argument("--resume", action="store_true", help="keep the problems --out already has")
    args = ap.parse_args()
    pairs = [p.strip().upper() for p in args.pairs.split(",") if p.strip()]
    if any(p not in PAIRS for p in pairs):
        ap.error(f"--pairs: each of {', '.join(PAIRS)}")

    gpu = jax.default_backend() == "gpu"
    kind = jax.devices()[0].device_kind
    version = cublaslt.cublaslt()[0]
    say(f"backend={jax.default_backend()} device={kind} jax={jax.__version__} cuBLASLt={cublaslt.cublaslt()}")
    why = CUBLASLT.unavailable("cuda")
    if why is not None:
        if gpu:
            say(f"cuBLASLt cannot run here: {why}")
            sys.exit(2)
        say(f"dry run: cuBLASLt unavailable ({why}); every candidate computes the reference math")
        warnings.simplefilter("ignore", jf.Fp8GemmFallbackWarning)
    tuner = Tuner(args, gpu)
    tuner.use_cutlass = False
    if args.no_cutlass:
        say("CUTLASS: off (--no-cutlass)")
    elif CUTLASS is None:
        say(f"CUTLASS: skipped, module missing ({CUTLASS_MISSING})")
    elif gpu and CUTLASS.unavailable("cuda") is not None:
        say(f"CUTLASS: skipped, cannot run here: {CUTLASS.unavailable('cuda')}")
    else:
        tuner.use_cutlass = True
        tuner.cutlass_configs = [i for i in (args.cutlass_configs or range(len(CONFIGS))) if 0 <= i < len(CONFIGS)]
        say(f"CUTLASS: {len(CONFIGS)} configs {list(CONFIGS)}; trying {tuner.cutlass_configs} x raster "
            f"{args.cutlass_rasters} x swizzle {args.cutlass_swizzles} ({args.cutlass_search})")

    data = {"device_kind": kind, "jax": jax.__version__, "cublaslt": version,
            "created": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args),
            "rows": {}, "best_per_backend": {}, "speedup": {}, "candidates": {}, "partial": []}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if old.get("device_kind") == kind:
            for key in ("rows", "best_per_backend", "speedup", "candidates", "partial"):
                data[key] = old.get(key, data[key])
            say(f"--resume: {sum(map(len, data['rows'].values()))} problems kept from {args.out} "
                f"({len(data['partial'])} partial, tuned again)")
    partial = {(p, tuple(m)) for p, m in data["partial"]}
    have = {(p, tuple(r[0])) for p, rows in data["rows"].items() for r in rows} - partial

    todo = [t for t in problems(args.shapes, pairs) if (t[0], t[1]) not in have]
    for i, (pair, (M, N, K), label) in enumerate(todo):
        if tuner.out_of_time():
            break
        say(f"== [{i + 1}/{len(todo)}] {pair} M={M} N={N} K={K} ({label})")
        done = tuner.tune(pair, M, N, K)
        if not done or not done[0].ok:
            continue
        pick, best = tuner.pick(done)
        heur = done[0]
        pick = tuner.confirm(pick, heur)
        say(f"  -> pick {pick.name}: {pick.us:.1f} us, {heur.us / pick.us:.3f}x cuBLASLt heuristic; best per backend: "
            + ", ".join(f"{c.name} {c.us:.1f} us" for c in best.values())
            + ("  (partial: --max-seconds)" if tuner.stopped else ""))
        mnk = [M, N, K]
        key = lambda r: tuple(r[0])
        for field, entry in (("rows", [[mnk, pick.backend.name, options_of(pick.backend)]]),
                             ("best_per_backend", [[mnk, c.backend.name, options_of(c.backend), round(c.us, 2)]
                                                   for c in best.values()]),
                             ("speedup", [[mnk, round(heur.us / pick.us, 4), round(pick.us, 2)]]),
                             ("candidates", [[mnk, [c.record() for c in done]]])):
            rows = [r for r in data[field].get(pair, []) if key(r) != tuple(mnk)] + entry
            data[field][pair] = sorted(rows, key=key)
        data["partial"] = [x for x in data["partial"] if (x[0], tuple(x[1])) != (pair, (M, N, K))]
        data["partial"] += [[pair, mnk]] * tuner.stopped
        write_json(args.out, data)
        say(f"  wrote {args.out}")

    n = sum(map(len, data["rows"].values()))
    say(f"done: {n} problems in {args.out}" + (" (stopped early by --max-seconds)" if tuner.stopped else ""))
    if n:
        print("\n# gemm_table.TABLE entry (jax_fp8/gemm/table.py), or gemm_table.load(" + repr(args.out) + "):")
        print(table_literal(kind, data), flush=True)


if __name__ == "__main__":
    main()
