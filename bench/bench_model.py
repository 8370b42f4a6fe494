"""End-to-end training step of a Llama-style decoder: FP8 blockwise (jax_fp8.fp8_dot_general) vs bf16 vs
flax's per-tensor FP8 (nn.Fp8DirectDotGeneralOp), in one run with one timing harness.

The model is ``examples/_transformer.py`` (every projection an ``nn.Dense`` whose ``dot_general`` is the
only difference between the variants), fp32 master weights, bf16 activations, optax AdamW with global
norm clipping. Each variant starts from the same parameters and trains ``--steps`` steps on the same
batches (next-token prediction on a fixed random Markov chain; fresh data every step). The step is one
jitted function: forward, backward and optimizer update, state donated.

Timing: after ``--untimed`` steps (the first compiles), the remaining steps run in groups of
``--dispatch`` back-to-back dispatches followed by one ``block_until_ready``; the step time is the median
over groups of (group time / group size). The loss is the mean over the last ``--loss-window`` steps.

  python bench/bench_model.py                      # H200 sizes: d_model 4096, FFN 14336, seq 4096, 2 layers
  python bench/bench_model.py --tiny               # seconds on a CPU (a smoke test; CPU times mean nothing)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _transformer as T  # noqa: E402

import jax_fp8 as jf  # noqa: E402

TINY = dict(d_model=128, ffn=384, heads=4, layers=2, seq=128, batch=4, vocab=256, steps=20, untimed=3, dispatch=4,
            loss_window=4)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke test (overrides the size flags)")
    T.add_model_flags(ap, d_model=4096, ffn=14336, heads=32, layers=2, seq=4096, batch=2,
                      vocab=1024, variants=",".join(T.VARIANTS))  # a small vocab: the blocks' projections dominate
    ap.add_argument("--steps", type=int, default=300, help="training steps per variant (loss after them)")
    ap.add_argument("--untimed", type=int, default=5, help="untimed steps first (the first compiles)")
    ap.add_argument("--dispatch", type=int, default=10, help="steps dispatched per block_until_ready")
    ap.add_argument("--loss-window", type=int, default=20, help="the final loss is the mean of this many steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    if not 1 <= args.untimed < args.steps:
        ap.error(f"--untimed must be in [1, --steps), got {args.untimed} with --steps {args.steps}")
    T.check_model_flags(ap, args, positive=("steps", "dispatch", "loss_window"))
    return args


def run_variant(args, variant: str, params, batches: list) -> dict:
    """Trains one variant ``args.steps`` steps; returns its step times, losses and diagnostics."""
    cfg = args.cfg
    state = T.init_state(cfg, variant, jax.tree_util.tree_map(jnp.array, params), T.optimizer(args.lr))
    step = T.make_train_step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jf.gemm.Fp8GemmFallbackWarning)
        t0 = time.perf_counter()
        lowered = step.lower(state, batches[0])
        step = lowered.compile()  # the same executable for every step
        state, loss = step(state, batches[0])
        jax.block_until_ready(loss)
        compile_s = time.perf_counter() - t0
    losses = [loss]
    for i in range(1, args.untimed):
        state, loss = step(state, batches[i])
        losses.append(loss)
    jax.block_until_ready(state)
    group_s = []
    i = args.untimed
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
    del state
    fallbacks = sorted({str(w.message) for w in caught if issubclass(w.category, jf.gemm.Fp8GemmFallbackWarning)})
    return {"step_s": statistics.median(group_s), "groups": len(group_s), "losses": losses, "compile_s": compile_s,
            "fp8_gemm_calls": lowered.as_text().count("@jf_fp8_gemm"), "fallbacks": fallbacks}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = args.cfg
    out = lambda s="": print(s, flush=True)  # noqa: E731
    dev = jax.devices()[0]
    tokens = args.batch * cfg.seq
    proj_flops = 6 * tokens * (cfg.layers * (4 * cfg.d_model ** 2 + 3 * cfg.d_model * cfg.ffn) + cfg.vocab * cfg.d_model)
    out(f"jax {jax.__version__}, backend {jax.default_backend()} ({dev.device_kind}); jax_fp8 kernels "
        f"{jf.kernels_available()}")
    out(f"decoder: {cfg.layers} layers, d_model {cfg.d_model}, ffn {cfg.ffn}, {cfg.heads} heads, vocab {cfg.vocab}, "
        f"{cfg.n_params() / 1e6:.1f}M params ({args.param_dtype} masters, {args.dtype} activations, "
        f"{cfg.attention_impl()} attention); batch "
        f"{args.batch} x seq {cfg.seq} = {tokens} tokens/step; projection GEMMs {proj_flops / 1e12:.2f} TFLOP/step")
    out(f"{args.steps} steps per variant ({args.untimed} untimed, then groups of {args.dispatch} dispatches per sync, "
        f"median over groups); loss = mean of the last {args.loss_window} steps")
    params = T.init_params(cfg, args.seed)
    batch_arr = T.make_batches(cfg, args.batch, args.steps, seed=args.seed)
    batches = [batch_arr[i] for i in range(args.steps)]
    del batch_arr
    n_proj = 3 * (4 * cfg.layers + 1)  # fprop, dgrad, wgrad of every projection
    res = {}
    for v in args.variants:
        r = res[v] = run_variant(args, v, params, batches)
        line = (f"[{v:>8}] step {1e3 * r['step_s']:9.3f} ms  ({tokens / r['step_s']:,.0f} tokens/s, "
                f"projections {proj_flops / r['step_s'] / 1e12:.1f} TFLOP/s)  loss {r['losses'][0]:.4f} -> "
                f"{np.mean(r['losses'][-args.loss_window:]):.4f}  compile+first step {r['compile_s']:.1f} s")
        if v == "fp8":
            line += f"  jf_fp8_gemm custom calls: {r['fp8_gemm_calls']} ({n_proj} GEMMs in the model)"
        out(line)
        for msg in r["fallbacks"]:
            out(f"           fallback: {msg}")
    out()
    if "bf16" in res:
        b = res["bf16"]
        b_loss = np.mean(b["losses"][-args.loss_window:])
        for v, r in res.items():
            if v != "bf16":
                loss = np.mean(r["losses"][-args.loss_window:])
                out(f"{v} / bf16: step-time ratio {r['step_s'] / b['step_s']:.3f}   loss ratio {loss / b_loss:.4f}")
    marks = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
    out("loss at steps " + ", ".join(str(m + 1) for m in marks) + ":")
    for v, r in res.items():
        out(f"  {v:>8}: " + "  ".join(f"{r['losses'][m]:.4f}" for m in marks))
    if jax.default_backend() == "cpu":
        out("(CPU: the FP8 GEMM runs as its reference, fp32 products per block, inlined: no custom calls; these "
            "step times are no GPU's)")
    return res


if __name__ == "__main__":
    main()
