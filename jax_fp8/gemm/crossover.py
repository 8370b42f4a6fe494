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
#: Each GPU's: ``python3 bench/bench_gemm.py --crossover --iters 20 --grid-m ...`` (M 4096, 8192, 16384 x K, N
#: 512 to 14336), jax 0.11.2, cuBLASLt's heuristic kernels. The H100's 2026-12-07 (bench/RESULTS.md, section
#: "Issues 48-49, seventh session"; bench/logs/h100_crossover.json); the H200's 2026-12-07 (section "Issues
#: 48-49, ninth session"; bench/logs/h200_crossover.json).
TABLES: dict[str, dict[str, list]] = {
    "NVIDIA H100 80GB HBM3": {
        "blockwise": [((4096, 512, 512), 1.0325), ((4096, 512, 1024), 0.8264), ((4096, 512, 2048), 0.8119),
                      ((4096, 1024, 512), 0.8797), ((4096, 1024, 1024), 1.1073), ((4096, 1024, 2048), 0.832),
                      ((4096, 1024, 4096), 0.9581), ((4096, 2048, 512), 0.7749), ((4096, 2048, 1024), 0.8417),
                      ((4096, 2048, 2048), 0.9853), ((4096, 2048, 4096), 1.1407), ((4096, 2048, 8192), 1.2414),
                      ((4096, 4096, 1024), 0.94), ((4096, 4096, 2048), 1.133), ((4096, 4096, 4096), 1.244),
                      ((4096, 4096, 8192), 1.2617), ((4096, 4096, 14336), 1.2655), ((4096, 8192, 2048), 1.1645),
                      ((4096, 8192, 4096), 1.2607), ((4096, 8192, 8192), 1.2786), ((4096, 8192, 14336), 1.3251),
                      ((4096, 14336, 4096), 1.2708), ((4096, 14336, 8192), 1.3447),
                      ((4096, 14336, 14336), 1.4067), ((16384, 512, 512), 0.7014), ((16384, 512, 1024), 0.7446),
                      ((16384, 512, 2048), 0.825), ((16384, 1024, 512), 0.7461), ((16384, 1024, 1024), 0.8613),
                      ((16384, 1024, 2048), 1.0214), ((16384, 1024, 4096), 1.101), ((16384, 2048, 512), 0.793),
                      ((16384, 2048, 1024), 1.0323), ((16384, 2048, 2048), 1.1925), ((16384, 2048, 4096), 1.2009),
                      ((16384, 2048, 8192), 1.2263), ((16384, 4096, 1024), 1.1044), ((16384, 4096, 2048), 1.2029),
                      ((16384, 4096, 4096), 1.2518), ((16384, 4096, 8192), 1.379), ((16384, 4096, 14336), 1.4595),
                      ((16384, 8192, 2048), 1.2087), ((16384, 8192, 4096), 1.3327), ((16384, 8192, 8192), 1.489),
                      ((16384, 8192, 14336), 1.4342), ((16384, 14336, 4096), 1.3849),
                      ((16384, 14336, 8192), 1.4395), ((16384, 14336, 14336), 1.4396), ((8192, 512, 512), 0.8105),
                      ((8192, 512, 1024), 0.8659), ((8192, 512, 2048), 0.8248), ((8192, 1024, 512), 0.8826),
                      ((8192, 1024, 1024), 0.8359), ((8192, 1024, 2048), 0.9336), ((8192, 1024, 4096), 1.055),
                      ((8192, 2048, 512), 0.8084), ((8192, 2048, 1024), 0.8305), ((8192, 2048, 2048), 1.0707),
                      ((8192, 2048, 4096), 1.1651), ((8192, 2048, 8192), 1.2224), ((8192, 4096, 1024), 0.9942),
                      ((8192, 4096, 2048), 1.2435), ((8192, 4096, 4096), 1.3048), ((8192, 4096, 8192), 1.2929),
                      ((8192, 4096, 14336), 1.3312), ((8192, 8192, 2048), 1.2022), ((8192, 8192, 4096), 1.296),
                      ((8192, 8192, 8192), 1.3366), ((8192, 8192, 14336), 1.4481), ((8192, 14336, 4096), 1.3304),
                      ((8192, 14336, 8192), 1.4315), ((8192, 14336, 14336), 1.4333)],
    },
    "NVIDIA H200": {
        "blockwise": [((8192, 512, 512), 0.5406), ((8192, 512, 1024), 0.5298), ((8192, 512, 2048), 0.6707),
                      ((8192, 1024, 512), 0.5601), ((8192, 1024, 1024), 0.7085), ((8192, 1024, 2048), 0.9299),
                      ((8192, 1024, 4096), 1.1069), ((8192, 2048, 512), 0.6972), ((8192, 2048, 1024), 0.9393),
                      ((8192, 2048, 2048), 1.1414), ((8192, 2048, 4096), 1.2619), ((8192, 2048, 8192), 1.3092),
                      ((8192, 4096, 1024), 1.1026), ((8192, 4096, 2048), 1.2589), ((8192, 4096, 4096), 1.3625),
                      ((8192, 4096, 8192), 1.3637), ((8192, 4096, 14336), 1.3966), ((8192, 8192, 2048), 1.2804),
                      ((8192, 8192, 4096), 1.3755), ((8192, 8192, 8192), 1.4214), ((8192, 8192, 14336), 1.4648),
                      ((8192, 14336, 4096), 1.3863), ((8192, 14336, 8192), 1.4346), ((8192, 14336, 14336), 1.4771),
                      ((4096, 512, 512), 0.737), ((4096, 512, 1024), 0.8337), ((4096, 512, 2048), 0.7224),
                      ((4096, 1024, 512), 0.6524), ((4096, 1024, 1024), 0.6888), ((4096, 1024, 2048), 0.8588),
                      ((4096, 1024, 4096), 0.9295), ((4096, 2048, 512), 0.8171), ((4096, 2048, 1024), 0.8752),
                      ((4096, 2048, 2048), 0.9748), ((4096, 2048, 4096), 1.161), ((4096, 2048, 8192), 1.2371),
                      ((4096, 4096, 1024), 0.9411), ((4096, 4096, 2048), 1.1252), ((4096, 4096, 4096), 1.3782),
                      ((4096, 4096, 8192), 1.3473), ((4096, 4096, 14336), 1.3668), ((4096, 8192, 2048), 1.2502),
                      ((4096, 8192, 4096), 1.3265), ((4096, 8192, 8192), 1.3868), ((4096, 8192, 14336), 1.401),
                      ((4096, 14336, 4096), 1.3424), ((4096, 14336, 8192), 1.4047), ((4096, 14336, 14336), 1.4374),
                      ((16384, 512, 512), 0.3965), ((16384, 512, 1024), 0.6033), ((16384, 512, 2048), 0.6918),
                      ((16384, 1024, 512), 0.5068), ((16384, 1024, 1024), 0.7279), ((16384, 1024, 2048), 1.0438),
                      ((16384, 1024, 4096), 1.1956), ((16384, 2048, 512), 0.6847), ((16384, 2048, 1024), 1.0495),
                      ((16384, 2048, 2048), 1.254), ((16384, 2048, 4096), 1.2685), ((16384, 2048, 8192), 1.3014),
                      ((16384, 4096, 1024), 1.1464), ((16384, 4096, 2048), 1.2733), ((16384, 4096, 4096), 1.3377),
                      ((16384, 4096, 8192), 1.403), ((16384, 4096, 14336), 1.4129), ((16384, 8192, 2048), 1.2936),
                      ((16384, 8192, 4096), 1.3782), ((16384, 8192, 8192), 1.4752), ((16384, 8192, 14336), 1.4595),
                      ((16384, 14336, 4096), 1.3953), ((16384, 14336, 8192), 1.465), ((16384, 14336, 14336), 1.4671)],
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
