"""Run a test case as N local processes joined by ``jax.distributed`` (gloo CPU collectives), as
multi-host users run: one global mesh of 8 CPU devices, 8 // N per process.

``run_processes(case, n)`` starts ``tests/mp_worker.py case`` N times with a free coordinator port,
waits for all of them, and fails with every process's last lines when one fails or the whole run
outlives ``timeout`` (a hang: the processes are killed). Returns each process's output.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_worker.py")
DEVICES = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_processes(case: str, n: int, timeout: float = 120.0) -> list[str]:
    """Run ``case`` of mp_worker.py as ``n`` processes; their outputs, in process order."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_cpu_ftz=false --xla_force_host_platform_device_count={DEVICES // n}")
    procs = [subprocess.Popen([sys.executable, WORKER, case, str(pid), str(n), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(n)]
    deadline, outs = time.monotonic() + timeout, [None] * n
    try:
        for i, p in enumerate(procs):
            outs[i] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [o if o is not None else p.communicate()[0] for o, p in zip(outs, procs)]
        pytest.fail(f"{case} on {n} processes hung for {timeout:.0f} s; their last lines:\n" +
                    "\n".join(f"--- process {i}:\n{tail(o)}" for i, o in enumerate(outs)))
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        pytest.fail(f"{case} on {n} processes: process(es) {failed} failed; their last lines:\n" +
                    "\n".join(f"--- process {i} (exit {procs[i].returncode}):\n{tail(outs[i])}" for i in failed))
    return outs
