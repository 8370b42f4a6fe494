"""Warnings that point at the user's line: the first caller outside jax_fp8, jax, jaxlib, flax and
the standard library (a fixed ``stacklevel`` lands inside ``jnp.einsum``, a flax module or a jax
transform when our function is called through them). Other installed packages count as the user's."""
from __future__ import annotations

import os
import sys
import sysconfig
import warnings

import jax


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


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the innermost frame that is not library code."""
    libs = _library_dirs()
    frame, level = sys._getframe(1), 2  # level 2: warn()'s caller
    while frame is not None and _is_library(frame.f_code.co_filename, libs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
