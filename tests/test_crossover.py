"""FP8 only where it pays (``where="auto"``): the crossover table's answers (nearest measured shape),
its loading, the one warning without a table, and that an auto ``dot_general`` is bit for bit
``lax.dot_general`` where the table keeps bf16 and ``fp8_dot_general`` elsewhere (forward and both
gradients), for a flax model too, at each device's share of an Explicit-sharded call."""
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8.gemm import crossover
from helpers import assert_bits_equal, stable_seed

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_fp8.flax_utils import fp8_dot_general_for, use_fp8_dot_general  # noqa: E402

KN, NK = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))
KIND = jax.local_devices()[0].device_kind
#: FP8 pays from 1024 rows up at K = N = 256, not below (a made-up table for this machine)
ROWS = {"blockwise": [((128, 256, 256), 0.6), ((256, 256, 256), 0.9), ((1024, 256, 256), 1.2),
                      ((8192, 256, 256), 1.5)]}


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(crossover, "TABLES", {KIND: {k: list(v) for k, v in ROWS.items()}})


def test_nearest_row_answers():
    rows = {"H": {"blockwise": [((4096, 4096, 4096), 1.3), ((512, 512, 512), 0.8), ((2048, 512, 8192), 1.1)]}}
    crossover.TABLES.update(rows)
    try:
        assert crossover.fp8_pays(8192, 4096, 4096, device_kind="H")
        assert not crossover.fp8_pays(600, 400, 512, device_kind="H")
        assert crossover.fp8_pays(2048, 600, 8192, device_kind="H")  # nearest: the third row
        assert crossover.fp8_pays(8192, 8192, 600, device_kind="H")  # nearest: the first row
    finally:
        del crossover.TABLES["H"]


def test_no_table_warns_once_and_keeps_fp8():
    crossover._warn_unmeasured.cache_clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert crossover.fp8_pays(64, 64, 64, device_kind="no such GPU")
        assert crossover.fp8_pays(64, 64, 64, jf.MXFP8BlockScaling(), device_kind="no such GPU")
        assert crossover.fp8_pays(99, 64, 64, device_kind="no such GPU")
    ours = [r for r in rec if issubclass(r.category, crossover.CrossoverWarning)]
    assert len(ours) == 2 and "blockwise" in str(ours[0].message) and "mxfp8" in str(ours[1].message)
    assert ours[0].filename == __file__


def test_load(tmp_path, monkeypatch):
    monkeypatch.setattr(crossover, "TABLES", {})
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({"device_kind": "G", "rows": {"blockwise": [[[4096, 1024, 1024], 1.4]]}}))
    crossover.load(str(path))
    assert crossover.TABLES == {"G": {"blockwise": [((4096, 1024, 1024), 1.4)]}}
    with pytest.raises(ValueError, match="unknown key .per-tensor."):
        crossover.load({"device_kind": "G", "rows": {"per-tensor": []}})
    with pytest.raises(ValueError, match="device_kind"):
        crossover.load({"rows": {}})


def _layer(dot, x, w, dn):
    def f(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: dot(x, w, dn), x, w)
        return (y, *vjp(dy))
    return f


@pytest.mark.parametrize("dn", [KN, NK], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("M", [128, 2048])
def test_auto_is_lax_where_bf16_is_kept_and_fp8_elsewhere(table, M, dn):
    key = jax.random.key(stable_seed("auto", M, dn == KN))
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (M, 256), jnp.bfloat16)
    w = jax.random.normal(kw, (256, 256), jnp.bfloat16) / 16
    dy = jax.random.normal(kd, (M, 256), jnp.bfloat16)
    auto = fp8_dot_general_for(where="auto")
    got = jax.jit(_layer(auto, x, w, dn))(x, w, dy)
    expect_dot = jf.fp8_dot_general if M >= 1024 else lax.dot_general
    want = jax.jit(_layer(expect_dot, x, w, dn))(x, w, dy)
    other = jax.jit(_layer(lax.dot_general if M >= 1024 else jf.fp8_dot_general, x, w, dn))(x, w, dy)
    for g, r, o, name in zip(got, want, other, ("y", "dx", "dW")):
        assert_bits_equal(g, r, name)
        assert not np.array_equal(np.asarray(g, np.float32), np.asarray(o, np.float32)), name  # tells them apart


def test_auto_passes_through_what_is_no_layer(table):
    """Batched or quantized operands: fp8_dot_general decides, as without where."""
    auto = fp8_dot_general_for(where="auto")
    x = jnp.ones((2, 64, 128), jnp.float32)
    batched = (((2,), (2,)), ((0,), (0,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jf.Fp8GemmFallbackWarning)
        got = auto(x, x, batched)
        want = jf.fp8_dot_general(x, x, batched)
    assert_bits_equal(got, want, "batched")
    q = jf.quantize_blockwise(jnp.ones((128, 256), jnp.float32), block=(128, 128), colwise=True)
    assert_bits_equal(auto(jnp.ones((128, 128), jnp.float32), q, KN), jf.fp8_dot_general(jnp.ones((128, 128)), q, KN),
                      "quantized rhs")


def test_use_fp8_dot_general_auto_on_a_model(table):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(256, 256, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return self.up(x)

    net = Net(nnx.Rngs(0))
    assert use_fp8_dot_general(net, where="auto") == [("up",)]
    for M, dot in ((64, lax.dot_general), (4096, jf.fp8_dot_general)):
        x = jax.random.normal(jax.random.key(M), (M, 256), jnp.bfloat16)
        by_hand = jax.jit(lambda x, k, b: dot(x, k.astype(jnp.bfloat16), KN) + b.astype(jnp.bfloat16))
        want = by_hand(x, net.up.kernel[...], net.up.bias[...])
        assert_bits_equal(jax.jit(lambda x: net(x))(x), want, f"M={M}")


def test_where_errors_name_the_argument():
    with pytest.raises(ValueError, match="where must be 'all' or 'auto'"):
        fp8_dot_general_for(where="some")
    with pytest.raises(ValueError, match="use_fp8_dot_general: where must be"):
        use_fp8_dot_general(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), where="bf16")


def test_explicit_sharding_asks_for_each_devices_share(table, monkeypatch):
    """On an Explicit mesh of 8 devices splitting M, a (8192, 256) call is asked about as its 1024-row
    share of each device; inside shard_map as the local block."""
    asked = []
    real = crossover.fp8_pays
    monkeypatch.setattr(crossover, "fp8_pays", lambda *a, **k: asked.append(a[:3]) or real(*a, **k))
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    x = jax.device_put(jnp.ones((8192, 256), jnp.bfloat16), NamedSharding(mesh, P("data")))
    w = jax.device_put(jnp.ones((256, 256), jnp.bfloat16), NamedSharding(mesh, P()))
    auto = fp8_dot_general_for(where="auto")
    jax.jit(lambda x, w: auto(x, w, KN)).lower(x, w)
    f = jax.shard_map(lambda x, w: auto(x, w, KN), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    jax.jit(f).lower(x, w)
    assert asked == [(1024, 256, 256), (1024, 256, 256)], asked


@pytest.mark.parametrize("old,new", [("crossover", "crossover"), ("gemm_table", "table")])
def test_moved_modules_stay_reachable_with_a_deprecation(old, new):
    """``jf.crossover`` and ``jf.gemm_table`` (public module attributes before the gemm package) are
    ``jf.gemm.crossover`` and ``jf.gemm.table``, with a DeprecationWarning naming where they went."""
    with pytest.warns(DeprecationWarning, match=f"jax_fp8.{old} moved to jax_fp8.gemm.{new}"):
        assert getattr(jf, old) is getattr(jf.gemm, new)
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        jf.no_such_module  # noqa: B018
