"""Helper module, not an example to run: ``shard_map_model.py``'s checkpoints, on Orbax.

Every process calls the same functions; Orbax writes each array's shards from the processes that hold
them, into a temporary folder renamed to the step's number once every process has written (so a
checkpoint cut short by a crash is never the latest), and reads them back laid out by the shardings
the caller asks for: a checkpoint saved on one mesh restores onto another. ``lock_directory`` keeps
a second run off a directory that a live run writes.
"""
from __future__ import annotations

import os
import socket
import time

try:
    import fcntl
except ImportError:  # Windows: no flock, no lock
    fcntl = None

import jax
import orbax.checkpoint as ocp


class CheckpointMismatch(ValueError):
    """The checkpoint's arrays do not have the shapes the caller's model needs."""


class DirectoryHeld(RuntimeError):
    """Another live run holds the checkpoint directory's lock."""


# Inside the directory: Orbax lists only the step folders (and its temporary ones) and leaves other
# files alone, so the lock neither shows as a step nor is deleted by max_to_keep or the tmp cleanup.
LOCK_NAME = "run.lock"


def lock_holder(directory: str) -> str:
    """Who took ``directory``'s lock last, as its holder wrote it ("pid P on host H since T ...")."""
    try:
        with open(os.path.join(directory, LOCK_NAME)) as f:
            return f.read().strip() or "a run that has not written its name yet"
    except OSError:
        return "unknown"


def held_message(directory: str) -> str:
    """What DirectoryHeld says: the directory and its holder."""
    return (f"{os.path.abspath(directory)} is held by another live run ({lock_holder(directory)}; "
            f"its lock: {LOCK_NAME} there)")


def lock_directory(directory: str, about: str = ""):
    """Takes ``directory``'s run lock (the directory is created if missing): an exclusive ``flock`` on
    ``directory/run.lock``, held while the returned file stays open (close it to release). The kernel
    releases a flock when its process ends, however it ends (SIGKILL included), so a crashed run leaves
    the file but no lock, and the next run takes it. The holder writes its pid, host and start time
    into the file (then ``about``, if given), for a refused run to name it: DirectoryHeld, when another
    live process holds the lock. Returns None where there is no flock (Windows).

    The file is never deleted: a run that removed it on exit could leave another run locking the removed
    file while a third locks a new one."""
    os.makedirs(directory, exist_ok=True)
    if fcntl is None:
        return None
    f = open(os.path.join(directory, LOCK_NAME), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise DirectoryHeld(held_message(directory)) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            f"{about}\n")
    f.flush()
    return f


def open_checkpoints(directory: str) -> ocp.CheckpointManager:
    """Orbax's manager for ``directory``, keeping the last two complete checkpoints; what a killed run
    left half-written there is deleted."""
    return ocp.CheckpointManager(os.path.abspath(directory), item_handlers=ocp.StandardCheckpointHandler(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, cleanup_tmp_directories=True))


def save(manager: ocp.CheckpointManager, step: int, state) -> None:
    """Starts writing ``state`` (a pytree of jax arrays) as checkpoint ``step``; the write finishes in
    the background, while training goes on (``manager.wait_until_finished()`` waits for it)."""
    manager.save(step, args=ocp.args.StandardSave(state), force=True)


def restore(manager: ocp.CheckpointManager, step: int, target):
    """Checkpoint ``step`` read into ``target``'s structure, shapes, dtypes and shardings (a pytree of
    ``jax.ShapeDtypeStruct`` with shardings); CheckpointMismatch naming the first array whose saved
    shape differs."""
    where = manager.directory / str(step)
    saved = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(
        manager.item_metadata(step).tree)[0]}
    wanted = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(target)[0]}
    if saved.keys() != wanted.keys():
        raise CheckpointMismatch(f"{where} holds the arrays {sorted(saved)}, the model has {sorted(wanted)}")
    for key, want in wanted.items():
        if tuple(saved[key].shape) != tuple(want.shape):
            raise CheckpointMismatch(f"{where} holds {key} of shape {tuple(saved[key].shape)}, the model's is "
                                     f"{tuple(want.shape)}")
    return manager.restore(step, args=ocp.args.StandardRestore(target))
