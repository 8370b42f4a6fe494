"""Train a small Llama-style decoder with every projection on the FP8 GEMM, next to the same model in bf16.

The model (``examples/_transformer.py``) is a flax.linen decoder whose projections are
``nn.Dense(dot_general=jax_fp8.fp8_dot_general)``: Float8 blockwise operands (1x128 activations and
gradients, 128x128 weights) in the forward and both backward GEMMs, fp32 master weights, bf16
activations, attention through ``jax.nn.dot_product_attention`` in bf16. Both runs start from the same
parameters and see the same batches (next-token prediction on a fixed random Markov chain).

Prints one line per logged step (plain text, flushed: readable in a log file), then the final losses
and their ratio, and the median step times and their ratio. On the CPU the FP8 GEMM runs as its
reference (fp32 products of each 128-wide block, scaled), so the CPU's step-time ratio says nothing about a GPU's.

With ``--mesh data=4,fsdp=2`` (axis=size pairs, axes "data" and/or "fsdp") both variants train on a
device mesh under plain ``jax.jit``, NamedSharding annotations only (no shard_map): the batch's
sequences split over ("data", "fsdp"), every parameter matrix FSDP-style along one dim over "fsdp"
(a dim whose shards hold whole 128x128 FP8 tiles; a matrix without one, and the 1-D params, replicated),
the optimizer state as its parameters. The end adds each variant's compiled step: per-device memory
and the all-gathers / all-reduces in its HLO. On the CPU the script asks XLA for as many simulated
devices as the mesh has when XLA_FLAGS does not set --xla_force_host_platform_device_count.

  python examples/train_transformer.py [--steps 60] [--d-model 128 --ffn 384 --heads 4 --layers 2]
                                       [--seq 128 --batch 8] [--plot losses.png] [--mesh data=4,fsdp=2]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

MESH_AXES = ("data", "fsdp")


def mesh_axes(text: str) -> dict:
    """``"data=4,fsdp=2"`` -> ``{"data": 4, "fsdp": 2}`` (ValueError on anything else)."""
    axes = {}
    for item in text.split(","):
        name, eq, size = item.strip().partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1 or name in axes:
            raise ValueError(f"--mesh {text!r}: expected comma-separated axis=size pairs, each axis one of "
                             f"{', '.join(MESH_AXES)} at most once, each size a positive integer (e.g. data=4,fsdp=2)")
        axes[name] = int(size)
    return axes


def xla_flags_for_mesh(argv, flags: str) -> str:
    """XLA_FLAGS for a run with these arguments: with a valid --mesh of n devices and no
    --xla_force_host_platform_device_count yet, the flag that gives the CPU n simulated devices is added
    (other backends ignore it); otherwise ``flags`` unchanged (a bad --mesh: argparse says what is wrong)."""
    for i, a in enumerate(argv):
        if a == "--mesh" and i + 1 < len(argv):
            text = argv[i + 1]
        elif a.startswith("--mesh="):
            text = a[len("--mesh="):]
        else:
            continue
        try:
            n = math.prod(mesh_axes(text).values())
        except ValueError:
            return flags
        if "--xla_force_host_platform_device_count" not in flags:
            return f"{flags} --xla_force_host_platform_device_count={n}".strip()
    return flags


if __name__ == "__main__" and "jax" not in sys.modules:  # XLA reads the flag when jax starts its backends
    os.environ["XLA_FLAGS"] = xla_flags_for_mesh(sys.argv[1:], os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _transformer as T  # noqa: E402
import jax_fp8 as jf  # noqa: E402



RECIPES = {"blockwise": jf.Float8BlockScaling(), "mxfp8": jf.MXFP8BlockScaling()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="A Llama-style decoder trained with FP8 GEMMs (jax_fp8.fp8_dot_general) "
                                 "next to the same model in bf16.")
    ap.add_argument("--steps", type=int, default=60)
    T.add_model_flags(ap, d_model=128, ffn=384, heads=4, layers=2, seq=128, batch=8, vocab=256, variants="fp8,bf16")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10, help="linear learning-rate warmup steps")
    ap.add_argument("--log-every", type=int, default=10, help="print every N steps (and the first and last)")
    ap.add_argument("--recipe", default="blockwise", choices=sorted(RECIPES),
                    help="the fp8 variant's recipe: Float8 blockwise (Hopper's FP8 GEMM) or MXFP8 (Blackwell's; "
                         "elsewhere its GEMMs run as their reference, same numbers)")
    ap.add_argument("--plot", metavar="PNG", help="draw the loss curves into this file (needs matplotlib)")
    ap.add_argument("--mesh", metavar="AXIS=SIZE,...",
                    help="train on a device mesh under jax.jit, e.g. data=4,fsdp=2: the batch split over data and "
                         "fsdp, the parameters and optimizer state FSDP over fsdp (CPU: simulated devices)")
    args = ap.parse_args(argv)
    T.check_model_flags(ap, args, positive=("steps", "log_every"))
    if args.mesh is not None:
        text = args.mesh
        try:
            args.mesh = mesh_axes(text)
        except ValueError as e:
            ap.error(str(e))
        n, have = math.prod(args.mesh.values()), len(jax.devices())
        if n > have:
            ap.error(f"--mesh {text} needs {n} devices, but only {have} {jax.default_backend()} device(s) exist"
                     + (f" (XLA_FLAGS=--xla_force_host_platform_device_count={n} gives the CPU more; the script "
                        f"sets it itself when run as a script and the flag is absent)" if jax.default_backend() == "cpu"
                        else ""))
        split = args.mesh.get("data", 1) * args.mesh.get("fsdp", 1)
        if args.batch % split:
            ap.error(f"--batch {args.batch} is not divisible by the {split} data x fsdp shards of --mesh")
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


def report_compiled(log, results: dict) -> None:
    """Per-device memory and collectives of each variant's compiled step (Run.stats)."""
    mb = lambda b: "n/a" if b is None else f"{b / 1e6:.3f} MB"  # noqa: E731
    for v, r in results.items():
        st = r.stats
        total = None if st["temp"] is None else st["temp"] + st["argument"]
        log(f"[{v:>8}] compiled step, per device: temp {mb(st['temp'])} + arguments {mb(st['argument'])} = "
            f"{mb(total)} (output {mb(st['output'])}, aliased {mb(st['alias'])})")
        coll = T.summarize_collectives(st["collectives"])
        kinds = ("all-gather", "all-reduce") + tuple(k for k in coll if k not in ("all-gather", "all-reduce"))
        log(f"[{v:>8}] collectives in the compiled HLO (per-device result bytes): " + "   ".join(
            f"{k} {coll.get(k, (0, 0))[0]} ops {coll.get(k, (0, 0))[1]:,} B" for k in kinds))
        gathers = {}
        for op, dt, shape in st["collectives"]:
            if op == "all-gather":
                gathers[(dt, shape)] = gathers.get((dt, shape), 0) + 1
        if gathers:
            log(f"[{v:>8}]   all-gathers by result: " + ", ".join(
                f"{n}x {dt}{list(shape)}" for (dt, shape), n in sorted(gathers.items(), key=lambda kv: str(kv[0]))))


def main(argv=None) -> dict:
    """Runs the comparison; returns ``{variant: _transformer.Run}`` (losses, step seconds, and the
    compiled step's memory and collectives)."""
    args = parse_args(argv)
    cfg = args.cfg
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); decoder: {cfg.layers} layers, d_model "
        f"{cfg.d_model}, ffn {cfg.ffn}, {cfg.heads} heads, vocab {cfg.vocab}, {cfg.n_params() / 1e6:.2f}M params "
        f"({args.param_dtype} masters, {args.dtype} activations); batch {args.batch} x seq {cfg.seq}; {args.steps} steps; "
        f"fp8 recipe {args.recipe}")
    params = T.init_params(cfg, args.seed)
    batches = T.make_batches(cfg, args.batch, args.steps, seed=args.seed)  # fresh data every step
    log(f"data: Markov chain over {cfg.vocab} tokens, entropy {T.chain_entropy(T.markov_chain(cfg.vocab, args.seed)):.4f} "
        f"nats (the lowest reachable loss); uniform guess {jnp.log(cfg.vocab):.4f}")
    mesh = None
    if args.mesh is not None:
        mesh = T.make_mesh(args.mesh)
        log(T.describe_shardings(params, mesh))
    results = {}
    t0 = time.perf_counter()
    for v in args.variants:
        results[v] = T.train(cfg, v, params, batches, args.steps, T.optimizer(args.lr, args.warmup), log,
                             args.log_every, recipe=RECIPES[args.recipe] if v == "fp8" else None, mesh=mesh)
    tail = max(1, args.steps // 10)
    final = {v: sum(r.losses[-tail:]) / tail for v, r in results.items()}
    # median over the steps after the first (which compiles)
    step_ms = {v: 1e3 * statistics.median(r.times[1:] if len(r.times) > 1 else r.times) for v, r in results.items()}
    log(f"final loss (mean of the last {tail} steps): " + "   ".join(f"{v} {final[v]:.4f}" for v in results))
    log("step time (median after the first step): " + "   ".join(f"{v} {step_ms[v]:.2f} ms" for v in results))
    base = "bf16" if "bf16" in results else None
    for v in results:
        if base and v != base:
            log(f"{v} / bf16: loss ratio {final[v] / final[base]:.4f}   step-time ratio {step_ms[v] / step_ms[base]:.3f}")
    if jax.default_backend() == "cpu" and "fp8" in results:
        log("(on the CPU the FP8 GEMM is computed by its reference, fp32 products per block: the step-time ratio "
            "measures that, not an FP8 GEMM)")
    if mesh is not None:
        report_compiled(log, results)
    log(f"total {time.perf_counter() - t0:.1f} s")
    if args.plot:
        plot(args.plot, {v: r.losses for v, r in results.items()})
        log(f"loss curves written to {args.plot}")
    return results


if __name__ == "__main__":
    main()
