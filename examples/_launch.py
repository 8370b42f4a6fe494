"""Helper module, not an example to run: running ``shard_map_model.py`` as several JAX processes.

``add_flags`` adds ``jax.distributed.initialize``'s arguments and ``--spawn N``; ``join_processes``
joins this process to the others (before JAX touches a device); ``spawn`` starts N local CPU
processes of the script and relays their output, and ``die_with_launcher`` (called first thing in
each of them) ends a child when its launcher ends, however it ends; ``usage_error`` reports an error
that every process finds alike; ``process_local_array`` builds a global batch from the part this
process's devices hold, as a data loader does.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np

# set by spawn in its children's environment: the launcher's pid
LAUNCHER_ENV = "JAX_FP8_EXAMPLE_LAUNCHER_PID"
USAGE_ERROR = 2  # argparse's exit status
# how long spawn lets the other processes end after one exits with a usage error: the errors that
# every process finds (a checkpoint of another model, a held directory) reach them within moments
USAGE_ERROR_GRACE_S = 10.0
_DISTRIBUTED = (("coordinator_address", "--coordinator-address"), ("num_processes", "--num-processes"),
                ("process_id", "--process-id"))


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("several processes (jax.distributed; without these flags, a cluster's own "
                              "settings are detected, else one process runs)")
    g.add_argument("--coordinator-address", help="host:port of process 0's coordinator")
    g.add_argument("--num-processes", type=int, help="how many processes join the mesh")
    g.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")
    g.add_argument("--init-timeout", type=int, metavar="S", help="seconds to wait for every process to join "
                   "before giving up (jax's default: 300)")
    g.add_argument("--heartbeat-timeout", type=int, metavar="S", help="seconds after which the processes stop "
                   "when one of them has died (its heartbeats stop; jax's default: 100)")
    g.add_argument("--spawn", type=int, metavar="N", help="start N local CPU processes of this script joined "
                   "into one mesh (gloo), to try several processes on one machine; they end with this one")


def check_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argparse error (exit status 2) naming the flag, for the flags above that cannot work."""
    if args.spawn is not None:
        given = [flag for k, flag in _DISTRIBUTED if getattr(args, k) is not None]
        if given:
            ap.error(f"--spawn sets {', '.join(given)} for the processes it starts: give one or the other")
    for flag in ("num_processes", "init_timeout", "heartbeat_timeout"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.process_id is not None and not (0 <= args.process_id < (args.num_processes or sys.maxsize)):
        ap.error(f"--process-id {args.process_id} is not in 0 .. --num-processes - 1"
                 + (f" = {args.num_processes - 1}" if args.num_processes else ""))


def join_processes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` with the flags given; with none, with what jax detects of a
    cluster (SLURM, Open MPI, Kubernetes, Cloud TPU), or nothing when there is no cluster. Collectives
    then run over NCCL between GPUs and gloo between CPU processes. Some of the three process flags
    without the others, where no cluster supplies them: an argparse error naming the missing ones."""
    given = {k: getattr(args, k) for k, _ in _DISTRIBUTED if getattr(args, k) is not None}
    timeouts = {k: v for k, v in (("initialization_timeout", args.init_timeout),
                                  ("heartbeat_timeout_seconds", args.heartbeat_timeout)) if v is not None}
    # jax's preemption notifier catches SIGTERM (to be read at a sync point, which this script has none
    # of) and the process goes on: without it, SIGTERM ends a process as it ends any program. The flag is
    # read when initialize starts the service, and restored for the rest of an in-process caller.
    preemption = jax.config.jax_enable_preemption_service
    jax.config.update("jax_enable_preemption_service", False)
    try:
        _initialize(ap, args, given, timeouts)
    finally:
        jax.config.update("jax_enable_preemption_service", preemption)


def _initialize(ap, args, given, timeouts):
    if given:
        try:
            jax.distributed.initialize(**given, **timeouts)
        except ValueError as e:  # jax's "coordinator_address should be defined." and the like
            missing = [flag for k, flag in _DISTRIBUTED if k not in given]
            if not missing:
                raise
            have = " ".join(f"{flag} {getattr(args, k)}" for k, flag in _DISTRIBUTED if k in given)
            ap.error(f"{have} without {' and '.join(missing)}: give all three (or none, where jax detects the "
                     f"cluster: SLURM, Open MPI, Kubernetes, Cloud TPU); jax says: {e}")
        return
    try:
        jax.distributed.initialize(**timeouts)
    except ValueError as e:  # no cluster detected: one process
        if "coordinator_address" not in str(e):
            raise
    except RuntimeError:  # main() called in a Python process whose JAX already runs: that process alone
        pass


def spawned() -> bool:
    """Whether this process is one that ``spawn`` started."""
    return LAUNCHER_ENV in os.environ


def die_with_launcher() -> None:
    """In a process that ``spawn`` started (else nothing): ends this process when its launcher ends,
    however it ends (SIGKILL included), so that no child is left waiting forever in a collective for
    a peer, or holding a checkpoint directory. On Linux the kernel sends SIGKILL when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``); everywhere, a thread reading stdin, a pipe that only the launcher
    holds open, ends the process when it reads end-of-file."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None:
        return
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before prctl took effect: we were handed to another parent
        os._exit(1)

    def watch():
        while os.read(0, 1 << 12):  # the launcher never writes: this returns only at its end
            pass
        os._exit(1)

    threading.Thread(target=watch, name="die_with_launcher", daemon=True).start()


def usage_error(ap: argparse.ArgumentParser, message: str) -> None:
    """``ap.error(message)`` (exit status 2) for an error that every process finds alike (a checkpoint
    of another model, a held checkpoint directory). Under ``spawn`` only process 0 prints it, once for
    the run (the launcher relays every process's output); each process of a cluster prints it into its
    own log."""
    if spawned() and jax.process_index() != 0:
        raise SystemExit(USAGE_ERROR)
    ap.error(message)


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
    ``[process i]``; when one process fails, the others are stopped (after a usage error, status 2,
    once they have had a moment to end with it too). SIGTERM or SIGHUP to this launcher stops them
    all; so does its death (``die_with_launcher``). Returns the exit status: 0, 2 for a usage error,
    1 for any other failure."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // n}",
               **{LAUNCHER_ENV: str(os.getpid())})
    cmd = [sys.executable, script, *argv, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(n)]
    # stdin: a pipe that only this process holds open, for die_with_launcher's watch
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(n)]
    print(f"spawned {n} processes x {devices // n} CPU devices (pids {' '.join(str(p.pid) for p in procs)}), "
          f"coordinator 127.0.0.1:{port}", flush=True)
    relays = [threading.Thread(target=_relay, args=(p, f"[process {i}] " if i else ""), daemon=True)
              for i, p in enumerate(procs)]
    for t in relays:
        t.start()

    def stop(signum, frame):  # runs the finally below, which kills the processes
        raise SystemExit(128 + signum)

    catch = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    handlers = ({s: signal.signal(s, stop) for s in catch}
                if threading.current_thread() is threading.main_thread() else {})
    first, deadline = None, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if first is None:
                first = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
                if first is not None:
                    deadline = time.monotonic() + (USAGE_ERROR_GRACE_S if codes[first] == USAGE_ERROR else 0)
            if all(c is not None for c in codes) or (first is not None and time.monotonic() >= deadline):
                break
            time.sleep(0.1)
    except BaseException as e:  # SIGTERM, SIGHUP (through stop) or Ctrl-C
        why = signal.Signals(e.code - 128).name if isinstance(e, SystemExit) else type(e).__name__
        print(f"launcher stopped by {why}: killing its processes", flush=True)
        raise
    finally:  # a failed process leaves the others waiting in a collective; so does Ctrl-C
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: a process inside a gloo collective does not get to handle a signal
        for p, t in zip(procs, relays):
            p.wait()
            p.stdin.close()
            t.join()
        for s, h in handlers.items():
            signal.signal(s, h)
    if first is None:
        return 0
    stopped = any(c is None for c in codes)
    if codes[first] == USAGE_ERROR and not stopped:  # every process said it, process 0 printed it
        return USAGE_ERROR
    print(f"process {first} exited with status {codes[first]}" + ("; stopped the others" if stopped else ""),
          flush=True)
    return USAGE_ERROR if codes[first] == USAGE_ERROR else 1


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
