"""A short tour of jax_fp8 on whatever backend jax picked (CPU by default).

  python examples/quickstart.py
"""
import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8 as jf

print(f"backend: {jax.default_backend()}, FFI kernels: {jf.kernels_available()}")
x = jax.random.normal(jax.random.key(0), (256, 1024), jnp.bfloat16)

# MXFP8: rowwise (1x32) and columnwise (32x1) blocks in one pass, E8M0 scales as uint8.
q = jax.jit(lambda v: jf.quantize_mxfp8(v, rowwise=True, colwise=True))(x)
print("MXFP8 rowwise data", q.rowwise_data.dtype, q.rowwise_data.shape, "scales", q.rowwise_scale_inv.shape,
      "| colwise scales", q.colwise_scale_inv.shape)
for usage in ("rowwise", "colwise"):
    err = jnp.abs(jf.dequantize(q, jnp.float32, usage) - x.astype(jnp.float32)).max()
    print(f"  {usage}: max |dequantize(q) - x| = {float(err):.4f}")
ref = jf.reference.quantize_mxfp8(np.asarray(x), rowwise=True, colwise=True)
same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
           for a, b in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(ref)))
print("  kernel == reference bit for bit:", same)

# Float8 blockwise: 1x128 (and 128x1) blocks or 128x128 tiles, fp32 power-of-two scales.
b = jf.quantize_blockwise(x, block=(128, 128))
print("Float8 128x128 scale_inv", b.rowwise_scale_inv.shape, b.rowwise_scale_inv.dtype,
      "max err", float(jnp.abs(jf.dequantize(b, jnp.float32) - x.astype(jnp.float32)).max()))

# Straight-through estimator for training: forward = dequantize(quantize(x)), backward = identity.
g = jax.grad(lambda v: jf.quantize_dequantize(v, "mxfp8").astype(jnp.float32).sum())(x)
print("STE gradient is all ones:", bool((g == 1).all()))
