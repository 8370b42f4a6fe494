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


def open_checkpoints(directory: str, every: int) -> ocp.CheckpointManager:
    """Orbax's manager for ``directory``: saves every ``every`` steps (and when forced), in the
    background, keeping the last two complete checkpoints."""
    return ocp.CheckpointManager(os.path.abspath(directory), item_handlers=ocp.StandardCheckpointHandler(),
                                 options=ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=2))


def save(manager: ocp.CheckpointManager, step: int, state, force: bool = False) -> bool:
    """Starts writing ``state`` (a pytree of jax arrays) as checkpoint ``step`` when it is due or
    ``force``; returns whether it did. The write finishes in the background."""
    return manager.save(step, args=ocp.args.StandardSave(state), force=force)


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
