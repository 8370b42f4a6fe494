"""Helper module, not an example to run: the small FP8 MLP that ``train_mlp.py`` and
``shard_map_model.py`` import (and ``tests/test_examples.py`` through them).

Linear layers whose operands go through ``jax_fp8.quantize_dequantize`` (forward in FP8,
straight-through gradients), He initialisation, and a synthetic teacher-network regression task.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_fp8 as jf


def init_mlp(key, sizes):
    """He-initialised weights (K, N) and zero biases for consecutive layer sizes."""
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (n_in, n_out), jnp.float32) * (2.0 / n_in) ** 0.5,
                       "b": jnp.zeros((n_out,), jnp.float32)})
    return params


def fp8_matmul(x, w, fmt: str):
    """x @ w with both operands quantized along the contraction dim: x rowwise (1x32 / 1x128 blocks
    along K), w columnwise (32x1 / 128x1 blocks along K). fmt None: plain bf16."""
    x = x.astype(jnp.bfloat16)
    w = w.astype(jnp.bfloat16)
    if fmt is not None:
        opts = {} if fmt == "mxfp8" else {"block": (1, 128)}
        x = jf.quantize_dequantize(x, fmt, "rowwise", **opts)
        w = jf.quantize_dequantize(w, fmt, "colwise", **opts)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def mlp(params, x, fmt):
    for i, p in enumerate(params):
        x = fp8_matmul(x, p["w"], fmt) + p["b"]
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return x


def teacher_data(key, n, d_in, d_out):
    """Synthetic regression data from a random two-layer teacher network."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (n, d_in), jnp.float32)
    w1 = jax.random.normal(k2, (d_in, 64), jnp.float32) / d_in ** 0.5
    w2 = jax.random.normal(k3, (64, d_out), jnp.float32) / 8.0
    return x, jnp.tanh(x @ w1) @ w2


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nRun one of the examples instead:\n"
          "  python examples/train_mlp.py        # FP8 MLP next to bf16 on the CPU\n"
          "  python examples/quickstart.py       # a short API tour\n"
          "  python examples/shard_map_model.py  # the MLP on an 8-device (data x seq) mesh, ZeRO master weights")
