"""Helper module, not an example to run: ``shard_map_model.py``'s checkpoints, on Orbax.

Every process calls the same functions; Orbax writes each array's shards from the processes that hold
them, into a temporary folder renamed to the step's number once every process has written (so a
checkpoint cut short by a crash is never the latest), and reads them back laid out by the shardings
the caller asks for: a checkpoint saved on one mesh restores onto another.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class CheckpointMismatch(ValueError):
    """The checkpoint's arrays do not have the shapes the caller's model needs."""


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
