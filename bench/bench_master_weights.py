"""Master-weight cast: scale all-reduce payload and time, uint8 E8M0 pmax vs the amax alternatives.

Runs inside shard_map over all local devices (CPU: simulated with
XLA_FLAGS=--xla_force_host_platform_device_count=8; GPU: the real ones). Measures, for a transformer's
weight set: the bytes of the one scale all-reduce read off the compiled HLO, the time of that
collective alone for u8 (ours), bf16 and fp32 amax payloads of the same block count, and the time of
the whole quantize_master_weights step. Many-dispatch timing, median of several runs.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/bench_master_weights.py [--layers 4 --hidden 1024]
"""
from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from _timing import jax_time
from jax import shard_map
from jax_fp8.distributed import quantize_master_weights


def timeit(f, args, iters=20, reps=5):
    return jax_time(f, [args], iters, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    h = args.hidden
    shapes = [s for _ in range(args.layers) for s in [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]]
    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), ("data",))
    Ls = [-(-M * K // n) for M, K in shapes]
    rng = np.random.default_rng(0)
    bufs = [jax.device_put(rng.standard_normal((n, L)).astype(np.float32)) for L in Ls]
    n_blocks = sum(M * -(-K // 32) + -(-M // 32) * K for M, K in shapes)
    print(f"{jax.default_backend()} x{n} devices, jax {jax.__version__}; {len(shapes)} weights, "
          f"{sum(M * K for M, K in shapes) / 1e6:.1f}M params, {n_blocks} MXFP8 blocks (rowwise + columnwise)")

    def step(*b):
        qs = quantize_master_weights([x[0] for x in b], shapes, "data")
        return [q.tensor.rowwise_data[None] for q in qs] + [q.tensor.colwise_data[None] for q in qs]

    f = jax.jit(shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    hlo = f.lower(*bufs).compile().as_text()
    ars = re.findall(r"= (\w+)\[(\d+)\]\{0\} all-reduce(?:-start)?\(", hlo)
    print(f"all-reduces in the compiled step: {ars}")
    t_step = timeit(f, bufs)

    rows = []
    for name, dt in [("uint8 E8M0 (ours)", jnp.uint8), ("bf16 amax", jnp.bfloat16), ("fp32 amax", jnp.float32)]:
        buf = jnp.zeros((n, n_blocks), dt)
        g = jax.jit(shard_map(lambda x: jax.lax.pmax(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        rows.append((name, n_blocks * jnp.dtype(dt).itemsize, timeit(g, (buf,), iters=50)))
    print(f"\n{'scale all-reduce payload':>26} {'bytes/rank':>12} {'time us':>10} {'vs ours':>8}")
    for name, nb, t in rows:
        print(f"{name:>26} {nb:>12} {t * 1e6:10.1f} {t / rows[0][2]:8.2f}")
    print(f"\nwhole quantize_master_weights step (partial amax + one u8 pmax + partial cast): {t_step * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
