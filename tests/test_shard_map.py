"""Under the public ``jax.shard_map`` with its default checks (``check_vma=True``), as users call it:
every op types its outputs with the mesh axes they vary over, so gradients equal those of the same
computation written with ``lax`` collectives and ``out_specs`` checks behave as for plain ``jnp``.

The references keep the forward values of the library's ops but take the gradient through ``lax``:
``straight_through(v, x) = stop_gradient(v) + (x - stop_gradient(x))`` is ``v`` exactly (``x - x`` is 0)
with the identity derivative, which is the derivative ``quantize_dequantize`` and the gathers promise.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8 import Scheme
from jax_fp8.distributed import (all_gather_dequantized, all_gather_first_dim, gather_master_weights,
                                 local_shards, quantize_master_weights, split_masters)
from helpers import assert_bits_equal, stable_seed

N = 8
_CPU = jax.devices("cpu")[0]  # the meshes are CPU devices: single-device references run there too
KN = (((1,), (0,)), ((), ()))


def _mesh(n=N, name="data"):
    return Mesh(np.array(jax.devices("cpu")[:n]), (name,))


def straight_through(value, x):
    """``value`` in the forward, the identity derivative with respect to ``x`` (lax only)."""
    return lax.stop_gradient(value) + (x - lax.stop_gradient(x))


def _data(tag, *shapes):
    rng = np.random.default_rng(stable_seed("shard_map", tag))
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6, err_msg=what)


# ---- data parallel: a replicated weight's gradient is summed once, by JAX ------------------------
@pytest.mark.parametrize("fmt", ["mxfp8", "blockwise"])
def test_data_parallel_weight_gradient(fmt):
    x, w = _data(("dp", fmt), (N * 64, 256), (256, 128))

    def loss(qdq):
        return lambda x, w: lax.psum(jnp.sum((qdq(x) @ w) ** 2), "data")

    ours = lambda v: jf.quantize_dequantize(v, fmt)  # noqa: E731
    ref = lambda v: straight_through(jf.quantize_dequantize(v, fmt), v)  # noqa: E731
    grads = {}
    for name, qdq in (("ours", ours), ("lax", ref)):
        g = jax.shard_map(jax.grad(loss(qdq), argnums=(0, 1)), mesh=_mesh(), in_specs=(P("data"), P()),
                          out_specs=(P("data"), P()))
        grads[name] = jax.jit(g)(x, w)
    _close(grads["ours"][0], grads["lax"][0], "dx")
    _close(grads["ours"][1], grads["lax"][1], "dW")
    # the reported bug: dW was exactly 8x rank 0's share; the true one is over all rows (fp64 here)
    xq = np.asarray(jf.quantize_dequantize(jax.device_put(x, _CPU), fmt), np.float64)
    full = 2 * xq.T @ (xq @ w.astype(np.float64))
    np.testing.assert_allclose(np.asarray(grads["ours"][1]), full, rtol=1e-4, atol=1e-2)


# ---- sequence parallel: the gathers' gradients are reduce-scattered, as lax.all_gather's -----------
GATHERS = {
    "all_gather_dequantized-mxfp8": lambda v: all_gather_dequantized(v, "data", Scheme("mxfp8")),
    "all_gather_dequantized-blockwise-col": lambda v: all_gather_dequantized(
        v, "data", Scheme("blockwise", rowwise=False, colwise=True), "colwise"),
    "all_gather_first_dim": lambda v: all_gather_first_dim(v, "data"),
}


@pytest.mark.parametrize("name", list(GATHERS))
@pytest.mark.parametrize("local_rows", [128, 40])  # FP8 travels / the high-precision fallback
def test_sequence_parallel_gradients(name, local_rows):
    x, w = _data(("sp", name, local_rows), (N * local_rows, 256), (256, 64))
    gather = GATHERS[name]

    def loss(gather):
        def f(x, w):
            full = gather(x)
            mine = lax.dynamic_slice_in_dim(full, lax.axis_index("data") * local_rows, local_rows)
            return lax.psum(jnp.sum(jnp.tanh(mine @ w)), "data")
        return f

    ref = lambda v: straight_through(gather(v), lax.all_gather(v, "data", tiled=True))  # noqa: E731
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback path says so
        for key, g in (("ours", gather), ("lax", ref)):
            f = jax.shard_map(jax.value_and_grad(loss(g), argnums=(0, 1)), mesh=_mesh(),
                              in_specs=(P("data"), P()), out_specs=(P(), (P("data"), P())))
            out[key] = jax.jit(f)(x, w)
    assert_bits_equal(out["ours"][0], out["lax"][0], "loss")
    _close(out["ours"][1][0], out["lax"][1][0], "dx")
    _close(out["ours"][1][1], out["lax"][1][1], "dW")


def test_gather_of_a_replicated_input_sums_its_gradient_as_lax():
    """A replicated input (in_specs P()) gathered over the axis: each rank's copy contributes, as with
    lax.all_gather (which casts it to varying; the cast transposes to a psum)."""
    (x,) = _data("replicated-gather", (64, 256))
    out = {}
    for key, gather in (("ours", GATHERS["all_gather_dequantized-mxfp8"]),
                        ("lax", lambda v: straight_through(GATHERS["all_gather_dequantized-mxfp8"](v),
                                                           lax.all_gather(v, "data", tiled=True)))):
        f = jax.shard_map(jax.grad(lambda v: lax.psum(jnp.sum(gather(v) ** 2), "data")), mesh=_mesh(),
                          in_specs=P(), out_specs=P())
        out[key] = jax.jit(f)(x)
    _close(out["ours"], out["lax"], "dx")


# ---- fp8_dot_general, batch or sequence sharded ----------------------------------------------------
def _per_rank_vjp(x, w, dy, n):
    """Ground truth without shard_map: each rank's FP8 linear layer by itself; dW summed over ranks."""
    rows = x.shape[0] // n
    vjp = jax.jit(lambda a, b, g: jax.vjp(lambda a, b: jf.fp8_dot_general(a, b, KN), a, b)[1](g))
    parts = [vjp(*jax.device_put((x[r * rows:(r + 1) * rows], w, dy[r * rows:(r + 1) * rows]), _CPU))
             for r in range(n)]
    return np.concatenate([np.asarray(p[0]) for p in parts]), sum(np.asarray(p[1], np.float64) for p in parts)


def test_fp8_dot_general_batch_sharded():
    x, w, dy = _data("dg-batch", (N * 128, 256), (256, 128), (N * 128, 128))

    def step(x, w, dy):
        _, vjp = jax.vjp(lambda a, b: jf.fp8_dot_general(a, b, KN), x, w)
        return vjp(dy)

    dx, dw = jax.jit(jax.shard_map(step, mesh=_mesh(), in_specs=(P("data"), P(), P("data")),
                                   out_specs=(P("data"), P())))(x, w, dy)
    dx_ref, dw_ref = _per_rank_vjp(x, w, dy, N)
    assert_bits_equal(dx, dx_ref, "dx")
    np.testing.assert_allclose(np.asarray(dw, np.float64), dw_ref, rtol=1e-5, atol=1e-4)


def test_fp8_dot_general_sequence_sharded():
    """The sequence gathered (all_gather_dequantized), then fp8_dot_general over the full sequence, each
    rank's loss over its rows: the same gradients as the same code gathering with lax.all_gather."""
    local = 128
    x, w = _data("dg-seq", (N * local, 256), (256, 128))
    qz = Scheme("blockwise", rowwise=True, colwise=True)

    def loss(gather):
        def f(x, w):
            y = jf.fp8_dot_general(gather(x), w, KN)
            mine = lax.dynamic_slice_in_dim(y, lax.axis_index("data") * local, local)
            return lax.psum(jnp.sum(mine ** 2), "data")
        return f

    ours = lambda v: all_gather_dequantized(v, "data", qz)  # noqa: E731
    ref = lambda v: straight_through(ours(v), lax.all_gather(v, "data", tiled=True))  # noqa: E731
    out = {key: jax.jit(jax.shard_map(jax.grad(loss(g), argnums=(0, 1)), mesh=_mesh(), in_specs=(P("data"), P()),
                                      out_specs=(P("data"), P())))(x, w) for key, g in (("ours", ours), ("lax", ref))}
    _close(out["ours"][0], out["lax"][0], "dx")
    _close(out["ours"][1], out["lax"][1], "dW")


# ---- master weights: the gathered FP8 weights in a data-parallel step ------------------------------
def test_master_weights_in_a_data_parallel_step():
    """Weights quantized from ZeRO shards and gathered, used with each rank's batch: the gradients of
    the batch and of a replicated bias equal those of the same step on the full weight given
    replicated (whose quantization the gathered tensor equals bit for bit)."""
    w, x = _data("masters", (256, 128), (N * 32, 256))
    b = np.zeros(128, np.float32)
    bufs = split_masters([w], N)[0]

    def ours(buf, x, b):
        q = quantize_master_weights([buf[0]], [w.shape], "data", model_dtype=None)
        wq = jf.dequantize(gather_master_weights(q, "data")[0])
        return jax.grad(lambda x, b: lax.psum(jnp.sum(jnp.tanh(x @ wq + b)), "data"), argnums=(0, 1))(x, b)

    def ref(wq, x, b):
        return jax.grad(lambda x, b: lax.psum(jnp.sum(jnp.tanh(x @ wq + b)), "data"), argnums=(0, 1))(x, b)

    got = jax.jit(jax.shard_map(ours, mesh=_mesh(), in_specs=(P("data"), P("data"), P()),
                                out_specs=(P("data"), P())))(bufs, x, b)
    wq = jf.dequantize(jf.quantize_mxfp8(w, rowwise=True, colwise=True))
    want = jax.jit(jax.shard_map(ref, mesh=_mesh(), in_specs=(P(), P("data"), P()),
                                 out_specs=(P("data"), P())))(wq, x, b)
    _close(got[0], want[0], "dx")
    _close(got[1], want[1], "d bias")


def test_master_weight_outputs_are_typed_by_what_varies():
    """The FP8 shard varies per rank (out_specs=P() rejects it); the reduced scales are the same on
    every rank (P() accepts them), as a lax.pmax result is."""
    w = _data("masters-types", (64, 96))[0]
    bufs = split_masters([w], N)[0]
    for fmt in ("mxfp8", "blockwise"):
        def scales(buf):
            return quantize_master_weights([buf[0]], [w.shape], "data", fmt=fmt)[0].tensor.rowwise_scale_inv

        def data(buf):
            return quantize_master_weights([buf[0]], [w.shape], "data", fmt=fmt)[0].tensor.rowwise_data

        got = jax.jit(jax.shard_map(scales, mesh=_mesh(), in_specs=P("data"), out_specs=P()))(bufs)
        want = jf.quantize_mxfp8(w.astype(jnp.bfloat16)) if fmt == "mxfp8" else jf.quantize_blockwise(
            w.astype(jnp.bfloat16))
        assert_bits_equal(got, want.rowwise_scale_inv, f"{fmt} scales")
        with pytest.raises(ValueError, match="out_specs"):
            jax.shard_map(data, mesh=_mesh(), in_specs=P("data"), out_specs=P())(bufs)


# ---- out_specs=P(): per-device results rejected, replicated ones accepted, as for jnp ---------------
PER_DEVICE_OPS = {
    "jnp (the behaviour to match)": lambda v: v * 2,
    "quantize_mxfp8": lambda v: jf.quantize_mxfp8(v).rowwise_data,
    "quantize_blockwise scales": lambda v: jf.quantize_blockwise(v, block=(128, 128)).rowwise_scale_inv,
    "dequantize": lambda v: jf.dequantize(jf.quantize_mxfp8(v, rowwise=False, colwise=True)),
    "quantize_dequantize": lambda v: jf.quantize_dequantize(v, "blockwise"),
    "fp8_dot_general": lambda v: jf.fp8_dot_general(v, jnp.ones((256, 128)), KN),
    "fp8_dot_general rhs": lambda v: jf.fp8_dot_general(jnp.ones((128, 256)), v.T, KN),
    "empty quantize": lambda v: jf.quantize_mxfp8(v[:0]).rowwise_data,
}


@pytest.mark.parametrize("name", list(PER_DEVICE_OPS))
def test_out_specs_checks_behave_as_for_jnp(name):
    op = PER_DEVICE_OPS[name]
    (x,) = _data(("out_specs", name), (N * 128, 256))
    with pytest.raises(ValueError, match="out_specs"):  # a per-device result returned as replicated
        jax.shard_map(op, mesh=_mesh(), in_specs=P("data"), out_specs=P())(x)
    got = jax.jit(jax.shard_map(op, mesh=_mesh(), in_specs=P(), out_specs=P()))(x[:128])  # replicated input
    assert_bits_equal(got, jax.jit(op)(jax.device_put(x[:128], _CPU)), name)


# ---- the collectives outside shard_map -----------------------------------------------------------
COLLECTIVES = {
    "quantize_master_weights": lambda b: quantize_master_weights([b.reshape(-1)], [(16, 16)], "data"),
    "gather_master_weights": lambda b: gather_master_weights([], "data"),
    "all_gather_first_dim": lambda b: all_gather_first_dim(b, "data", Scheme("mxfp8")),
    "all_gather_dequantized": lambda b: all_gather_dequantized(b, "data", Scheme("mxfp8")),
    "local_shards": lambda b: local_shards([b[0]], [(2, 16)], "data"),
}


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collectives_under_plain_jit_say_they_need_shard_map(name):
    """Called under jax.jit on sharded arrays, outside shard_map: a ValueError that names the function
    and says to call it inside jax.shard_map (not jax's 'unbound axis name')."""
    mesh = _mesh()
    x = jax.device_put(np.ones((8, 32), np.float32), jax.sharding.NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=rf"{name}: mesh axis 'data' is not bound here: call it inside "
                                         r"jax.shard_map"):
        jax.jit(COLLECTIVES[name])(x)


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collectives_name_the_mesh_axes_when_the_axis_name_is_not_one(name):
    """Inside jax.shard_map over a mesh whose axis is 'dp', a collective called with 'data': a
    ValueError naming the function, the missing axis and the mesh's axes (not jax's 'unbound axis name')."""
    mesh = _mesh(name="dp")
    x = jax.device_put(np.ones((8, 32), np.float32), jax.sharding.NamedSharding(mesh, P("dp")))
    with pytest.raises(ValueError, match=rf"{name}: axis_name 'data' is not an axis of the shard_map's mesh, "
                                         r"whose axes are \('dp',\)"):
        jax.jit(jax.shard_map(COLLECTIVES[name], mesh=mesh, in_specs=P("dp"), out_specs=P()))(x)
