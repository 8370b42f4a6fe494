"""examples/shard_map_model.py as several processes (``--spawn 2``: 2 x 4 CPU devices, gloo) and its
Orbax checkpoints: the losses and the final training state equal one process's bit for bit; a run
killed after a step, or while a checkpoint is being written, resumes from the latest complete
checkpoint and ends with the uninterrupted run's losses and state; a checkpoint restores onto another
mesh; a killed launcher takes its processes with it, a live run's checkpoint directory is refused to a
second run and a dead run's is not, a process whose peer died stops; bad launches and checkpoints get
clear errors, once."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import assert_bits_equal
from multiprocess import free_port, tail

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
SCRIPT = os.path.join(EXAMPLES, "shard_map_model.py")
sys.path.insert(0, EXAMPLES)
FLAGS = ["--steps", "8", "--checkpoint-every", "2", "--log-every", "1", "--no-bf16"]
LONG = ["--steps", "100000", "--checkpoint-every", "2", "--log-every", "1", "--no-bf16"]  # runs until killed
TIMEOUT = 120.0
GONE_WITHIN_S = 10.0  # a killed launcher's processes are gone within this (the kernel kills them at once)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped by its new parent, does not)."""
    if not sys.platform.startswith("linux"):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill(*pids: int):
    """SIGKILL to those of ``pids`` still alive (a test's clean-up)."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_gone(pids: list[int], within: float = GONE_WITHIN_S):
    """Every process of ``pids`` ends within ``within`` seconds; those that do not are killed, and the
    test fails."""
    deadline = time.monotonic() + within
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid)]
    kill(*left)
    assert not left, f"processes {left} outlived their launcher by {within:.0f} s"


class Proc:
    """``shard_map_model.py argv`` as a subprocess, its output read as it comes."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.PIPE, env=env,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines, self._q = [], queue.Queue()
        self._reader = threading.Thread(target=lambda: [self._q.put(x) for x in self.proc.stdout], daemon=True)
        self._reader.start()
        self.deadline = time.monotonic() + TIMEOUT

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def _fail(self, why):
        self.kill_all()
        pytest.fail(f"{why}; its last lines:\n{tail(self.out)}")

    def kill_all(self):
        """SIGKILL to the process (a test's clean-up)."""
        kill(self.proc.pid)

    def wait_for(self, text: str) -> str:
        """The first output line (from now) that contains ``text``."""
        while time.monotonic() < self.deadline:
            try:
                line = self._q.get(timeout=0.05)
            except queue.Empty:
                if self.proc.poll() is not None and self._q.empty():
                    self._fail(f"the run ended (exit {self.proc.returncode}) before printing {text!r}")
                continue
            self.lines.append(line)
            if text in line:
                return line
        self._fail(f"no {text!r} within {TIMEOUT:.0f} s")

    def finish(self) -> int:
        """Waits for the run to end; its exit status."""
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._fail("the run hung")
        self._reader.join(timeout=10)
        while not self._q.empty():
            self.lines.append(self._q.get())
        return self.proc.returncode


class Run(Proc):
    """``shard_map_model.py --spawn 2 flags`` writing into ``folder``."""

    def __init__(self, folder, *extra, flags=FLAGS):
        self.ckpt, self.metrics = str(folder / "ckpt"), str(folder / "metrics.jsonl")
        super().__init__(["--spawn", "2", *flags, "--checkpoint-dir", self.ckpt, "--metrics-out", self.metrics,
                          *extra])
        self.pids = []  # for kill_all, until the launcher names them
        self.pids = [int(p) for p in re.search(r"pids ([\d ]+)\)", self.wait_for("spawned")).group(1).split()]

    def kill_all(self):
        """SIGKILL to the launcher and its processes (a test's clean-up)."""
        kill(self.proc.pid, *self.pids)

    def losses(self) -> list[tuple[int, float]]:
        with open(self.metrics) as f:
            return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def read_checkpoint(ckpt: str, step: int) -> dict:
    """Checkpoint ``step`` of ``ckpt``, every array whole on one device of this process."""
    import jax
    import orbax.checkpoint as ocp
    from _checkpoint import open_checkpoints

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with open_checkpoints(ckpt) as manager:
        meta = manager.item_metadata(step).tree
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), meta)
        return manager.restore(step, args=ocp.args.StandardRestore(target))


def assert_same_state(got: dict, want: dict):
    """The same arrays, bit for bit."""
    import jax

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, g, w in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_bits_equal(np.asarray(g), np.asarray(w), path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("uninterrupted"))
    assert run.finish() == 0, tail("".join(run.lines))
    return run


def test_two_processes_train_as_one(uninterrupted, tmp_path, capsys):
    """--spawn 2: process 0 prints the log, process 1 nothing; the losses and the final checkpoint
    (master weights, Adam moments, biases, step, data position) equal one process's, bit for bit: the
    example adds gradients and losses in rank order, whatever the collectives run over."""
    import jax
    import shard_map_model

    out = "".join(uninterrupted.lines)
    assert "backend cpu, 2 processes, mesh data=4 x seq=2" in out and "step    8/8" in out
    assert "[process 1]" not in out, out
    # Orbax kept the last two steps, cleaned up, and left the run's lock alone
    assert sorted(os.listdir(uninterrupted.ckpt)) == ["6", "8", "run.lock"]
    # on the spawned processes' backend: beside a GPU, the one process's mesh takes the CPU devices, but
    # what it computes outside the mesh (the initial weights) would run on the GPU, in other roundings
    with jax.default_device(jax.devices("cpu")[0]):
        one = shard_map_model.main(FLAGS + ["--checkpoint-dir", str(tmp_path / "ckpt")])
    capsys.readouterr()
    assert uninterrupted.losses() == list(enumerate(one, 1))
    state = read_checkpoint(uninterrupted.ckpt, 8)
    assert int(state["step"]) == 8 and int(state["data_position"]) == 8
    assert_same_state(state, read_checkpoint(str(tmp_path / "ckpt"), 8))


def test_killed_runs_resume_bit_exact(uninterrupted, tmp_path):
    """SIGKILL to process 1 after step 3, then to process 0 while a checkpoint is being written:
    each restart resumes from the latest complete checkpoint (never the half-written one), and the
    runs together give the uninterrupted run's losses at every step (re-run steps included) and its
    final state, bit for bit."""
    first = Run(tmp_path)
    first.wait_for("step    3/8")
    while not os.path.isdir(os.path.join(first.ckpt, "2")):  # checkpoint 2 is written in the background
        if time.monotonic() > first.deadline or first.proc.poll() is not None:
            first._fail("checkpoint 2 never completed")
        time.sleep(0.01)
    os.kill(first.pids[1], signal.SIGKILL)
    assert first.finish() == 1 and "process 1 exited with status -9" in "".join(first.lines)

    second = Run(tmp_path)
    resumed = int(re.search(r"resumed from the checkpoint of step (\d+)", second.wait_for("resumed")).group(1))
    assert resumed in (2, 4), resumed
    writing = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
    while not (partial := [m for m in map(writing.match, os.listdir(second.ckpt)) if m and int(m[1]) > resumed]):
        if time.monotonic() > second.deadline or second.proc.poll() is not None:
            second._fail("no checkpoint write seen")
        time.sleep(0.002)
    os.kill(second.pids[0], signal.SIGKILL)
    step = int(partial[0][1])
    second.finish()
    half_written = not os.path.exists(os.path.join(second.ckpt, str(step)))
    assert half_written, f"checkpoint {step} completed before the kill landed"

    third = Run(tmp_path)
    assert f"resumed from the checkpoint of step {step - 2}" in third.wait_for("resumed")
    assert third.finish() == 0, tail("".join(third.lines))
    want = dict(uninterrupted.losses())
    got = third.losses()  # the three runs appended to one file
    assert sorted({s for s, _ in got}) == list(range(1, 9))
    assert all(loss == want[s] for s, loss in got), [(s, loss, want[s]) for s, loss in got if loss != want[s]]
    assert_same_state(read_checkpoint(third.ckpt, 8), read_checkpoint(uninterrupted.ckpt, 8))


def test_checkpoint_restores_onto_another_mesh(tmp_path, capsys):
    """Saved by 8 data ranks, resumed by 4 data x 2 seq ranks: Orbax lays the weights out for the new
    mesh, and step 3 continues the 8-rank run (its loss within the rounding a new mesh brings)."""
    import shard_map_model

    flags = ["--batch", "16", "--checkpoint-dir", str(tmp_path / "ckpt")]
    eight = shard_map_model.main(["--data", "8", "--seq", "1", "--steps", "3", "--no-bf16"] + flags[:2])
    shard_map_model.main(["--data", "8", "--seq", "1", "--steps", "2", "--no-bf16"] + flags)
    capsys.readouterr()
    four = shard_map_model.main(["--data", "4", "--seq", "2", "--steps", "3"] + flags)
    out = capsys.readouterr().out
    assert "mesh data=4 x seq=2" in out and "resumed from the checkpoint of step 2" in out
    # a resumed run has not the FP8 losses of the steps before it: no loss ratio, and it says why
    assert ("no bf16 baseline: this run resumed at step 2, and the loss ratio needs the FP8 losses of every step "
            "from 1") in out and "fp8 / bf16: loss ratio" not in out
    assert len(four) == 1 and four[0] == pytest.approx(eight[2], rel=1e-3), (four, eight)
    state = read_checkpoint(str(tmp_path / "ckpt"), 3)
    assert int(state["step"]) == 3 and [w.shape for w in state["weights"]] == [(128, 256), (256, 256), (256, 16)]


def test_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    """In one process, and with --spawn 2: exit status 2 and the error once (process 0 prints it; the
    launcher relays both processes' output). The first run also shows a fresh checkpointed run ending
    with its bf16 baseline, and --data 3 of one process on 6 of the 8 devices, said in its first line."""
    import shard_map_model

    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    shard_map_model.main(["--steps", "1", "--data", "3"] + ckpt)
    out = capsys.readouterr().out
    assert "mesh data=3 x seq=2 (on 6 of the 8 cpu devices); MLP" in out and "fp8 / bf16: loss ratio" in out
    with pytest.raises(SystemExit) as e:
        shard_map_model.main(["--steps", "2", "--width", "128"] + ckpt)
    assert e.value.code == 2
    message = (r"--checkpoint-dir: .*ckpt/1 holds \[.*\] of shape \(128, 256\), the model's is \(128, 128\): it was "
               r"saved by a model of other flags \(here --width 128\)")
    err = capsys.readouterr().err
    assert re.search(message, err), err
    run = Run(tmp_path, "--width", "128", flags=["--steps", "2"])
    try:
        assert run.finish() == 2, tail(run.out)
    finally:
        run.kill_all()
    assert len(re.findall(message, run.out)) == 1 and run.out.count("usage:") == 1, run.out
    assert "[process 1]" not in run.out and "stopped the others" not in run.out, run.out


def test_spawn_that_does_not_divide_the_mesh_is_refused(capsys):
    import shard_map_model

    with pytest.raises(SystemExit) as e:
        shard_map_model.main(["--spawn", "3"])
    assert e.value.code == 2
    assert ("--spawn 3 does not divide the mesh's --data 4 x --seq 2 = 8 devices: every process takes the same "
            "number of them") in capsys.readouterr().err


def test_processes_with_too_few_devices_for_the_mesh_are_refused():
    """Two processes of 2 CPU devices each, joined by hand as on a cluster, asked for a 4 x 2 mesh."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--coordinator-address", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert all("--data 4 x --seq 2 = 8 devices, but the 2 processes have 4 in all: the mesh takes every "
               "process's devices" in out for out in outs), outs


def test_killed_launcher_takes_its_processes_and_the_directory_lock_with_it(tmp_path):
    """A run holds its checkpoint directory: a second run on it is refused (exit status 2, the error
    once, naming the directory and the holder's pid and host) while the first lives. SIGKILL to the
    first run's launcher alone: its processes are gone within seconds (the kernel's parent-death
    signal), and a third run takes the directory. SIGTERM to that one's launcher: it stops
    its processes and exits with 128 + 15."""
    first = Run(tmp_path, flags=LONG)
    runs = [first]
    try:
        first.wait_for("backend cpu, 2 processes")  # its first line: it holds the directory
        second = Run(tmp_path, flags=LONG)
        runs.append(second)
        assert second.finish() == 2, tail(second.out)
        held = (rf"error: --checkpoint-dir: {re.escape(first.ckpt)} is held by another live run \(pid "
                rf"{first.pids[0]} on host {re.escape(socket.gethostname())} since [-\d: ]+, process 0 of 2 \(its "
                rf"--spawn launcher: pid {first.proc.pid}\); its lock: run.lock there\): a second run would overwrite "
                rf"its checkpoints")
        assert len(re.findall(held, second.out)) == 1 and second.out.count("usage:") == 1, second.out
        assert "  loss " not in second.out and "[process 1]" not in second.out, second.out
        assert all(map(alive, first.pids)), "the refused run disturbed the first"

        os.kill(first.proc.pid, signal.SIGKILL)
        assert_gone(first.pids)
        third = Run(tmp_path, flags=LONG)
        runs.append(third)
        third.wait_for("backend cpu, 2 processes")  # the lock died with its holder; the stale file is no obstacle

        os.kill(third.proc.pid, signal.SIGTERM)
        assert third.finish() == 128 + signal.SIGTERM, tail(third.out)
        assert "launcher stopped by SIGTERM: killing its processes" in third.out, tail(third.out)
        assert_gone(third.pids)
    finally:
        for run in runs:
            run.kill_all()


def test_a_spawned_process_ends_when_its_launchers_pipe_closes():
    """die_with_launcher's second guard, the one that works beyond Linux's parent-death signal: the
    process ends when its stdin, a pipe that only the launcher holds, reaches end-of-file (here its
    parent lives: only the pipe closes). And a process whose launcher died before it could arm the
    guards (its parent is no longer the launcher) ends at once."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import _launch; _launch.die_with_launcher(); "
            "print('armed', flush=True); time.sleep(60)")
    for launcher, close in ((os.getpid(), True), (1, False)):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_FP8_EXAMPLE_LAUNCHER_PID=str(launcher))
        p = subprocess.Popen([sys.executable, "-c", code, EXAMPLES], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        try:
            if close:
                assert p.stdout.readline() == "armed\n"
                p.stdin.close()
            assert p.wait(timeout=GONE_WITHIN_S) == 1
        finally:
            p.kill()
            p.wait()


def test_a_process_whose_peer_died_stops():
    """Two processes joined by hand, as on a cluster (no launcher), once both have joined: SIGTERM ends
    process 1 (jax's preemption notifier, which would swallow it, is off), and process 0, which goes on
    to wait in a collective for it, stops within --heartbeat-timeout and jax's detection (about 5 s
    here) rather than waiting for ever."""
    port, timeout = free_port(), 5
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = [Proc([*LONG, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                   "--heartbeat-timeout", str(timeout)], env=env) for i in range(2)]
    try:
        procs[0].wait_for("backend cpu, 2 processes")  # both joined
        os.kill(procs[1].proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        procs[1].deadline = procs[0].deadline = t0 + 6 * timeout
        assert procs[1].finish() == -signal.SIGTERM, tail(procs[1].out)
        assert procs[0].finish() != 0
        assert time.monotonic() - t0 < 6 * timeout
    finally:
        for p in procs:
            p.kill_all()


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2", "--process-id", "0"], "--num-processes 2 --process-id 0 without --coordinator-address: "
                                                    "give all three (or none, where jax detects the cluster"),
    (["--coordinator-address", "127.0.0.1:1", "--process-id", "1"],
     "--coordinator-address 127.0.0.1:1 --process-id 1 without --num-processes: give all three"),
])
def test_process_flags_without_the_others_are_refused(argv, message):
    """Some of the three process flags, and no cluster to supply the others: an argparse error naming
    the missing flag (a fresh process: jax.distributed joins only before jax runs)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for k in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMI_"))]:  # no cluster here, even under one
        del env[k]
    p = subprocess.run([sys.executable, SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 2 and message in p.stderr, p.stderr


@pytest.mark.parametrize("argv, message", [
    (["--spawn", "2", "--process-id", "0"], "--spawn sets --process-id for the processes it starts"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id 2 is not in 0 .. --num-processes - 1 = 1"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be a positive integer, got 0"),
])
def test_bad_process_flags_are_refused(argv, message, capsys):
    import shard_map_model

    with pytest.raises(SystemExit) as e:
        shard_map_model.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_checkpoint_directory_lock(tmp_path):
    """_checkpoint.lock_directory: refused while another live process holds it, naming the directory
    and the holder; free again once that process was SIGKILLed (the kernel drops its flock; the file
    it left is no obstacle) and the next holder's name replaces the dead one's."""
    from _checkpoint import DirectoryHeld, lock_directory

    ckpt = str(tmp_path / "ckpt")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from _checkpoint import lock_directory; "
            "f = lock_directory(sys.argv[2], ', the test holder'); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, EXAMPLES, ckpt], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DirectoryHeld, match=rf"{re.escape(ckpt)} is held by another live run \(pid {holder.pid} on "
                           rf"host {re.escape(socket.gethostname())} since .*, the test holder; its lock: run.lock"):
            lock_directory(ckpt)
        holder.kill()
        holder.wait(timeout=TIMEOUT)
        lock = lock_directory(ckpt)
        with open(os.path.join(ckpt, "run.lock")) as f:
            assert f.read().startswith(f"pid {os.getpid()} on host ")
        lock.close()
        lock_directory(ckpt).close()  # closed: free again
    finally:
        holder.kill()
        holder.wait()
