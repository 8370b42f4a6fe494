"""``all_to_all_dequantized``: the expert-parallel all-to-all with FP8 on the wire, under the default
``jax.shard_map``.

Generated cases: ranks {2, 4, 8} x widths against the scale blocks (K = 64, 200, 512, 1024: partial and
whole 1x128 / 1x32 blocks) x Float8 blockwise and MXFP8 x float32 / bfloat16, each its own seed,
zeros, subnormals, huge values, inf and NaN planted. Each is compared bit for bit with dequantizing the
quantized result of ``lax.all_to_all`` (an independent composition of the public API); the compiled
program exchanges the FP8 data as bytes and no high-precision rows; the gradient is the cotangent's
all-to-all, as ``lax.all_to_all``'s.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import jax_fp8 as jf
from helpers import assert_bits_equal, random_input, stable_seed
from jax_fp8.distributed import all_to_all_dequantized

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
FORMATS = {"blockwise": dict(block=(1, 128)), "mxfp8": {}}
CASES = [(n, K, fmt, dt) for i, (n, K) in enumerate((n, K) for n in (2, 4, 8) for K in (64, 200, 512, 1024))
         for j, fmt in enumerate(FORMATS) for dt in [(jnp.float32, jnp.bfloat16)[(i + j) % 2]]]


def _scheme(fmt):
    return jf.Scheme(fmt, jnp.float8_e4m3fn, rowwise=True, colwise=False, **FORMATS[fmt])


def _on(n, fn):
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:n])  # also beside a GPU
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"{c[0]}ranks-K{c[1]}-{c[2]}-{jnp.dtype(c[3]).name}")
def test_equals_quantizing_the_exchanged_rows(c):
    n, K, fmt, dt = c
    rng = np.random.default_rng(stable_seed("a2a", *c))
    x = jnp.asarray(random_input(rng, (n * n * 3, 5, K), dt))  # every rank 3 rows (of 5 x K) for each rank
    scheme = _scheme(fmt)
    got = _on(n, lambda x: all_to_all_dequantized(x, "ep", scheme))(x)
    want = _on(n, lambda x: jf.dequantize(jf.quantize(lax.all_to_all(x, "ep", 0, 0, tiled=True), scheme), x.dtype))(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_bits_equal(got, want, str(c))


def test_fp8_bytes_on_the_wire_and_the_gradient_is_the_cotangents_all_to_all():
    n, scheme = 4, _scheme("blockwise")
    rng = np.random.default_rng(stable_seed("a2a wire"))
    x = jnp.asarray(random_input(rng, (16, 6, 256), jnp.bfloat16, specials=False))
    f = _on(n, lambda x: all_to_all_dequantized(x, "ep", scheme))
    hlo = f.lower(x).compile().as_text()
    exchanged = [re.findall(r"(\w+)\[", line.split(" all-to-all(")[0].split("=", 1)[1])
                 for line in hlo.splitlines() if " all-to-all(" in line]
    # two exchanges: the FP8 data as bytes, the scales; no high-precision rows
    assert len(exchanged) == 2 and {frozenset(t) for t in exchanged} == {frozenset({"u8"}), frozenset({"f32"})}, exchanged
    w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    loss = lambda f: lambda x: (f(x).astype(jnp.float32) * w).sum()  # noqa: E731
    plain = _on(n, lambda x: lax.all_to_all(x, "ep", 0, 0, tiled=True))
    assert_bits_equal(jax.grad(loss(f))(x), jax.grad(loss(plain))(x), "gradient")


def test_bad_arguments_say_what_is_wrong():
    x = jnp.ones((8, 256), jnp.float32)
    cases = [("blockwise", TypeError, "must be a jax_fp8.Scheme"),
             (jf.Scheme("blockwise", jnp.float8_e4m3fn, rowwise=True, colwise=True, block=(1, 128)), ValueError,
              "rowwise only"),
             (jf.Scheme("blockwise", jnp.float8_e4m3fn, block=(128, 128)), ValueError, "rowwise only")]
    for scheme, err, match in cases:
        with pytest.raises(err, match=match):
            _on(4, lambda x: all_to_all_dequantized(x, "ep", scheme))(x)
    with pytest.raises(ValueError, match="split evenly over the 4 ranks"):
        _on(4, lambda x: all_to_all_dequantized(x, "ep", _scheme("blockwise")))(jnp.ones((8, 256)))
    with pytest.raises(ValueError, match="rank >= 2"):
        _on(4, lambda x: all_to_all_dequantized(x, "ep", _scheme("blockwise")))(jnp.ones((16,)))
