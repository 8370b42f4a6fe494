"""The benchmarks' one JAX timing harness (bench-only)."""
from __future__ import annotations

import statistics
import time

import jax


def jax_time(fn, arg_sets, iters: int, reps: int = 5) -> float:
    """Seconds per call of jit(fn): `iters` back-to-back dispatches over the rotating argument sets
    (several sets, so that L2 holds none of the inputs), one sync, median of `reps` such runs."""
    f = jax.jit(fn)
    jax.block_until_ready([f(*a) for a in arg_sets])  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = f(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)
