"""jax_fp8's warnings: every class, and ``warn``, which points at the user's line: the first caller outside jax_fp8, jax, jaxlib, flax and
the standard library (a fixed ``stacklevel`` lands inside ``jnp.einsum``, a flax module or a jax
transform when our function is called through them). Other installed packages count as the user's."""
from __future__ import annotations

import os
import sys
import sysconfig
import warnings

import jax


class Fp8Warning(UserWarning):
    """Base of every jax_fp8 warning: ``warnings.filterwarnings("ignore", category=jax_fp8.Fp8Warning)``
    silences them all."""


class ShardingWarning(Fp8Warning):
    """A jax_fp8 op under ``jax.jit`` gathers a sharded dim it cannot split (the message says why)."""


class PartitioningRuleWarning(ShardingWarning):
    """A jax_fp8 partitioning rule failed on these shapes and mesh, a bug in jax_fp8 (the message says
    what failed; please report it): the op runs on whole operands instead, correct but unsplit."""


class Fp8GemmFallbackWarning(Fp8Warning):
    """``fp8_dot_general``, ``fp8_gemm`` or ``jf_fp8_gemm`` computed a product by the reference math
    (correct, not fast), or not on the FP8 GEMM at all; the message says why and what it computed."""


class MXFP8GemmFallbackWarning(Fp8Warning):
    """An MXFP8 GEMM ran as its reference (the same quantized operands, dequantized exactly: a bf16 GEMM
    with fp32 accumulation): no block-scaled MXFP8 GEMM here."""


class CrossoverWarning(Fp8Warning):
    """``where="auto"`` found no crossover table for this GPU and recipe: every projection runs in FP8."""


class GatherWarning(Fp8Warning):
    """``all_gather_first_dim`` could not gather the FP8 tensor as it is: it requantized, or gathered in
    high precision and quantized after the gather (the message says which and why)."""


#: every warning class, in the order of the top-level exports
WARNINGS = (Fp8Warning, ShardingWarning, PartitioningRuleWarning, Fp8GemmFallbackWarning, MXFP8GemmFallbackWarning,
            CrossoverWarning, GatherWarning)


_PATHS = sysconfig.get_paths()
_STDLIB = os.path.abspath(_PATHS["stdlib"]) + os.sep
#: installed packages: under the stdlib directory outside a virtual environment, yet not the stdlib
_SITE = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("purelib", "platlib")})


def _library_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(jax.__file__))]
    for name in ("jaxlib", "flax"):  # those imported by now
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)))
    return tuple(d + os.sep for d in dirs)


def _is_library(filename: str, libs: tuple[str, ...]) -> bool:
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename)
    return path.startswith(libs) or (path.startswith(_STDLIB) and not path.startswith(_SITE))


def warn(message: str, category: type[Warning] = Fp8Warning) -> None:
    """``warnings.warn`` attributed to the innermost frame that is not library code."""
    libs = _library_dirs()
    frame, level = sys._getframe(1), 2  # level 2: warn()'s caller
    while frame is not None and _is_library(frame.f_code.co_filename, libs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
