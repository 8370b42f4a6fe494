"""Warnings that point at the user's line: the first caller outside jax_fp8, jax, flax and the
standard library (a fixed ``stacklevel`` lands inside ``jnp.einsum``, a flax module or a jax transform
when our function is called through them)."""
from __future__ import annotations

import os
import sys
import sysconfig
import warnings

import jax


def _library_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(jax.__file__)),
            sysconfig.get_paths()["stdlib"]]
    for name in ("jaxlib", "flax"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)))
    return tuple(d + os.sep for d in dirs)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the innermost frame that is not library code."""
    libs = _library_dirs()
    frame, level = sys._getframe(1), 2  # level 2: warn()'s caller
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(libs)
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
