"""The ZeRO splits of master weights (jax_fp8/distributed/shards.py): shard windows that tile every weight
once, the split helpers' round trip, the tiling check of quantize_master_weights (concrete and traced
windows) and its argument errors."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import jax_fp8 as jf
from jax import shard_map
from jax_fp8.distributed import (gather_master_weights, local_shards, quantize_master_weights, shard_windows,
                                 split_masters)
from helpers import assert_tensors_equal, random_input, replicated, stable_seed
from test_distributed import _mesh

# ---- shard windows: the standard ZeRO splits, the tiling check, argument errors ---------------------
SPLIT_SHAPES = [(64, 96), (33, 70), (1, 31), (0, 16), (129, 257), (5, 3)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=6),
       st.integers(1, 9), st.sampled_from(["per_weight", "flat"]))
def test_shard_windows_tile_every_weight_once(shapes, ranks, split):
    from jax_fp8.distributed.shards import tiling_errors

    wins = shard_windows(shapes, ranks, split=split)
    assert wins.shape == (ranks, len(shapes), 2) and wins.dtype == np.int32
    bufs = split_masters([np.zeros(s, np.float32) for s in shapes], ranks, split=split)
    held = [b.shape[1] for b in bufs] if split == "per_weight" else [bufs.shape[1]] * len(shapes)
    assert tiling_errors(wins, held, shapes) == []
    assert (wins[:, :, 1].sum(0) == [a * b for a, b in shapes]).all()


@pytest.mark.parametrize("split", ["per_weight", "flat"])
@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("fmt", ["mxfp8", "blockwise"])
def test_split_helpers_round_trip(split, n, fmt):
    """split_masters -> local_shards -> quantize_master_weights(check=True) -> gather equals quantizing
    every whole weight; the flat split starts and ends weights anywhere in a rank's buffer."""
    rng = np.random.default_rng(stable_seed("split helpers round trip", split, n, fmt))
    masters = [random_input(rng, s, jnp.float32) for s in SPLIT_SHAPES]
    bufs = split_masters(masters, n, split=split)
    kw = dict(fmt=fmt, block=(128, 128)) if fmt == "blockwise" else {}

    def step(local):
        local = [b[0] for b in local] if split == "per_weight" else local[0]
        shards, offsets, lengths = local_shards(local, SPLIT_SHAPES, "data", split=split)
        qs = quantize_master_weights(shards, SPLIT_SHAPES, "data", offsets=offsets, lengths=lengths, check=True, **kw)
        return gather_master_weights(qs, "data")

    got = replicated(step, _mesh(n), P("data"), "data")[0](bufs)
    for w, q in zip(masters, got):
        wb = w.astype(jnp.bfloat16)
        want = (jf.quantize_blockwise(wb, block=(128, 128), colwise=True) if fmt == "blockwise"
                else jf.quantize_mxfp8(wb, rowwise=True, colwise=True))
        assert_tensors_equal(q, want)


def _quantize_windows(bufs, shapes, offs, lens, check=True):
    """quantize_master_weights over 2 ranks with explicit (per rank) offsets and lengths."""
    def step(b, o, l):
        qs = quantize_master_weights([b[0]], shapes, "data", offsets=[o[0]], lengths=[l[0]], check=check)
        return gather_master_weights(qs, "data")

    call, _ = replicated(step, _mesh(2), (P("data"),) * 3, "data")
    return call(bufs, np.array(offs, np.int32), np.array(lens, np.int32))


@pytest.mark.parametrize("case,offs,lens,msg", [
    ("gap", [0, 7], [5, 5], "held by no rank"),                    # elements 5, 6 held by nobody
    ("past the end", [0, 12], [5, 5], "held by no rank"),          # rank 1's offset past the weight's end
    ("overlap", [0, 3], [5, 5], "held by more than one rank"),     # elements 3, 4 twice
    ("shape larger than the shards", [0, 5], [5, 5], "held by no rank"),
])
def test_check_rejects_windows_that_do_not_tile(case, offs, lens, msg):
    """Traced (per rank) windows: checked at run time; every rank stops, the caller gets the message once."""
    shape = (3, 4) if case == "shape larger than the shards" else (2, 5)
    bufs = np.arange(10, dtype=np.float32).reshape(2, 5) + 1
    with pytest.raises(jax.errors.JaxRuntimeError, match=msg) as excinfo:
        _quantize_windows(bufs, [shape], offs, lens)
    assert str(excinfo.value).count("do not tile") == 1
    _quantize_windows(bufs, [shape], offs, lens, check=False)  # the contract is the caller's without check
    # a valid tiling passes; its host callback also replaces the failed run's runtime tokens, which jax
    # would raise again at the next effects_barrier and at exit
    _quantize_windows(bufs, [(2, 5)], [0, 5], [5, 5])


def test_check_traced_windows_error_once_on_8_ranks(caplog):
    """8 ranks, windows from axis_index (a gap after each): one error reaches the caller and jax logs one
    traceback (rank 0's), not one per rank; no rank is left waiting in a collective."""
    def quantize(shape, length):
        def step(b):
            r = jax.lax.axis_index("data")
            qs = quantize_master_weights([b[0]], [shape], "data", offsets=[r * 5], lengths=[jnp.int32(length)],
                                         check=True)
            return gather_master_weights(qs, "data")
        return replicated(step, _mesh(8), P("data"), "data")[0](np.ones((8, 5), np.float32))

    with pytest.raises(jax.errors.JaxRuntimeError, match="held by no rank") as excinfo:
        quantize((4, 9), 4)
    assert str(excinfo.value).count("do not tile") == 1
    logged = [r for r in caplog.records if r.exc_info and "do not tile" in str(r.exc_info[1])]
    assert len(logged) == 1
    quantize((8, 5), 5)  # a valid tiling passes (and replaces the failed run's runtime tokens, as above)


def _quantize_concrete(shape, offsets=None, lengths=None):
    """quantize_master_weights(check=True) over 2 ranks with windows known while tracing."""
    def step(b):
        qs = quantize_master_weights([b[0]], [shape], "data", offsets=offsets, lengths=lengths, check=True)
        return gather_master_weights(qs, "data")

    return replicated(step, _mesh(2), P("data"), "data")


@pytest.mark.parametrize("case,shape,offsets,lengths,msg", [
    ("default split too short", (3, 4), None, None, "held by no rank"),             # 2 x 5 < 12 elements
    ("same int offset on every rank", (2, 5), [0], None, "held by more than one rank"),
    ("numpy lengths too short", (2, 5), None, [np.int32(4)], "held by no rank"),    # elements 4 and 9
])
def test_check_concrete_windows_raise_at_the_call(case, shape, offsets, lengths, msg):
    """No traced offset or length: a plain ValueError while tracing, naming the call, weight and fault."""
    bufs = np.arange(10, dtype=np.float32).reshape(2, 5) + 1
    call, f = _quantize_concrete(shape, offsets, lengths)
    want = rf"quantize_master_weights\(check=True\).*\n.*weight 0 of shape {re.escape(str(shape))}.*{msg}"
    with pytest.raises(ValueError, match=want):
        jax.eval_shape(f, bufs)  # tracing alone raises
    with pytest.raises(ValueError, match=want):
        call(bufs)


def test_check_concrete_valid_tiling_has_no_run_time_check():
    """A valid default split passes with check=True and compiles no host callback (traced windows do)."""
    bufs = np.arange(10, dtype=np.float32).reshape(2, 5) + 1
    call, f = _quantize_concrete((2, 5))
    assert_tensors_equal(call(bufs)[0], jf.quantize_mxfp8(bufs.astype(jnp.bfloat16), rowwise=True, colwise=True))
    assert "callback" not in f.lower(bufs).as_text()

    def traced(b):
        return quantize_master_weights([b[0]], [(2, 5)], "data", offsets=[jax.lax.axis_index("data") * 5],
                                       check=True)[0].tensor.rowwise_data

    assert "callback" in replicated(traced, _mesh(2), P("data"), "data")[1].lower(bufs).as_text()


def test_check_accepts_a_valid_tiling():
    bufs = np.arange(10, dtype=np.float32).reshape(2, 5) + 1
    got = _quantize_windows(bufs, [(2, 5)], [0, 5], [5, 5])
    assert_tensors_equal(got[0], jf.quantize_mxfp8(np.arange(1, 11, dtype=np.float32).reshape(2, 5).astype(jnp.bfloat16),
                                                   rowwise=True, colwise=True))


def test_master_weight_argument_errors():
    def call(*args, **kw):
        f = shard_map(lambda b: quantize_master_weights(*args, **kw) and 0, mesh=_mesh(2), in_specs=P("data"),
                      out_specs=P())
        return f(np.zeros((2, 4), np.float32))

    s = [jnp.zeros(4)]
    with pytest.raises(TypeError, match="shapes"):
        call(s, 8, "data")
    with pytest.raises(TypeError, match=r"shapes\[0\]"):
        call(s, [8], "data")
    with pytest.raises(ValueError, match="1 offsets for 2 shards"):
        call(s * 2, [(2, 2), (2, 2)], "data", offsets=[0])
    with pytest.raises(ValueError, match="lengths"):
        call(s * 2, [(2, 2), (2, 2)], "data", lengths=[4, 4, 4])
    with pytest.raises(ValueError, match="amax_epsilon"):
        call(s, [(2, 4)], "data", fmt="blockwise", amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="model_dtype"):
        call(s, [(2, 4)], "data", model_dtype=jnp.int8)
    with pytest.raises(TypeError, match="shards must be a list"):
        call(jnp.zeros(4), [(2, 4)], "data")
    with pytest.raises(ValueError, match=r"shards\[0\] must be flat"):
        call([jnp.zeros((2, 2))], [(2, 2)], "data")
    with pytest.raises(TypeError, match="gather_master_weights: qshards"):
        shard_map(lambda b: gather_master_weights(jf.quantize_mxfp8(b), "data"), mesh=_mesh(2), in_specs=P("data"),
                  out_specs=P())(np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"shard_windows: split must be one of \('per_weight', 'flat'\)"):
        shard_windows([(2, 2)], 2, split="zero3")
    with pytest.raises(TypeError, match="layout"):  # the tensor layout is not the ZeRO split's keyword
        shard_windows([(2, 2)], 2, layout="flat")
