"""Train a small Llama-style decoder with every projection on the FP8 GEMM, next to the same model in bf16.

The model (``examples/_transformer.py``) is a flax.linen decoder whose projections are
``nn.Dense(dot_general=jax_fp8.fp8_dot_general)``: Float8 blockwise operands (1x128 activations and
gradients, 128x128 weights) in the forward and both backward GEMMs, fp32 master weights, bf16
activations, attention through ``jax.nn.dot_product_attention`` in bf16. Both runs start from the same
parameters and see the same batches (next-token prediction on a fixed random Markov chain).

Prints one line per logged step (plain text, flushed: readable in a log file), then the final losses
and their ratio, and the median step times and their ratio. On the CPU the FP8 GEMM runs as its
reference (fp32 products of each 128-wide block, scaled), so the CPU's step-time ratio says nothing about a GPU's.

  python examples/train_transformer.py [--steps 60] [--d-model 128 --ffn 384 --heads 4 --layers 2]
                                       [--seq 128 --batch 8] [--plot losses.png]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _transformer as T  # noqa: E402



def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="A Llama-style decoder trained with FP8 GEMMs (jax_fp8.fp8_dot_general) "
                                 "next to the same model in bf16.")
    ap.add_argument("--steps", type=int, default=60)
    T.add_model_flags(ap, d_model=128, ffn=384, heads=4, layers=2, seq=128, batch=8, vocab=256, variants="fp8,bf16")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10, help="linear learning-rate warmup steps")
    ap.add_argument("--log-every", type=int, default=10, help="print every N steps (and the first and last)")
    ap.add_argument("--plot", metavar="PNG", help="draw the loss curves into this file (needs matplotlib)")
    args = ap.parse_args(argv)
    T.check_model_flags(ap, args, positive=("steps", "log_every"))
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before training, used after it)
        except ImportError:
            ap.error("--plot needs matplotlib: pip install matplotlib")
    return args


def plot(path: str, curves: dict) -> None:
    """Loss per step of every variant, one line each."""
    import matplotlib  # only here: plotting is optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross entropy, nats)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    """Runs the comparison; returns ``{variant: (losses, step_seconds)}``."""
    args = parse_args(argv)
    cfg = args.cfg
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); decoder: {cfg.layers} layers, d_model "
        f"{cfg.d_model}, ffn {cfg.ffn}, {cfg.heads} heads, vocab {cfg.vocab}, {cfg.n_params() / 1e6:.2f}M params "
        f"({args.param_dtype} masters, {args.dtype} activations); batch {args.batch} x seq {cfg.seq}; {args.steps} steps")
    params = T.init_params(cfg, args.seed)
    batches = T.make_batches(cfg, args.batch, args.steps, seed=args.seed)  # fresh data every step
    log(f"data: Markov chain over {cfg.vocab} tokens, entropy {T.chain_entropy(T.markov_chain(cfg.vocab, args.seed)):.4f} "
        f"nats (the lowest reachable loss); uniform guess {jnp.log(cfg.vocab):.4f}")
    results = {}
    t0 = time.perf_counter()
    for v in args.variants:
        results[v] = T.train(cfg, v, params, batches, args.steps, T.optimizer(args.lr, args.warmup), log, args.log_every)
    tail = max(1, args.steps // 10)
    final = {v: sum(l[-tail:]) / tail for v, (l, _) in results.items()}
    # median over the steps after the first (which compiles)
    step_ms = {v: 1e3 * statistics.median(t[1:] if len(t) > 1 else t) for v, (_, t) in results.items()}
    log(f"final loss (mean of the last {tail} steps): " + "   ".join(f"{v} {final[v]:.4f}" for v in results))
    log("step time (median after the first step): " + "   ".join(f"{v} {step_ms[v]:.2f} ms" for v in results))
    base = "bf16" if "bf16" in results else None
    for v in results:
        if base and v != base:
            log(f"{v} / bf16: loss ratio {final[v] / final[base]:.4f}   step-time ratio {step_ms[v] / step_ms[base]:.3f}")
    if jax.default_backend() == "cpu" and "fp8" in results:
        log("(on the CPU the FP8 GEMM is computed by its reference, fp32 products per block: the step-time ratio "
            "measures that, not an FP8 GEMM)")
    log(f"total {time.perf_counter() - t0:.1f} s")
    if args.plot:
        plot(args.plot, {v: l for v, (l, _) in results.items()})
        log(f"loss curves written to {args.plot}")
    return results


if __name__ == "__main__":
    main()
