"""One process of a multi-process test (tests/multiprocess.py starts N of them): joins the others with
``jax.distributed.initialize`` (gloo CPU collectives) into one mesh of 8 CPU devices, runs one case on
global arrays built from the same host data in every process, and checks its own devices' results
against the single-process computation, bit for bit. A failed check raises (exit status 1).

Usage: python mp_worker.py CASE[,CASE...] PROCESS_ID NUM_PROCESSES PORT
"""
import sys

import jax

CASE, PID, N, PORT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=N, process_id=PID)

import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fp8 as jf  # noqa: E402
from helpers import assert_bits_equal, assert_tensors_equal  # noqa: E402  (tests/ is this script's folder)
from jax_fp8.distributed import (all_gather_dequantized, all_gather_first_dim, gather_master_weights,  # noqa: E402
                                 local_shards, quantize_master_weights, split_masters)

MESH = jax.make_mesh((8,), ("data",))
CPU = jax.local_devices()[0]  # the single-process computation runs on one local device


def global_array(host, spec=P("data")):
    """``host`` (the same in every process) as one global array sharded over the mesh."""
    return jax.make_array_from_callback(host.shape, NamedSharding(MESH, spec), lambda idx: host[idx])


def per_rank(fn):
    """shard_map of ``fn``, whose result every rank holds whole (typed varying, as lax.all_gather's):
    each rank returns its own copy, stacked along the data axis."""
    return jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda v: v[None], fn(*a)), mesh=MESH,
                                 in_specs=P("data"), out_specs=P("data")))


def local_copies(out):
    """Every copy this process holds of a per-rank result: a list (one per local device) of pytrees."""
    leaves, tree = jax.tree.flatten(out)
    shards = [sorted(leaf.addressable_shards, key=lambda s: s.index[0].start) for leaf in leaves]
    assert all(len(s) == len(jax.local_devices()) == 8 // N for s in shards), [len(s) for s in shards]
    return [jax.tree.unflatten(tree, [np.asarray(s[i].data)[0] for s in shards]) for i in range(len(shards[0]))]


def assert_all_equal(got, want, what):
    """Each quantized tensor of ``got`` equal to ``want``'s (helpers.assert_tensors_equal), naming ``what``."""
    got, want = (list(v) if isinstance(v, (list, tuple)) else [v] for v in (got, want))
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        try:
            assert_tensors_equal(g, w)
        except AssertionError as e:
            raise AssertionError(f"{what}, tensor {i}: {e}") from None


def case_master_weights():
    """The ZeRO master-weight cast, both formats, both tensor layouts, both splits: the gathered FP8
    weights equal quantizing the full weights in one process, and the scales take one all-reduce. One
    program per split and format gathers the quantized shards in both layouts (the same one quantization:
    still one all-reduce)."""
    rng = np.random.default_rng(2901)
    shapes = [(256, 384), (130, 200), (64, 96)]
    masters = [rng.standard_normal(s).astype(np.float32) * 4 for s in shapes]
    configs = [("mxfp8", None), ("blockwise", (128, 128)), ("blockwise", (1, 128))]
    layouts = ("compact", "gemm_ready")
    for split in ("per_weight", "flat"):
        bufs = split_masters(masters, 8, split=split)
        host = [np.asarray(b) for b in bufs] if split == "per_weight" else [np.asarray(bufs)]
        args = [global_array(h) for h in host]
        for fmt, block in configs:
            def step(*local):
                local = list(local) if split == "per_weight" else local[0]
                shards, offs, lens = local_shards(local, shapes, "data", split=split)
                qs = quantize_master_weights(shards, shapes, "data", offsets=offs, lengths=lens,
                                             fmt=fmt, block=block)  # noqa: B023
                return {layout: gather_master_weights(qs, "data", layout=layout) for layout in layouts}

            compiled = per_rank(step).lower(*args).compile()  # one compilation: run it, read its HLO
            copies = local_copies(compiled(*args))
            for layout in layouts:
                if fmt == "mxfp8":
                    scheme = jf.Scheme("mxfp8", rowwise=True, colwise=True, layout=layout)
                else:
                    scheme = jf.Scheme("blockwise", rowwise=True, colwise=True, block=block, layout=layout)
                want = [jf.quantize(jax.device_put(m, CPU).astype(jnp.bfloat16), scheme) for m in masters]
                for copy in copies:
                    assert_all_equal(copy[layout], want, f"{split} {fmt} {block} {layout}")
            hlo = compiled.as_text()
            reduces = hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(")
            assert reduces == 1, f"{split} {fmt}: {reduces} all-reduces in the compiled HLO, want 1"
    print(f"process {PID}: master weights equal single-process quantization", flush=True)


def case_sequence_gather():
    """The sequence-parallel gather, direct (64 local rows: FP8 travels) and fallback (48: gathered in
    high precision, quantized after): the same bits as quantizing the gathered tensor in one process."""
    rng = np.random.default_rng(2902)
    schemes = [jf.Scheme("mxfp8", rowwise=True, colwise=True),
               jf.Scheme("blockwise", rowwise=True, colwise=True, layout="gemm_ready")]
    for rows in (64, 48):
        x = rng.standard_normal((8 * rows, 256)).astype(np.float32)
        for scheme in schemes:
            f = per_rank(lambda v: all_gather_first_dim(v, "data", scheme))  # noqa: B023
            want = jf.quantize(jax.device_put(x, CPU), scheme)
            for copy in local_copies(f(global_array(x))):
                assert_all_equal(copy, want, f"rows {rows} {scheme}")
    print(f"process {PID}: sequence gather equals single-process quantization", flush=True)


def local_values(out):
    """This process's part of a global result, as {global index: value} per addressable shard."""
    return {str(s.index): np.asarray(s.data) for s in out.addressable_shards}


def assert_close(got, want, what, rtol=2e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol, err_msg=what)


def case_gradients():
    """Under the public jax.shard_map with its default checks: the data-parallel gradients of
    fp8_dot_general (dW summed over the ranks once, as one process computes it on all rows), and the
    sequence-parallel gradients through all_gather_dequantized against lax.all_gather's (the same
    straight-through computation with lax's collective)."""
    rng = np.random.default_rng(2903)
    kn = (((1,), (0,)), ((), ()))
    x, w = rng.standard_normal((8 * 128, 256)).astype(np.float32), rng.standard_normal((256, 128)).astype(np.float32)

    def dp_loss(x, w):
        return jax.lax.psum(jnp.sum(jf.fp8_dot_general(x, w, kn) ** 2), "data")

    g = jax.jit(jax.shard_map(jax.grad(dp_loss, argnums=(0, 1)), mesh=MESH, in_specs=(P("data"), P()),
                              out_specs=(P("data"), P())))
    dx, dw = g(global_array(x), global_array(w, P()))
    one = jax.grad(lambda x, w: jnp.sum(jf.fp8_dot_general(x, w, kn) ** 2), argnums=(0, 1))
    dx1, dw1 = one(jax.device_put(x, CPU), jax.device_put(w, CPU))
    for s in dx.addressable_shards:  # each rank's rows of dx: its own rows' GEMM
        assert_close(s.data, np.asarray(dx1)[s.index], f"dx rows {s.index}")
    # dW: one sum of the ranks' partial products (fp32, in another order than one GEMM over all rows)
    assert_close(dw.addressable_shards[0].data, dw1, "dW", rtol=1e-4, atol=1e-2)

    local_rows = 64
    x = rng.standard_normal((8 * local_rows, 256)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    gather = lambda v: all_gather_dequantized(v, "data", jf.Scheme("mxfp8"))  # noqa: E731

    def straight(v):  # lax: the gathered quantized values forward, lax.all_gather's derivative
        full = jax.lax.all_gather(v, "data", tiled=True)
        return jax.lax.stop_gradient(gather(v)) + (full - jax.lax.stop_gradient(full))

    def sp_loss(gather):
        def f(x, w):
            mine = jax.lax.dynamic_slice_in_dim(gather(x), jax.lax.axis_index("data") * local_rows, local_rows)
            return jax.lax.psum(jnp.sum(jnp.tanh(mine @ w)), "data")
        return f

    out = {}
    for key, gat in (("ours", gather), ("lax", straight)):
        f = jax.shard_map(jax.value_and_grad(sp_loss(gat), argnums=(0, 1)), mesh=MESH, in_specs=(P("data"), P()),
                          out_specs=(P(), (P("data"), P())))
        out[key] = jax.jit(f)(global_array(x), global_array(w, P()))
    assert_bits_equal(out["ours"][0].addressable_shards[0].data, out["lax"][0].addressable_shards[0].data, "loss")
    for i, name in ((0, "dx"), (1, "dW")):
        ours, lax_ = local_values(out["ours"][1][i]), local_values(out["lax"][1][i])
        for idx in ours:
            assert_close(ours[idx], lax_[idx], f"{name} {idx}")
    print(f"process {PID}: gradients equal the single-process and lax computations", flush=True)


assert jax.process_count() == N and len(jax.devices()) == 8, (jax.process_count(), len(jax.devices()))
for case in CASE.split(","):
    globals()[f"case_{case}"]()
jax.distributed.shutdown()
