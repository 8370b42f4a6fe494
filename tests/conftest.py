"""Test setup: IEEE subnormals for the CPU reference and 8 simulated CPU devices; and a hard check that
the compiled FFI kernels are loaded.

Both flags must be in XLA_FLAGS before jax creates its backends, hence here, before any import of jax.
Without the compiled modules every primitive lowers through the jax.numpy reference, and the suite
would compare the reference with itself and pass; the session refuses to start instead.
"""
import glob
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_cpu_ftz" not in _flags:
    _flags += " --xla_cpu_ftz=false"
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

import jax_fp8  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--sweep-examples", type=int, default=0, metavar="N",
                     help="test_sharded_sweep.py: also run N sharded-jit programs drawn by hypothesis")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per CPU core, but none beside a GPU, where every
    worker would take its own share of the one device's memory."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _missing_kernels() -> list[str]:
    ffi = jax_fp8._ffi
    need = ["cpu"] + (["cuda"] if jax.default_backend() == "gpu" else [])
    return [f"{p} ({ffi.LOAD_ERRORS.get(p, 'not loaded')})" for p in need if not ffi.AVAILABLE[p]]


def pytest_sessionstart(session):
    missing = _missing_kernels()
    if missing:
        pytest.exit("jax_fp8's compiled FFI kernels are not loaded for: " + "; ".join(missing)
                    + ". The tests would compare the jax.numpy reference with itself. Rebuild and reinstall "
                    "the extension with `pip install -e .` (for CUDA: with nvcc on PATH).", returncode=1)
