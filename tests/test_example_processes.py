"""examples/shard_map_model.py as several processes (``--spawn 2``: 2 x 4 CPU devices, gloo) and its
Orbax checkpoints: the losses and the final training state equal one process's bit for bit; a run
killed after a step, or while a checkpoint is being written, resumes from the latest complete
checkpoint and ends with the uninterrupted run's losses and state; a checkpoint restores onto another
mesh; bad launches and checkpoints get clear errors."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
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
FLAGS = ["--steps", "8", "--checkpoint-every", "2", "--log-every", "1"]
TIMEOUT = 120.0


class Run:
    """``shard_map_model.py --spawn 2 FLAGS`` writing into ``folder``; its output read as it comes."""

    def __init__(self, folder, *extra):
        self.ckpt, self.metrics = str(folder / "ckpt"), str(folder / "metrics.jsonl")
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--spawn", "2", *FLAGS, "--checkpoint-dir", self.ckpt,
                                      "--metrics-out", self.metrics, *extra], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines, self._q = [], queue.Queue()
        self._reader = threading.Thread(target=lambda: [self._q.put(x) for x in self.proc.stdout], daemon=True)
        self._reader.start()
        self.deadline = time.monotonic() + TIMEOUT
        self.pids = [int(p) for p in re.search(r"pids ([\d ]+)\)", self.wait_for("spawned")).group(1).split()]

    def _fail(self, why):
        self.proc.kill()
        pytest.fail(f"{why}; its last lines:\n{tail(''.join(self.lines))}")

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
    import shard_map_model

    out = "".join(uninterrupted.lines)
    assert "backend cpu, 2 processes, mesh data=4 x seq=2" in out and "step    8/8" in out
    assert "[process 1]" not in out, out
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
    eight = shard_map_model.main(["--data", "8", "--seq", "1", "--steps", "3"] + flags[:2])
    shard_map_model.main(["--data", "8", "--seq", "1", "--steps", "2"] + flags)
    four = shard_map_model.main(["--data", "4", "--seq", "2", "--steps", "3"] + flags)
    assert "mesh data=4 x seq=2" in capsys.readouterr().out
    assert len(four) == 1 and four[0] == pytest.approx(eight[2], rel=1e-3), (four, eight)
    state = read_checkpoint(str(tmp_path / "ckpt"), 3)
    assert int(state["step"]) == 3 and [w.shape for w in state["weights"]] == [(128, 256), (256, 256), (256, 16)]


def test_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    import shard_map_model

    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    shard_map_model.main(["--steps", "1"] + ckpt)
    with pytest.raises(SystemExit) as e:
        shard_map_model.main(["--steps", "2", "--width", "128"] + ckpt)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"--checkpoint-dir: .*ckpt/1 holds \[.*\] of shape \(128, 256\), the model's is "
                     r"\(128, 128\): it was saved by a model of other flags \(here --width 128\)", err), err


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
