"""Helper module, not an example to run: the device mesh of ``_transformer.py``'s model under plain
``jax.jit`` (FSDP parameters, a data-parallel batch) and what a compiled step's HLO says about it (its
collectives and memory). ``_transformer`` re-exports every name here.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp")  # the axes the batch splits over (MaxText's ("data", "fsdp")); params: "fsdp"
TILE = 128  # the FP8 weights' 128x128 tiles: a parameter shard along a dim holds whole tiles


def make_mesh(axes: dict) -> jax.sharding.Mesh:
    """A mesh of the first prod(sizes) devices with the named axes ({"data": 4, "fsdp": 2}), every axis
    ``AxisType.Auto`` (the partitioner decides what the unannotated values split over)."""
    names, sizes = tuple(axes), tuple(axes.values())
    n = int(np.prod(sizes))
    return jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])


def batch_axes(mesh) -> tuple:
    """The mesh axes a batch's sequences split over: those of ``MESH_AXES`` the mesh has."""
    return tuple(a for a in MESH_AXES if a in mesh.shape)


def fsdp_spec(shape, shards: int, tile: int = TILE) -> P:
    """FSDP: a parameter (or its optimizer state) of ``shape`` split along one dim over "fsdp" of
    ``shards`` devices: the largest dim whose shards hold whole ``tile``-wide blocks (an FP8 weight's
    128x128 tiles quantize on each shard, and its FP8 bytes are what the GEMM gathers); ties: the last.
    Replicated (``P()``): scalars, 1-D (norm scales), one shard, and a matrix with no such dim (split,
    its shards would break the tiles, and the FP8 GEMM would gather it in bf16 before quantizing)."""
    if len(shape) < 2 or shards == 1:
        return P()
    fits = [d for d, n in enumerate(shape) if n % (shards * tile) == 0]
    if not fits:
        return P()
    dim = max(fits, key=lambda d: (shape[d], d))
    return P(*("fsdp" if d == dim else None for d in range(len(shape))))


def mesh_shardings(state, mesh) -> tuple:
    """(the state's shardings, the batch's): every leaf of ``state`` (parameters, and the optimizer's
    moments, which have their parameters' shapes and so follow them) by :func:`fsdp_spec`; a batch of
    token sequences (batch, seq + 1) split along its sequences over :func:`batch_axes`."""
    shards = mesh.shape.get("fsdp", 1)
    state_sh = jax.tree_util.tree_map(lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), shards)), state)
    axes = batch_axes(mesh)
    return state_sh, NamedSharding(mesh, P(axes if axes else None, None))


def describe_shardings(params, mesh) -> str:
    """One line: the mesh, how the batch and the parameters split (the blocks' alike params as one)."""
    shards = mesh.shape.get("fsdp", 1)
    groups = {}  # (name with block_* , shape, split dim or None) -> count
    small = per_device = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        name = "/".join("block_*" if k.startswith("block_") else k for k in keys if k != "kernel")
        spec = fsdp_spec(x.shape, shards)
        dim = next((d for d, e in enumerate(spec) if e is not None), None)
        per_device += x.size * x.dtype.itemsize // (shards if dim is not None else 1)
        if x.ndim < 2:
            small += 1
        else:
            key = (name, tuple(x.shape), dim)
            groups[key] = groups.get(key, 0) + 1
    show = lambda split: ", ".join(  # noqa: E731
        f"{name} {shape}" + (f" dim {dim}" if split else "") + (f" x{n}" if n > 1 else "")
        for (name, shape, dim), n in groups.items() if (dim is not None) == split) or "none"
    axes = batch_axes(mesh)
    return (f"mesh {' x '.join(f'{a}={n}' for a, n in mesh.shape.items())} ({mesh.size} "
            f"{mesh.devices.flat[0].platform} devices, Auto axes; plain jax.jit, no shard_map): batch sequences split "
            f"over {axes if axes else 'nothing (replicated)'}; params "
            + (f"FSDP over fsdp={shards} along the largest dim of {TILE}-multiple shards: {show(True)}; replicated: "
               f"{show(False)} (no such dim) and the {small} 1-D params" if shards > 1 else "replicated (no fsdp axis)")
            + "; optimizer state as its params; params per device "
              f"{per_device / 1e6:.3f} of {tree_bytes(params) / 1e6:.3f} MB")


_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
              "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVE = re.compile(r"=\s*(.*?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")


def hlo_collectives(hlo_text: str) -> list:
    """The collectives of a compiled (partitioned, per-device) HLO module: (op, dtype, shape) of each
    result (a tuple result: one entry per element; an async ``all-gather-start`` gives (operands,
    results): the results)."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(1))
        if m.group(3) and m.group(2) == "all-gather":
            shapes = shapes[len(shapes) // 2:]
        out += [(m.group(2), dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in shapes]
    return out


def collective_bytes(entry) -> int:
    _, dtype, shape = entry
    size = 1 if "f8" in dtype else _HLO_BYTES.get(dtype, 4)
    return int(np.prod(shape)) * size


def compiled_stats(compiled) -> dict:
    """A compiled step's per-device memory (``memory_analysis``: temp, argument, output bytes; None where
    the backend gives none) and its collectives (:func:`hlo_collectives`)."""
    mem = compiled.memory_analysis()
    if isinstance(mem, (list, tuple)):
        mem = mem[0] if mem else None
    stats = {k: getattr(mem, f"{k}_size_in_bytes", None) if mem is not None else None
             for k in ("temp", "argument", "output", "alias")}
    stats["collectives"] = hlo_collectives(compiled.as_text())
    return stats


def summarize_collectives(entries) -> dict:
    """{op: (count, bytes)} over :func:`hlo_collectives`' entries."""
    out = {}
    for e in entries:
        n, b = out.get(e[0], (0, 0))
        out[e[0]] = (n + 1, b + collective_bytes(e))
    return out


def tree_bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))
