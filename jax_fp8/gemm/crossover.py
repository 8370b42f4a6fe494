"""Where FP8 pays: per GPU and recipe, the linear-layer shapes (M rows, K in, N out) at which a layer's
forward + backward on :func:`jax_fp8.fp8_dot_general`, quantization included, ran faster than the same
layer in bf16 (``python bench/bench_gemm.py --crossover``, measured side by side, rows checked in
below with the shapes they were measured at). ``where="auto"`` (:mod:`jax_fp8.flax_utils`) asks
:func:`fp8_pays` when it traces each projection and keeps ``lax.dot_general`` where the nearest
measured shape, in (log M, log K, log N), did not gain, as torchao's float8 training filters layers.

The shapes asked about are one device's GEMM: inside ``shard_map`` the local arrays'; under ``jit``
each device's share where the operands' types say how they are split (Explicit mesh axes), else the
global shapes (Auto axes are split only when XLA compiles).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

from ..formats import BLOCKWISE
from ..primitives.partitioning import explicit_sharding
from ..tensors import QUANTIZED_TENSORS
from ..warn import CrossoverWarning, warn
from .plan import fold_dot_general
from .table import local_device_kind, nearest, read_rows

#: device kind (``jax.Device.device_kind``) -> recipe ("blockwise" or "mxfp8") -> rows
#: ((M, K, N), bf16 time / FP8 time of the layer's forward + backward); FP8 pays where the ratio > 1.
#: The H200's: the LINEAR lines of ``python3 bench/bench_gemm.py --iters 20`` (the same quantity as
#: ``--crossover``, at its square and model shapes), 2026-12-05, jax 0.11.2, cuBLASLt's heuristic kernels
#: (bench/RESULTS.md, section "GEMM backends, the kernel table, CUDA graphs,
#: where="auto""). Four shapes only: a denser grid (``--crossover``) is to be measured.
TABLES: dict[str, dict[str, list]] = {
    "NVIDIA H200": {
        "blockwise": [((2048, 2048, 2048), 0.88), ((4096, 4096, 4096), 1.24), ((8192, 8192, 8192), 1.41),
                      ((16384, 4096, 4096), 1.37)],
    },
}


def recipe_name(recipe) -> str:
    """The tables' key of a recipe: ``"mxfp8"`` for MXFP8 (E8M0 scales), else ``"blockwise"``."""
    return recipe.scheme("lhs").format.name if recipe is not None else BLOCKWISE.name


def fp8_pays(M: int, K: int, N: int, recipe=None, device_kind: Optional[str] = None) -> bool:
    """Whether a linear layer of (M, K) x (K, N) gained in FP8 on this GPU (``device_kind``: the first
    local device's when None) with ``recipe`` (None: Float8 blockwise): the nearest measured shape's
    answer. Without a table for the GPU and recipe: True (FP8 everywhere), with one
    :class:`CrossoverWarning` per GPU and recipe."""
    kind = local_device_kind() if device_kind is None else device_kind
    name = recipe_name(recipe)
    rows = TABLES.get(kind, {}).get(name)
    if not rows:
        _warn_unmeasured(kind, name)
        return True
    return nearest(rows, M, K, N)[1] > 1.0


def layer_pays(lhs, rhs, dimension_numbers, recipe=None) -> bool:
    """:func:`fp8_pays` for one ``dot_general(lhs, rhs, dimension_numbers)`` call, at the shapes of one
    device's GEMM (module doc); True where the call is no linear layer the recipe's GEMM takes (then
    ``fp8_dot_general`` decides, as it would without ``where``)."""
    fold, why = fold_dot_general(lhs.shape, rhs.shape, dimension_numbers)
    if why is not None or isinstance(lhs, QUANTIZED_TENSORS) or isinstance(rhs, QUANTIZED_TENSORS):
        return True
    M, K, N = fold.sizes(_device_share(lhs), _device_share(rhs))  # the folded GEMM's, on one device
    if min(M, K, N) <= 0:
        return True
    return fp8_pays(M, K, N, recipe)


def load(path_or_rows, device_kind: Optional[str] = None) -> None:
    """Adds rows to :data:`TABLES` (replacing the GPU's rows for the recipes given): a JSON file as
    ``bench/bench_gemm.py --crossover-out`` writes it (``{"device_kind": ..., "rows": {recipe: [[[M, K,
    N], ratio], ...]}}``), or that dict. Call it before tracing the functions it should steer."""
    kind, rows = read_rows(path_or_rows, device_kind, "jax_fp8.gemm.crossover.load", ("blockwise", "mxfp8"),
                           "[[M, K, N], ratio]")
    for name, entries in rows.items():
        TABLES.setdefault(kind, {})[name] = [(tuple(int(v) for v in mkn), float(r)) for mkn, r in entries]


def _device_share(x) -> tuple:
    """``x``'s shape, each dim divided by the mesh axes its Explicit type splits it over."""
    s = explicit_sharding(x)
    if s is None:
        return tuple(x.shape)
    spec = tuple(s.spec) + (None,) * (len(x.shape) - len(tuple(s.spec)))
    sizes = dict(s.mesh.shape)
    split = [math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in spec]
    return tuple(-(-d // n) for d, n in zip(x.shape, split))


@functools.lru_cache(maxsize=None)
def _warn_unmeasured(kind: str, name: str) -> None:
    warn(f"jax_fp8: where='auto' has no crossover table for {kind!r} and the {name} recipe: every projection "
         "runs in FP8 (measure one with `python bench/bench_gemm.py --crossover --crossover-out F` on this GPU "
         "and pass it to jax_fp8.gemm.crossover.load)", CrossoverWarning)
