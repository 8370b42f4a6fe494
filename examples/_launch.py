"""Helper module, not an example to run: running ``shard_map_model.py`` as several JAX processes.

``add_flags`` adds ``jax.distributed.initialize``'s arguments and ``--spawn N``; ``join_processes``
joins this process to the others (before JAX touches a device); ``spawn`` starts N local CPU
processes of the script and relays their output; ``process_local_array`` builds a global batch from
the part this process's devices hold, as a data loader does.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("several processes (jax.distributed; without these flags, a cluster's own "
                              "settings are detected, else one process runs)")
    g.add_argument("--coordinator-address", help="host:port of process 0's coordinator")
    g.add_argument("--num-processes", type=int, help="how many processes join the mesh")
    g.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")
    g.add_argument("--spawn", type=int, metavar="N", help="start N local CPU processes of this script joined "
                   "into one mesh (gloo), to try several processes on one machine")


def join_processes(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` with the flags given; with none, with what jax detects of a
    cluster (SLURM, Open MPI, Kubernetes, Cloud TPU), or nothing when there is no cluster. Collectives
    then run over NCCL between GPUs and gloo between CPU processes."""
    given = {k: getattr(args, k) for k in ("coordinator_address", "num_processes", "process_id")
             if getattr(args, k) is not None}
    if given:
        jax.distributed.initialize(**given)
        return
    try:
        jax.distributed.initialize()
    except ValueError as e:  # no cluster detected: one process
        if "coordinator_address" not in str(e):
            raise
    except RuntimeError:  # main() called in a Python process whose JAX already runs: that process alone
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# gloo's "[Gloo] Rank r is connected to n peer ranks. ..." notice, once per device, written to stderr
# by several threads at once (so in pieces across lines)
_GLOO_HELLO = re.compile(r"(\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks "
                         r"is :|\d+|\s)*")


def _relay(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        if _GLOO_HELLO.fullmatch(line):
            continue
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def spawn(script: str, argv: list[str], n: int, devices: int) -> int:
    """Runs ``script argv`` as ``n`` local processes of ``devices // n`` CPU devices each, joined through
    a coordinator on a free local port. Process 0's output is printed as is, the others' prefixed with
    ``[process i]``; when one process fails, the others are stopped. Returns the exit status."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // n}")
    cmd = [sys.executable, script, *argv, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(n)]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for i in range(n)]
    print(f"spawned {n} processes x {devices // n} CPU devices (pids {' '.join(str(p.pid) for p in procs)}), "
          f"coordinator 127.0.0.1:{port}", flush=True)
    relays = [threading.Thread(target=_relay, args=(p, f"[process {i}] " if i else ""), daemon=True)
              for i, p in enumerate(procs)]
    for t in relays:
        t.start()
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    finally:  # a failed process leaves the others waiting in a collective; so does Ctrl-C
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p, t in zip(procs, relays):
            p.wait()
            t.join()
    if failed:
        print(f"process {failed[0]} exited with status {codes[failed[0]]}; stopped the others", flush=True)
        return 1
    return 0


def without_spawn(argv: list[str]) -> list[str]:
    """``argv`` less its ``--spawn N`` / ``--spawn=N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--spawn":
            skip = True
        elif not a.startswith("--spawn="):
            out.append(a)
    return out


def process_local_array(sharding: jax.sharding.Sharding, shape: tuple[int, ...], load) -> jax.Array:
    """The global array of ``shape`` laid out by ``sharding``, built from this process's part only:
    ``load(box)`` returns the block ``box`` (a tuple of slices) of the global data, the smallest box
    that covers this process's devices' shards (``jax.make_array_from_process_local_data``)."""
    idx = [tuple(s.indices(d)[:2] for s, d in zip(i, shape))
           for i in sharding.addressable_devices_indices_map(shape).values()]
    box = tuple(slice(min(i[k][0] for i in idx), max(i[k][1] for i in idx)) for k in range(len(shape)))
    return jax.make_array_from_process_local_data(sharding, np.asarray(load(box)), shape)
