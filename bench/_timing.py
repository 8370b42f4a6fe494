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


def in_turns(time_of, base, pick, rounds: int) -> tuple[list, list]:
    """``base`` and ``pick`` timed by ``time_of`` in turns, ``rounds`` times, each round's order the other
    way round (a drift of the clocks over the rounds favours neither): (base's times, pick's times)."""
    t = {0: [], 1: []}
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t[i].append(time_of((base, pick)[i]))
    return t[0], t[1]
