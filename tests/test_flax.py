"""Flax integration: nnx.Linear / linen.Dense with dot_general=fp8_dot_general compute exactly what
fp8_dot_general computes called directly (forward and gradients), and use_fp8_dot_general swaps them in."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8 as jf
from helpers import assert_bits_equal, stable_seed

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp8.flax_utils import fp8_dot_general_for, use_fp8_dot_general  # noqa: E402

FPROP = (((2,), (0,)), ((), ()))  # x (B, S, K) . kernel (K, N), as flax calls it


def _x(dtype=jnp.bfloat16, shape=(2, 64, 256), seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _direct(x, kernel, bias, dtype):
    """The layer by hand: flax's dtype promotion, then fp8_dot_general, then the bias."""
    y = jf.fp8_dot_general(x.astype(dtype), kernel.astype(dtype), FPROP)
    return y + bias.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_linear_equals_direct_call(dtype):
    layer = nnx.Linear(256, 384, dtype=dtype, dot_general=jf.fp8_dot_general,
                       rngs=nnx.Rngs(stable_seed("nnx linear params", dtype)))
    x = _x(seed=stable_seed("nnx linear input", dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)  # the FP8 GEMM path, no fallback
        y = nnx.jit(lambda m, x: m(x))(layer, x)
    ref = jax.jit(_direct, static_argnums=3)(x, layer.kernel[...], layer.bias[...], dtype)
    assert y.shape == (2, 64, 384) and y.dtype == dtype
    assert_bits_equal(y, ref, "nnx.Linear vs fp8_dot_general")
    # and it is really FP8: not the plain matmul
    plain = jnp.einsum("bsk,kn->bsn", x.astype(dtype), layer.kernel[...].astype(dtype)) + layer.bias[...]
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(plain, np.float32))


def test_nnx_linear_gradients_match_direct_call():
    layer = nnx.Linear(256, 128, dtype=jnp.bfloat16, dot_general=jf.fp8_dot_general, rngs=nnx.Rngs(0))
    x = _x()

    def loss_layer(m, x):
        return jnp.sum(m(x).astype(jnp.float32) ** 2)

    def loss_direct(kernel, bias, x):
        return jnp.sum(_direct(x, kernel, bias, jnp.bfloat16).astype(jnp.float32) ** 2)

    g_layer, dx_layer = nnx.jit(nnx.grad(loss_layer, argnums=(0, 1)))(layer, x)
    dk, db, dx = jax.jit(jax.grad(loss_direct, argnums=(0, 1, 2)))(layer.kernel[...], layer.bias[...], x)
    for got, want, name in ((g_layer["kernel"][...], dk, "kernel"), (g_layer["bias"][...], db, "bias"),
                            (dx_layer, dx, "x")):
        assert np.isfinite(np.asarray(got, np.float32)).all(), name
        assert got.dtype == want.dtype, name
        assert_bits_equal(got, want, name)


def test_linen_dense_forward_and_gradients_equal_direct_call():
    dense = nn.Dense(384, dtype=jnp.bfloat16, dot_general=jf.fp8_dot_general)
    x = _x()
    v = dense.init(jax.random.key(0), x)
    k, b = v["params"]["kernel"], v["params"]["bias"]
    assert_bits_equal(jax.jit(dense.apply)(v, x), jax.jit(_direct, static_argnums=3)(x, k, b, jnp.bfloat16),
                      "linen.Dense vs fp8_dot_general")

    def loss(v, x):
        return jnp.sum(dense.apply(v, x).astype(jnp.float32) ** 2)

    gv, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(v, x)
    dk, db, dx = jax.jit(jax.grad(lambda k, b, x: jnp.sum(_direct(x, k, b, jnp.bfloat16).astype(jnp.float32) ** 2),
                                  argnums=(0, 1, 2)))(k, b, x)
    assert gv["params"]["kernel"].dtype == jnp.float32  # the fp32 master gets an fp32 gradient
    for got, want, name in ((gv["params"]["kernel"], dk, "kernel"), (gv["params"]["bias"], db, "bias"), (gx, dx, "x")):
        assert np.isfinite(np.asarray(got, np.float32)).all(), name
        assert_bits_equal(got, want, name)


def test_preferred_element_type_and_recipe_pass_through():
    """nnx.Linear passes preferred_element_type to dot_general; a bound recipe changes the gradient's FP8 dtype."""
    x = _x()
    m = nnx.Linear(256, 128, dtype=jnp.bfloat16, preferred_element_type=jnp.float32,
                   dot_general=jf.fp8_dot_general, rngs=nnx.Rngs(0))
    y = m(x)
    assert y.dtype == jnp.float32
    want = jf.fp8_dot_general(x, m.kernel[...].astype(jnp.bfloat16), FPROP, preferred_element_type=jnp.float32)
    assert_bits_equal(y, want + m.bias[...], "preferred_element_type")

    e5m2 = jf.Float8BlockScaling(grad_dtype=jnp.float8_e5m2)
    dg = fp8_dot_general_for(e5m2)
    w = m.kernel[...]
    g_bound = jax.grad(lambda w: jnp.sum(dg(x, w, FPROP).astype(jnp.float32) ** 2))(w)
    g_direct = jax.grad(lambda w: jnp.sum(jf.fp8_dot_general(x, w, FPROP, recipe=e5m2).astype(jnp.float32) ** 2))(w)
    assert_bits_equal(g_bound, g_direct, "bound recipe")
    g_default = jax.grad(lambda w: jnp.sum(jf.fp8_dot_general(x, w, FPROP).astype(jnp.float32) ** 2))(w)
    assert not np.array_equal(np.asarray(g_bound), np.asarray(g_default)), "E5M2 gradients changed nothing"
    assert fp8_dot_general_for(None) is jf.fp8_dot_general
    with pytest.raises(TypeError, match="recipe must be a jax_fp8.Float8BlockScaling"):
        fp8_dot_general_for("e5m2")


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(256, 256, rngs=rngs)
        self.down = nnx.Linear(256, 256, rngs=rngs)
        self.head = nnx.Linear(256, 128, rngs=rngs)

    def __call__(self, x):
        return self.head(self.down(jax.nn.relu(self.up(x))))


def test_use_fp8_dot_general_swaps_every_linear():
    x = _x(jnp.float32)
    plain = _Mlp(nnx.Rngs(0))
    y_plain = plain(x)
    model = _Mlp(nnx.Rngs(0))
    changed = use_fp8_dot_general(model, where=lambda path, m: "head" not in path)
    assert sorted(changed) == [("down",), ("up",)]
    assert model.head.dot_general is not jf.fp8_dot_general and model.up.dot_general is jf.fp8_dot_general
    # the same as building the layers with dot_general=fp8_dot_general

    def by_hand(m, x):
        h = jf.fp8_dot_general(x, m.up.kernel[...], FPROP) + m.up.bias[...]
        h = jf.fp8_dot_general(jax.nn.relu(h), m.down.kernel[...], FPROP) + m.down.bias[...]
        return m.head(h)

    want = nnx.jit(by_hand)(model, x)
    assert_bits_equal(nnx.jit(lambda m, x: m(x))(model, x), want, "swapped model")
    assert not np.array_equal(np.asarray(want), np.asarray(y_plain))
    assert sorted(use_fp8_dot_general(model)) == [("down",), ("head",), ("up",)]
    with pytest.raises(TypeError, match="model must be a flax.nnx.Module"):
        use_fp8_dot_general(nn.Dense(4))
