"""End-to-end training step of a Llama-style decoder: FP8 blockwise (jax_fp8.fp8_dot_general; fp8-auto: only
where it pays) vs bf16 vs flax's per-tensor FP8 (nn.Fp8DirectDotGeneralOp), in one run with one timing harness.

The model is ``examples/_transformer.py`` (every projection an ``nn.Dense`` whose ``dot_general`` is the
only difference between the variants), fp32 master weights, bf16 activations, optax AdamW with global
norm clipping. Each variant starts from the same parameters and trains ``--steps`` steps on the same
batches (next-token prediction on a fixed random Markov chain; fresh data every step). The step is one
jitted function: forward, backward and optimizer update, state donated.

Timing: after ``--untimed`` steps (the first compiles), and more untimed steps until ``--warmup-s`` seconds
of them have run on the device, at most half the steps (a short warm-up timed the first variant of a
process slow: on the H100, d_model 512's FP8 step at 1.65x bf16's after 5 untimed steps when it ran first,
0.99x when bf16 ran first; the cause was not measured), the remaining steps run in groups of
``--dispatch`` back-to-back dispatches followed by one ``block_until_ready``; the step time is the median
over groups of (group time / group size). The loss is the mean over the last ``--loss-window`` steps.

Several model sizes in one run: ``--configs DxFxL[xB],...`` (d_model x FFN x layers [x batch], heads
d_model / 128, the other sizes from their flags) or ``--configs widths``: 4096x14336x2x2, 2048x8192x4x2,
1024x4096x8x2, 512x2048x8x1 (seq 4096: 8192, 8192, 8192 and 4096 tokens per step). Every variant of a
config starts from the same parameters and trains on the same batches; memory is freed between variants
and configs; one summary table ends the run (step ms, ratio to bf16, loss ratio to bf16 per config).

``fp8-auto`` runs each projection in FP8 only where jax_fp8.gemm.crossover's table says it gains on this GPU
(``--crossover-table FILE``, as ``bench/bench_gemm.py --crossover-out`` writes it, is loaded first).

``--profile DIR``: after timing each config's variant, trace ``--profile-steps`` more steps with
``jax.profiler.trace(DIR/<config>/<variant>)``, save the compiled step's HLO text next to it
(``step.hlo.txt``) and print where the device time goes (``bench/step_profile.py``: FP8 GEMM fprop / dgrad
/ wgrad, our quantize kernels, XLA's data movement around our custom calls, bf16 and flax FP8 GEMMs,
attention, the rest).

  python bench/bench_model.py                      # H200 sizes: d_model 4096, FFN 14336, seq 4096, 2 layers
  python bench/bench_model.py --configs widths --profile /tmp/prof     # the four widths, profiled
  python bench/bench_model.py --tiny               # seconds on a CPU (a smoke test; CPU times mean nothing)
  python bench/bench_model.py --tiny --configs 128x384x2,64x192x2x2 --profile /tmp/prof
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
import _transformer as T  # noqa: E402
import step_profile  # noqa: E402

import jax_fp8 as jf  # noqa: E402
from jax_fp8.gemm import crossover  # noqa: E402
from jax_fp8.gemm import table as gemm_table  # noqa: E402
from jax_fp8.gemm.table import local_device_kind  # noqa: E402

TINY = dict(d_model=128, ffn=384, heads=4, layers=2, seq=128, batch=4, vocab=256, steps=20, untimed=3, dispatch=4,
            loss_window=4, warmup_s=0.0)
#: ``--configs widths``: (d_model, ffn, layers, batch) at seq 4096 (8192, 8192, 8192, 4096 tokens per step)
WIDTHS = ((4096, 14336, 2, 2), (2048, 8192, 4, 2), (1024, 4096, 8, 2), (512, 2048, 8, 1))
#: ... and with --tiny (seq 128): d_model and FFN / 32, the batch as TINY's
TINY_WIDTHS = ((128, 448, 2, 4), (64, 256, 4, 4), (32, 128, 8, 4), (16, 64, 8, 2))
HEAD_DIM, TINY_HEAD_DIM = 128, 32


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke test (overrides the size flags)")
    T.add_model_flags(ap, d_model=4096, ffn=14336, heads=32, layers=2, seq=4096, batch=2,
                      vocab=1024, variants=",".join(T.VARIANTS))  # a small vocab: the blocks' projections dominate
    ap.add_argument("--configs", metavar="DxFxL[xB],...|widths",
                    help="model sizes to run, each d_model x ffn x layers [x batch] (heads d_model/128; with --tiny "
                         f"d_model/{TINY_HEAD_DIM}), or 'widths': " + ", ".join("x".join(map(str, w)) for w in WIDTHS)
                         + " (seq from --seq); default: the one config of the size flags")
    ap.add_argument("--crossover-table", metavar="JSON",
                    help="jax_fp8.gemm.crossover.load() this table first (fp8-auto: where FP8 pays on this GPU)")
    ap.add_argument("--gemm-table", metavar="JSON",
                    help="jax_fp8.gemm.table.load() this kernel table first (bench_gemm_tune.py --out writes it)")
    ap.add_argument("--steps", type=int, default=300, help="training steps per variant (loss after them)")
    ap.add_argument("--untimed", type=int, default=5, help="untimed steps first (the first compiles)")
    ap.add_argument("--warmup-s", type=float, default=3.0,
                    help="after --untimed, more untimed steps until this many seconds of them ran (at most half "
                         "the steps)")
    ap.add_argument("--dispatch", type=int, default=10, help="steps dispatched per block_until_ready")
    ap.add_argument("--loss-window", type=int, default=20, help="the final loss is the mean of this many steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--profile", metavar="DIR",
                    help="after timing, trace --profile-steps steps of each config and variant into "
                         "DIR/<config>/<variant> (with the compiled HLO) and print where the device time goes")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps traced per variant with --profile")
    args = ap.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    if not 1 <= args.untimed < args.steps:
        ap.error(f"--untimed must be in [1, --steps), got {args.untimed} with --steps {args.steps}")
    T.check_model_flags(ap, args, positive=("steps", "dispatch", "loss_window", "profile_steps"))
    args.configs = parse_configs(ap, args)
    return args


def parse_configs(ap, args) -> list:
    """[(label, Config, batch)] of ``--configs`` (default: args.cfg and --batch alone)."""
    if not args.configs:
        c = args.cfg
        return [(config_label(c, args.batch), c, args.batch)]
    spec = args.configs.strip()
    if spec == "widths":
        sizes = TINY_WIDTHS if args.tiny else WIDTHS
    else:
        sizes = []
        for item in (t.strip() for t in spec.split(",") if t.strip()):
            if not re.fullmatch(r"\d+x\d+x\d+(x\d+)?", item):
                ap.error(f"--configs: {item!r} is not DxFxL or DxFxLxB (d_model x ffn x layers [x batch]) or 'widths'")
            v = [int(t) for t in item.split("x")]
            sizes.append((*v[:3], v[3] if len(v) == 4 else args.batch))
    head_dim = TINY_HEAD_DIM if args.tiny else HEAD_DIM
    out = []
    for d, f, layers, batch in sizes:
        if min(d, f, layers, batch) < 1:
            ap.error(f"--configs: sizes must be positive, got {d}x{f}x{layers}x{batch}")
        heads = max(1, d // head_dim)
        try:
            c = dataclasses.replace(args.cfg, d_model=d, ffn=f, layers=layers, heads=heads)
        except ValueError as e:
            ap.error(f"--configs {d}x{f}x{layers}: {e}")
        out.append((config_label(c, batch), c, batch))
    return out


def config_label(cfg, batch: int) -> str:
    """The directory-safe name of a config: d_model x ffn x layers x batch."""
    return f"{cfg.d_model}x{cfg.ffn}x{cfg.layers}x{batch}"


def run_variant(args, cfg, variant: str, params, batches: list, keep: bool = False) -> dict:
    """Trains one variant ``args.steps`` steps; returns its step times, losses and diagnostics (with
    ``keep``, also ``"live"``: the compiled step and the trained state, for :func:`profile_variant`)."""
    state = T.init_state(cfg, variant, jax.tree_util.tree_map(jnp.array, params), T.optimizer(args.lr))
    step = T.make_train_step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jf.Fp8GemmFallbackWarning)
        t0 = time.perf_counter()
        lowered = step.lower(state, batches[0])
        step = lowered.compile()  # the same executable for every step
        state, loss = step(state, batches[0])
        jax.block_until_ready(loss)
        compile_s = time.perf_counter() - t0
    losses = [loss]
    i, t_warm = 1, time.perf_counter()
    while i < args.untimed or (time.perf_counter() - t_warm < args.warmup_s and i < args.steps // 2):
        state, loss = step(state, batches[i])
        losses.append(loss)
        i += 1
        if i >= args.untimed:  # past --untimed, the warm-up counts device time: one step in flight
            jax.block_until_ready(loss)
    jax.block_until_ready(state)
    n_untimed = i
    group_s = []
    while i < args.steps:
        n = min(args.dispatch, args.steps - i)
        t0 = time.perf_counter()
        for _ in range(n):
            state, loss = step(state, batches[i])
            losses.append(loss)
            i += 1
        jax.block_until_ready(state)
        group_s.append((time.perf_counter() - t0) / n)
    losses = [float(l) for l in losses]
    fallbacks = sorted({str(w.message) for w in caught if issubclass(w.category, jf.Fp8GemmFallbackWarning)})
    res = {"step_s": statistics.median(group_s), "groups": len(group_s), "untimed": n_untimed, "losses": losses,
           "compile_s": compile_s,
           "fp8_gemm_calls": sum(lowered.as_text().count(f"@jf_{b}_gemm") for b in ("cublaslt", "cutlass")), "fallbacks": fallbacks, "profile": None}
    del lowered
    if keep:
        res["live"] = (step, state)
    del state, step
    return res


def profile_variant(args, variant, step, state, batches, profile_dir, step_ms, out):
    """Traces ``args.profile_steps`` steps into ``profile_dir`` (plus the compiled HLO text) and prints
    step_profile's table; returns its dict, or None. Never raises."""
    try:
        os.makedirs(profile_dir, exist_ok=True)
        hlo_text = step.as_text()
        with open(os.path.join(profile_dir, "step.hlo.txt"), "w") as f:
            f.write(hlo_text)
        jax.block_until_ready(state)
        with jax.profiler.trace(profile_dir):
            for k in range(args.profile_steps):
                state, loss = step(state, batches[k % len(batches)])
            jax.block_until_ready(state)
        del state
        return step_profile.report(profile_dir, hlo_text, steps=args.profile_steps, step_ms=step_ms,
                                   title=f"[{variant:>8}] ", out=out)
    except Exception as e:  # noqa: BLE001  (a failed profile must not end the benchmark)
        out(f"[{variant:>8}] profile failed: {e!r}")
        return None


def final_loss(args, r) -> float:
    return float(np.mean(r["losses"][-args.loss_window:]))


def run_config(args, label: str, cfg, batch: int, out) -> dict:
    """Every variant of one config, from the same parameters on the same batches."""
    tokens = batch * cfg.seq
    proj_flops = 6 * tokens * (cfg.layers * (4 * cfg.d_model ** 2 + 3 * cfg.d_model * cfg.ffn)
                               + cfg.vocab * cfg.d_model)
    out(f"== config {label}: decoder {cfg.layers} layers, d_model {cfg.d_model}, ffn {cfg.ffn}, {cfg.heads} heads, "
        f"vocab {cfg.vocab}, {cfg.n_params() / 1e6:.1f}M params ({args.param_dtype} masters, {args.dtype} activations, "
        f"{cfg.attention_impl()} attention); batch {batch} x seq {cfg.seq} = {tokens} tokens/step; projection "
        f"GEMMs {proj_flops / 1e12:.2f} TFLOP/step")
    params = T.init_params(cfg, args.seed)
    batch_arr = T.make_batches(cfg, batch, args.steps, seed=args.seed)
    batches = [batch_arr[i] for i in range(args.steps)]
    del batch_arr
    n_proj = 3 * (4 * cfg.layers + 1)  # fprop, dgrad, wgrad of every projection
    res = {}
    for v in args.variants:
        out(f"[{v:>8}] {label}: compiling and training {args.steps} steps ...")
        r = res[v] = run_variant(args, cfg, v, params, batches, keep=bool(args.profile))
        r["tokens"] = tokens
        line = (f"[{v:>8}] step {1e3 * r['step_s']:9.3f} ms  ({tokens / r['step_s']:,.0f} tokens/s, "
                f"projections {proj_flops / r['step_s'] / 1e12:.1f} TFLOP/s)  loss {r['losses'][0]:.4f} -> "
                f"{final_loss(args, r):.4f}  compile+first step {r['compile_s']:.1f} s")
        if v.startswith("fp8"):
            line += f"  FP8 GEMM custom calls: {r['fp8_gemm_calls']} ({n_proj} GEMMs in the model)"
        out(line)
        for msg in r["fallbacks"]:
            out(f"           fallback: {msg}")
        if "live" in r:
            step, state = r.pop("live")
            r["profile"] = profile_variant(args, v, step, state, batches, os.path.join(args.profile, label, v),
                                           1e3 * r["step_s"], out)
            del step, state
        gc.collect()
    del params, batches
    out()
    if "bf16" in res:
        b = res["bf16"]
        for v, r in res.items():
            if v != "bf16":
                out(f"{v} / bf16: step-time ratio {r['step_s'] / b['step_s']:.3f}   loss ratio "
                    f"{final_loss(args, r) / final_loss(args, b):.4f}")
    marks = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
    out("loss at steps " + ", ".join(str(m + 1) for m in marks) + ":")
    for v, r in res.items():
        out(f"  {v:>8}: " + "  ".join(f"{r['losses'][m]:.4f}" for m in marks))
    profiles = {v: r["profile"] for v, r in res.items() if r.get("profile")}
    if profiles:
        out(step_profile.compare_table(profiles, title=f"{label}: "))
    out()
    return res


def summary(args, results: dict) -> str:
    """One table: per config and variant, the step time, its ratio to bf16, the loss and its ratio."""
    rows = [f"summary ({args.steps} steps per variant; loss = mean of the last {args.loss_window}; ratios to bf16 "
            "of the same config):",
            f"  {'config (DxFxLxB)':<20} {'tokens':>7} {'variant':>9} {'step ms':>10} {'/bf16':>7} {'loss':>8} "
            f"{'loss/bf16':>9} {'fp8 GEMMs':>9}"]
    for label, res in results.items():
        b = res.get("bf16")
        for v, r in res.items():
            ratio = f"{r['step_s'] / b['step_s']:7.3f}" if b else f"{'-':>7}"
            lratio = f"{final_loss(args, r) / final_loss(args, b):9.4f}" if b else f"{'-':>9}"
            rows.append(f"  {label:<20} {r['tokens']:>7} {v:>9} {1e3 * r['step_s']:10.3f} {ratio} "
                        f"{final_loss(args, r):8.4f} {lratio} {r['fp8_gemm_calls']:>9}")
    return "\n".join(rows)


def main(argv=None) -> dict:
    """Runs every config; returns {variant: result} for one config (the default), else
    {config label: {variant: result}}."""
    args = parse_args(argv)
    out = lambda s="": print(s, flush=True)  # noqa: E731
    if args.gemm_table:
        gemm_table.load(args.gemm_table)
        out(f"GEMM kernel table {args.gemm_table} loaded")
    if args.crossover_table:
        crossover.load(args.crossover_table)
        out(f"crossover table {args.crossover_table} loaded (device kinds: {', '.join(sorted(crossover.TABLES))})")
    dev = jax.devices()[0]
    out(f"jax {jax.__version__}, backend {jax.default_backend()} ({dev.device_kind}); jax_fp8 kernels "
        f"{jf.kernels_available()}")
    if "fp8-auto" in args.variants:
        kind = local_device_kind()
        rows = crossover.TABLES.get(kind, {}).get(crossover.recipe_name(None))
        out("fp8-auto: " + (f"crossover table for {kind!r}: {len(rows)} measured shapes (FP8 where the nearest gained)"
                             if rows else f"no crossover table for {kind!r}: FP8 everywhere (as fp8); pass "
                             "--crossover-table"))
    out(f"{len(args.configs)} config(s) x variants {', '.join(args.variants)}; {args.steps} steps per variant "
        f"({args.untimed} untimed and more up to {args.warmup_s:g} s, then groups of {args.dispatch} dispatches per "
        f"sync, median over groups); loss = mean of the last {args.loss_window} steps"
        + (f"; profiles under {args.profile}" if args.profile else ""))
    results = {}
    for label, cfg, batch in args.configs:
        results[label] = run_config(args, label, cfg, batch, out)
        jax.clear_caches()
        gc.collect()
    out(summary(args, results))
    if jax.default_backend() == "cpu":
        out("(CPU: the FP8 GEMM runs as its reference, fp32 products per block, inlined: no custom calls; these "
            "step times are no GPU's)")
    return next(iter(results.values())) if len(results) == 1 else results


if __name__ == "__main__":
    main()
