"""Train a small MLP with FP8 linear layers under jax.jit and optax, next to the same model in bf16.

Weights and activations are quantized (MXFP8 by default, or Float8 blockwise) with straight-through
gradients. Prints the loss as it falls and compares the final FP8 loss with the bf16 run's.

  python examples/train_mlp.py [--fmt mxfp8|blockwise] [--steps 300]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fp8_mlp import init_mlp, mlp, teacher_data  # noqa: E402


def train(fmt, steps, batch, sizes, log_every=50, seed=0):
    """Adam on the teacher task; returns the per-step losses."""
    params = init_mlp(jax.random.key(seed), sizes)
    x_all, y_all = teacher_data(jax.random.key(seed + 1), 8192, sizes[0], sizes[-1])
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, i):
        idx = jax.random.randint(jax.random.fold_in(jax.random.key(seed + 2), i), (batch,), 0, x_all.shape[0])
        loss, g = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x_all[idx], fmt) - y_all[idx]) ** 2))(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, i)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"  [{fmt or 'bf16':>9}] step {i:4d}  loss {losses[-1]:.5f}", flush=True)
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="mxfp8", choices=["mxfp8", "blockwise"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args(argv)
    sizes = [128, args.width, args.width, 16]
    print(f"backend {jax.default_backend()}; MLP {sizes}; {args.steps} steps of batch {args.batch}")
    t0 = time.time()
    fp8 = train(args.fmt, args.steps, args.batch, sizes)
    bf16 = train(None, args.steps, args.batch, sizes)
    tail = max(1, args.steps // 10)
    f8, b16 = sum(fp8[-tail:]) / tail, sum(bf16[-tail:]) / tail
    print(f"final loss (mean of last {tail} steps): {args.fmt} {f8:.5f}   bf16 {b16:.5f}   "
          f"ratio {f8 / b16:.3f}   (start {fp8[0]:.4f}; {time.time() - t0:.1f}s)")
    return fp8, bf16


if __name__ == "__main__":
    main()
