"""Test setup: IEEE subnormals for the CPU reference and 8 simulated CPU devices.

Both flags must be in XLA_FLAGS before jax creates its backends, hence here, before any import of jax.
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_cpu_ftz" not in _flags:
    _flags += " --xla_cpu_ftz=false"
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()
