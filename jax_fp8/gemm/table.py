"""Which kernel runs a Float8 blockwise GEMM, per GPU and shape: a table measured on the GPU and checked
in (``bench/bench_gemm_tune.py`` times every candidate: each of cuBLASLt's heuristic algorithms, each
CUTLASS configuration, and prints the rows).

A checked-in table rather than a first-call autotuner: the choice is made when a function is traced
(the plan), where timing kernels would mean running them on the device, a host sync and a choice that
varies from run to run (so from compile to compile); a table gives every process of a multi-host job
the same kernels, costs nothing at run time, and is reviewed like code. A GEMM whose GPU has no table
runs the first backend of :data:`jax_fp8.gemm.backends.BACKENDS` that takes it, on that library's own
choice (cuBLASLt's heuristic). Users with another GPU add their rows with :func:`load`.

A row: ``((M, N, K), backend name, options)`` for a pair of blocks, ``"1D2D"`` (a 1x128, b 128x128:
fprop and dgrad) or ``"1D1D"`` (both 1x128: wgrad); a problem takes the row nearest to it in
(log M, log N, log K), but a row naming one of cuBLASLt's heuristic candidates (``algo``: an index into
the list cuBLASLt makes for each problem) only its own shape. The grouped GEMMs of ``fp8_ragged_dot`` have
rows of their own, keyed by one group's mean problem (what sets a grouped kernel's best tile: how long
each tile's mainloop runs, how often the groups change under a CTA), ``"ragged_m"`` (forward, dgrad:
rows / G x N x K) and ``"ragged_k"`` (wgrad: R x N x rows / G), naming the CUTLASS grouped kernels' options
(:func:`jax_fp8.gemm.backends.cutlass.ragged_options`).
"""
from __future__ import annotations

import functools
import json
import math
from typing import Optional

#: device kind (``jax.Device.device_kind``) -> pair -> rows ((M, N, K), backend, options). The H200's:
#: ``python3 bench/bench_gemm_tune.py`` (run_gpu.sh TUNE=1), 2026-12-05, jax 0.11.2, cuBLASLt 13.1, every
#: cuBLASLt candidate and CUTLASS configuration timed per problem (bench/RESULTS.md, section "GEMM
#: backends, the kernel table, CUDA graphs, where="auto""); a row picks another kernel than cuBLASLt's
#: heuristic where it measured at least 1% faster (the gain in the comment).
TABLE: dict[str, dict[str, list]] = {
    "NVIDIA H200": {
        "1D2D": [
            ((2048, 2048, 2048), "cutlass", {"config": 0, "raster": 2, "swizzle": 8}),  # 1.020x
            ((4096, 4096, 4096), "cublaslt", {}),
            ((8192, 8192, 8192), "cublaslt", {}),
            ((16384, 4096, 512), "cublaslt", {"algo": 0}),  # 1.025x
            ((16384, 4096, 4096), "cutlass", {"config": 0}),  # 1.061x
            ((16384, 4096, 14336), "cublaslt", {}),
            ((16384, 14336, 4096), "cublaslt", {}),
        ],
        "1D1D": [
            ((2048, 2048, 2048), "cutlass", {"config": 0, "raster": 2, "swizzle": 4}),  # 1.016x
            ((4096, 512, 16384), "cublaslt", {"algo": 0}),  # 1.028x
            ((4096, 4096, 4096), "cublaslt", {}),
            ((4096, 4096, 16384), "cublaslt", {"algo": 0}),  # 1.010x
            ((4096, 14336, 16384), "cublaslt", {}),
            ((8192, 8192, 8192), "cublaslt", {}),
            ((14336, 4096, 16384), "cublaslt", {}),
        ],
        # ``bench_ragged.py --experts 8,256 --rows 16384 --tune --routing balanced``, 2026-12-07 (RESULTS,
        # "Issues 48-49, ninth session"): 8 experts of 2048 rows and 256 of 128, K 7168, N 2048. The
        # forward's best options were within 1% of its defaults (1.008x, 1.006x), so it keeps them.
        "ragged_k": [
            ((7168, 2048, 2048), "cutlass", {"config": 1, "raster": 2}),  # 1.071x
            ((7168, 2048, 128), "cutlass", {"config": 0, "raster": 2}),  # 1.025x
        ],
    },
    # The H100's grouped rows, ``bench_ragged.py --experts 8 --rows 16384 --routing balanced --tune``, 2026-12-07
    # (RESULTS, "Issues 48-49, eleventh session"): 8 experts of 2048 rows, K 7168, N 2048; and at 32 experts of
    # 512 rows (thirteenth session; its wgrad's best, the 256-row tile, is the 2048-row row's). Its dense rows would all name
    # cuBLASLt's heuristic, the default. The forward keeps the 128-row tile: the 256-row one (config 2)
    # measured 0.3% faster at 2048 rows per expert but would run half empty where experts hold 128 rows.
    "NVIDIA H100 80GB HBM3": {
        "ragged_m": [
            ((512, 2048, 7168), "cutlass", {"config": 0, "raster": 0}),  # the default: 1.043x the next row's options
            ((2048, 2048, 7168), "cutlass", {"config": 1, "raster": 2}),  # 1.088x
        ],
        "ragged_k": [
            ((7168, 2048, 2048), "cutlass", {"config": 2, "raster": 1}),  # 1.304x
        ],
    },
}
#: The table's keys: the dense GEMMs' block pairs, then the grouped GEMMs' kinds.
KEYS = ("1D2D", "1D1D", "2D1D", "ragged_m", "ragged_k")
#: (backend, option) pairs that index a list made per problem (cuBLASLt's heuristic candidates for that
#: M, N, K): a row with one answers for its own shape only, never for the nearest.
PER_PROBLEM = {("cublaslt", "algo")}


def pair(a_block, b_block) -> str:
    """The table's name of a block pair: ``"1D2D"``, ``"1D1D"`` or ``"2D1D"``."""
    return "".join("1D" if tuple(b)[0] == 1 else "2D" for b in (a_block, b_block))


def nearest(rows: list, M: int, N: int, K: int):
    """The row whose (M, N, K) is nearest to the problem in log space (ties: the first)."""
    at = [math.log2(max(v, 1)) for v in (M, N, K)]
    return min(rows, key=lambda r: sum((math.log2(max(v, 1)) - x) ** 2 for v, x in zip(r[0], at)))


def choose(M: int, N: int, K: int, a_block, b_block, device_kind: Optional[str] = None) -> Optional[tuple]:
    """``(backend name, options dict)`` measured fastest for the nearest shape on ``device_kind`` (the
    first local device's when None), or None where no row covers the GPU or the pair."""
    return choose_for(pair(a_block, b_block), M, N, K, device_kind)


def choose_for(key: str, M: int, N: int, K: int, device_kind: Optional[str] = None) -> Optional[tuple]:
    """:func:`choose` for a table key: a pair (``"1D2D"``, ...) or a grouped GEMM's (``"ragged_m"``,
    ``"ragged_k"``)."""
    kind = local_device_kind() if device_kind is None else device_kind
    rows = [r for r in TABLE.get(kind, {}).get(key, ())
            if r[0] == (M, N, K) or not any((r[1], o) in PER_PROBLEM for o in r[2])]
    if not rows:
        return None
    _, name, options = nearest(rows, M, N, K)
    return name, dict(options)


def load(path_or_rows, device_kind: Optional[str] = None) -> None:
    """Adds rows to :data:`TABLE` (replacing the device's rows for the pairs given): a JSON file as
    ``bench/bench_gemm_tune.py --out`` writes it (``{"device_kind": ..., "rows": {pair: [[[M, N, K],
    backend, {options}], ...]}}``), or that dict. Call it before tracing the functions it should steer."""
    kind, rows = read_rows(path_or_rows, device_kind, "jax_fp8.gemm.table.load", KEYS,
                           "[[M, N, K], backend, {options}]")
    for p, entries in rows.items():
        TABLE.setdefault(kind, {})[p] = [(tuple(int(v) for v in mnk), str(b), dict(o)) for mnk, b, o in entries]


def read_rows(path_or_rows, device_kind: Optional[str], who: str, keys: tuple, row: str) -> tuple[str, dict]:
    """``(device kind, {key: rows})`` of a measured table given as a JSON file or its dict
    (``{"device_kind": ..., "rows": {key: [row, ...]}}``), checked: ``who`` names the caller in errors,
    ``keys`` are the keys allowed, ``row`` says in words what a row is."""
    data = path_or_rows
    if not isinstance(data, dict):
        with open(path_or_rows) as f:
            data = json.load(f)
    kind = device_kind or data.get("device_kind")
    if not kind or not isinstance(data.get("rows"), dict):
        raise ValueError(f"{who}: needs 'device_kind' (or the device_kind argument) and 'rows': {{key: [{row}, ...]}}")
    for key in data["rows"]:
        if key not in keys:
            raise ValueError(f"{who}: unknown key {key!r} in rows (one of {', '.join(keys)})")
    return kind, data["rows"]


@functools.lru_cache(maxsize=None)
def local_device_kind() -> str:
    """The first local device's kind (``jax.Device.device_kind``), e.g. ``"NVIDIA H200"``."""
    import jax

    return jax.local_devices()[0].device_kind
