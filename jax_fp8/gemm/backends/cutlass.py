"""The CUTLASS backend (Hopper, sm_90a; Float8 blockwise), lowered under ``jf_fp8_gemm`` to our handler
``jf_cutlass_gemm``: CUTLASS's blockwise-scaled FP8 mainloop
(``KernelTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise``, CUTLASS >= 4.2), compiled into the
optional module ``_jax_fp8_cutlass`` (build with ``JAX_FP8_CUTLASS=1``; csrc/cutlass_gemm.cuh, the handler
in csrc/cutlass_module.cu). The contract is :mod:`jax_fp8.gemm.contract`'s, the same as cuBLASLt's
(:mod:`.cublaslt`), for ``a`` in 1x128 blocks and ``b`` in 128x128 ("1D x 2D": fprop, dgrad) or 1x128
blocks ("1D x 1D": wgrad); ``a`` in 128x128 blocks is not implemented.

Options (``CUTLASS.with_options(...)``; each absent one takes its default):

- ``config`` (default 0): the kernel configuration, an index into :data:`CONFIGS`
  (``"128x128x128_c1x1_coop"``, ``"128x128x128_c1x2_coop"``, ``"64x128x128_c1x1_pingpong"``,
  ``"128x128x128_c1x1_coop_overlap"``, ``"128x128x128_c1x2_coop_overlap"``,
  ``"256x128x128_c1x2_coop_split"``, ``"128x128x128_c1x2_coop_ordered"``: CTA tile M x N x K, cluster
  shape M x N, cooperative or ping-pong warp-specialized schedule; ``_overlap``: each k tile's scale
  promotion runs while the next tile's MMAs do (csrc/cutlass_overlap.cuh); ``_split``: the MMAs and
  promotion of a 256-row tile one 64-row atom at a time, so its temporaries fit in registers
  (csrc/cutlass_split.cuh); ``_ordered``: the two consumer warp groups issue each k tile's MMAs in turn,
  so one's promotion runs under the other's MMAs, with the ``_coop`` kernels' bits
  (csrc/cutlass_ordered.cuh); with any of these three, a call without ``c`` runs a kernel whose epilogue
  has no C operand);
- ``raster`` (default 0): the persistent tile scheduler's raster order, 0 CUTLASS's heuristic (along M
  when the problem has more tiles along N than along M, else along N), 1 along M, 2 along N;
- ``swizzle`` (default 1): the scheduler's swizzle size, 1, 2, 4 or 8 (tiles walked in groups of that
  many along the raster's minor dimension, for L2 reuse).

The kernel's workspace is a result buffer of the custom call (``WORKSPACE_BYTES``, the lowering adds it),
not XLA's scratch allocator, so the handler is declared command-buffer compatible (CUDA graphs).
"""
from __future__ import annotations

import importlib
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ... import _ffi
from ...formats import BLOCKWISE
from .. import table
from ..contract import BLOCK_1D, BLOCK_2D, GemmBackend, cuda_capabilities, lower_with_workspace, padded_sizes, refused

#: The kernel configurations, in ``config`` index order: a copy of the module's ``configs`` (checked
#: against it when the module loads; a mismatch makes the backend unavailable: a stale build).
CONFIGS = ("128x128x128_c1x1_coop", "128x128x128_c1x2_coop", "64x128x128_c1x1_pingpong",
           "128x128x128_c1x1_coop_overlap", "128x128x128_c1x2_coop_overlap", "256x128x128_c1x2_coop_split",
           "128x128x128_c1x2_coop_ordered")
#: Options and their defaults (see the module docstring).
DEFAULT_OPTIONS = {"config": 0, "raster": 0, "swizzle": 1}
RASTERS = {0: "heuristic", 1: "along M", 2: "along N"}
SWIZZLES = (1, 2, 4, 8)

#: The kernel's alignment (TMA: 16-byte strides): K % 16 (FP8 rows of a and b); N % 8 (bfloat16 output
#: rows; 4 would do for float32, but ``sizes`` does not know the output dtype); M % 4 when b has 128x128
#: blocks (a's scale rows, roundup(M, 4) floats, are loaded by TMA then, which CUTLASS's can_implement
#: checks as M % 4). Zero padding to them changes no product and no scale grid (4, 8, 16 divide 128).
K_ALIGN, N_ALIGN, M_ALIGN_2D = 16, 8, 4
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def _load():
    """(module, why not): the compiled module when it loaded and matches this file, else (None, why)."""
    if not _ffi.AVAILABLE.get("cutlass"):
        why = _ffi.LOAD_ERRORS.get("cutlass")
        return None, ("the jax_fp8 CUTLASS module is not built (rebuild with JAX_FP8_CUTLASS=1 and "
                      "`pip install nvidia-cutlass`: see the README)" + (f"; import error: {why}" if why else ""))
    try:
        mod = importlib.import_module("jax_fp8._jax_fp8_cutlass")
        configs = tuple(mod.configs)
        workspace = int(mod.workspace_bytes)
        pairs = tuple((jnp.dtype(a), jnp.dtype(b)) for a, b in mod.dtype_pairs)
    except Exception as e:  # an old build without the attributes
        return None, f"the jax_fp8 CUTLASS module is stale ({e}): rebuild it"
    if configs != CONFIGS:
        return None, (f"the jax_fp8 CUTLASS module's configurations {configs} are not this version's {CONFIGS}: "
                      "rebuild it")
    return (mod, workspace, pairs), None


_MODULE, _MODULE_WHY = _load()
#: Bytes of the uint8 workspace result the lowering allocates (the module's constant; it checks per call
#: that the kernel needs no more).
WORKSPACE_BYTES = _MODULE[1] if _MODULE else 256
#: (a dtype, b dtype) pairs with kernels: E4M3 x E4M3; with a build of JAX_FP8_CUTLASS_E5M2=1 also
#: E5M2 x E4M3 and E4M3 x E5M2.
DTYPE_PAIRS = _MODULE[2] if _MODULE else ((E4M3, E4M3),)


def sizes(M: int, N: int, K: int, a_block, b_block, a_dtype, b_dtype) -> tuple[Optional[tuple], Optional[str]]:
    """The (M, N, K) to run ``a`` (M, K) x ``b`` (N, K)ᵀ at on the CUTLASS kernels (zero-padded, >= the
    problem's), or why they cannot take it.

    Rules: ``a`` in 1x128 blocks, ``b`` in 128x128 or 1x128 blocks; operand dtypes one of
    :data:`DTYPE_PAIRS` (never both E5M2); K % 16 == 0; N % 8 == 0; M % 4 == 0 when ``b`` has 128x128
    blocks; dims below 2**31. Misaligned dims are padded with zeros when the padded GEMM does at most
    :data:`~jax_fp8.gemm.contract.MAX_PAD_GROWTH` times the work."""
    a_block, b_block = tuple(a_block), tuple(b_block)
    if a_block != BLOCK_1D:
        return None, "128x128 blocks on a (the CUTLASS kernels take a in 1x128 blocks: 1D x 2D and 1D x 1D)"
    if b_block not in (BLOCK_1D, BLOCK_2D):
        return None, f"{b_block[0]}x{b_block[1]} blocks on b"
    why = refused(M, N, K, a_dtype, b_dtype)
    if why is not None:
        return None, why
    dtypes = (jnp.dtype(a_dtype), jnp.dtype(b_dtype))
    if dtypes not in DTYPE_PAIRS:
        return None, (f"{dtypes[0].name} x {dtypes[1].name} operands (this build has kernels for "
                      f"{', '.join(f'{a.name} x {b.name}' for a, b in DTYPE_PAIRS)}; rebuild with "
                      "JAX_FP8_CUTLASS_E5M2=1 for an E5M2 operand)")
    return padded_sizes("CUTLASS", M, N, K, (M_ALIGN_2D if b_block == BLOCK_2D else 1, N_ALIGN, K_ALIGN))


def check_options(config: int = DEFAULT_OPTIONS["config"], raster: int = DEFAULT_OPTIONS["raster"],
                  swizzle: int = DEFAULT_OPTIONS["swizzle"]) -> None:
    """Raises ValueError naming the first option out of range."""
    _check_kernel_options("jf_fp8_gemm", CONFIGS, config, raster, swizzle)


def _check_kernel_options(who: str, configs: tuple, config, raster, swizzle=1) -> None:
    """Raises ValueError naming the first option out of range, for ``who``'s kernels ``configs``."""
    if not 0 <= int(config) < len(configs):
        raise ValueError(f"{who} on cutlass: config must be in [0, {len(configs)}) ({configs}), got {config}")
    if int(raster) not in RASTERS:
        raise ValueError(f"{who} on cutlass: raster must be 0 (the default), 1 (along M) or 2 (along N), got {raster}")
    if int(swizzle) not in SWIZZLES:
        raise ValueError(f"{who} on cutlass: swizzle must be one of {SWIZZLES}, got {swizzle}")


def _lower(ctx, a, a_scale, b, b_scale, *c, a_block, b_block, out_dtype, accumulate,
           config=DEFAULT_OPTIONS["config"], raster=DEFAULT_OPTIONS["raster"], swizzle=DEFAULT_OPTIONS["swizzle"]):
    # the options were checked when the variant was made (CUTLASS.with_options)
    return lower_with_workspace("jf_cutlass_gemm", ctx, WORKSPACE_BYTES, a, a_scale, b, b_scale, *c,
                                a_block_rows=np.int64(a_block[0]), b_block_rows=np.int64(b_block[0]),
                                config=np.int64(config), raster=np.int64(raster), swizzle=np.int64(swizzle))


def unavailable(platform: str = "cuda", devices: Optional[Sequence] = None) -> Optional[str]:
    """None when ``jf_fp8_gemm`` runs on the CUTLASS kernels (the module built and loaded, every GPU of
    ``devices``, those compiled for, else of this process, sm_90: the kernels are sm_90a code); else why
    not, in words. Never raises."""
    if _MODULE is None:
        return _MODULE_WHY
    caps, why = cuda_capabilities(devices)
    if why is not None:
        return why
    if caps != {"9.0"}:
        return f"the CUTLASS FP8 kernels are built for sm_90a (H100/H200); the CUDA devices are sm {sorted(caps)}"
    return None


CUTLASS = GemmBackend("cutlass", sizes, unavailable, lowerings={"cuda": _lower}, formats=(BLOCKWISE,),
                      check_options=check_options)


# ---- the grouped GEMMs of fp8_ragged_dot (jax_fp8.gemm.ragged_primitive; csrc/cutlass_ragged.cuh) ----------
_RAGGED_KINDS = {"m": 0, "k": 1}
#: The grouped kernels' configurations, in ``config`` index order (the module's ``ragged_configs``): CTA
#: tile M x N x K and cluster shape M x N, cooperative; 1x2: two CTAs of a row of tiles share a's loads;
#: ``_split``: the 256-row tile's MMAs and promotion one 64-row atom at a time (csrc/cutlass_split.cuh);
#: ``_ordered``: the two consumer warp groups' MMAs in turns, the ``_coop`` kernels' bits
#: (csrc/cutlass_ordered.cuh).
RAGGED_CONFIGS = ("128x128x128_c1x1_coop", "128x128x128_c1x2_coop", "256x128x128_c1x2_coop_split",
                  "128x128x128_c1x2_coop_ordered")
#: The grouped kernels' options and defaults: ``config`` (:data:`RAGGED_CONFIGS`) and the scheduler's
#: ``raster`` (0 and 1: along M; 2 along N). No swizzle: CUTLASS's grouped scheduler sizes it from host
#: problem shapes, and with the group sizes on the device it is always 1 (csrc/cutlass_ragged.cuh).
DEFAULT_RAGGED_OPTIONS = {"config": 0, "raster": 0}


def ragged_key(kind: str, M: int, N: int, K: int, groups: int = 1) -> tuple:
    """The GEMM table's key of a grouped problem of ``kind`` ("m": all groups' M rows x N x K; "k": each
    group's R x N, K the rows) over ``groups`` groups: one group's mean problem (its rows: rows / groups,
    rounded up)."""
    per_group = lambda rows: -(-rows // max(groups, 1))  # noqa: E731
    return (per_group(M), N, K) if kind == "m" else (M, N, per_group(K))


def ragged_options(kind: str, M: int, N: int, K: int, groups: int = 1, device_kind: Optional[str] = None) -> dict:
    """The grouped kernel's options for a problem of ``kind`` (as :func:`ragged_key` takes it): the GEMM
    table's row for ``"ragged_<kind>"`` nearest to its key on this GPU (:mod:`jax_fp8.gemm.table`), over
    :data:`DEFAULT_RAGGED_OPTIONS`. Raises ValueError naming an option out of range."""
    chosen = table.choose_for(f"ragged_{kind}", *ragged_key(kind, M, N, K, groups), device_kind)
    options = dict(DEFAULT_RAGGED_OPTIONS, **(chosen[1] if chosen and chosen[0] == "cutlass" else {}))
    unknown = set(options) - set(DEFAULT_RAGGED_OPTIONS)
    if unknown:
        raise ValueError(f"jf_fp8_ragged_gemm on cutlass: unknown options {sorted(unknown)} (the options: "
                         f"{sorted(DEFAULT_RAGGED_OPTIONS)})")
    _check_kernel_options("jf_fp8_ragged_gemm", RAGGED_CONFIGS, options["config"], options["raster"])
    return options


def ragged_unavailable(kind: str, avals: Sequence, out_dtype, devices: Optional[Sequence] = None) -> Optional[str]:
    """None when ``jf_fp8_ragged_gemm`` of operands ``avals`` (a, a_scale, b, b_scale, ...) runs on the
    CUTLASS grouped kernels here; else why not. Their rules: E4M3 operands; kind "m" K % 16; kind "k"
    R % 4 and N % 4 (the scale rows unpadded); N % 8 for bfloat16 out, % 4 for float32 (16-byte rows)."""
    why = unavailable("cuda", devices)
    if why is not None:
        return why
    if tuple(getattr(_MODULE[0], "ragged_configs", ())) != RAGGED_CONFIGS:
        return "the jax_fp8 CUTLASS module's grouped GEMMs are not this version's (an older build): rebuild it"
    if {jnp.dtype(avals[0].dtype), jnp.dtype(avals[2].dtype)} != {E4M3}:
        return "the grouped kernels take float8_e4m3fn operands"
    a, _, b = (v.shape for v in avals[:3])
    N = b[1] if kind == "m" else b[0]
    n_align = 8 if jnp.dtype(out_dtype) == jnp.bfloat16 else 4
    problems = [f"N = {N} is not a multiple of {n_align}"] * bool(N % n_align)
    if kind == "m" and a[1] % K_ALIGN:
        problems.append(f"K = {a[1]} is not a multiple of {K_ALIGN}")
    if kind == "k" and a[0] % 4:
        problems.append(f"R = {a[0]} is not a multiple of 4")
    return "; ".join(problems) or None


def ragged_lowering(ctx, a, a_scale, b, b_scale, group_sizes, group_offset, *, kind, rows, groups_out, out_dtype):
    """``jf_fp8_ragged_gemm``'s custom call ``jf_cutlass_ragged_gemm``, its workspace (the per-group
    arguments the device builds, and the kernel's own) one more result."""
    (a_shape, _, b_shape, _, (G,), _), out = (v.shape for v in ctx.avals_in), ctx.avals_out[0]
    if kind == "m":
        (M, K), (Gl, N) = a_shape, b_shape[:2]
        Mc = 0
    else:
        (K, Mc), N, M, Gl = a_shape, b_shape[0], rows, groups_out
    opts = ragged_options(kind, M if kind == "m" else K, N, K if kind == "m" else M, G)
    workspace = _MODULE[0].ragged_workspace_bytes(_RAGGED_KINDS[kind], M, N, K, G, Gl, Mc, jnp.dtype(out.dtype).name,
                                                  int(opts["config"]))
    return lower_with_workspace("jf_cutlass_ragged_gemm", ctx, workspace, a, a_scale, b, b_scale, group_sizes,
                                group_offset, kind=np.int64(_RAGGED_KINDS[kind]), rows=np.int64(rows),
                                **{k: np.int64(v) for k, v in opts.items()})
