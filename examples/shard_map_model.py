"""The FP8 MLP under shard_map on a (data x seq) mesh, with ZeRO-sharded fp32 master weights, every
projection on the FP8 GEMM (``jax_fp8.fp8_dot_general``, Float8 blockwise).

Each step, inside shard_map:
  1. quantize_master_weights: every data rank casts its flat fp32 master shard of every weight to Float8
     128x128 tiles (the weights' recipe) with ONE pmax of the tile amaxes (uint32 bits) for all weights;
     gather_master_weights all-gathers the FP8 shards (1 byte per element) and lays the weights out
     GEMM-ready (both orientations: fprop reads one, dgrad the other, from the same tiles).
  2. Activations are sequence-sharded; all_gather_first_dim gathers them along the sequence already
     quantized as the GEMM wants them (1x128 blocks, rowwise for fprop and columnwise for wgrad,
     GEMM-ready): FP8 travels when the local rows are a multiple of 128 (the 128x1 columnwise blocks stay
     inside one rank), else the bf16 rows are gathered and quantized after the gather (one warning;
     the same bits). The MLP runs on the full sequence; each seq rank keeps its own tokens' outputs.
  3. fprop, dgrad and wgrad all run on the FP8 GEMM. The pre-quantized weights get no gradient from
     fp8_dot_general (FP8 leaves cannot carry one), so fp8_linear below is straight-through: the weight
     gradient dW = xᵀ·dy (an FP8 GEMM on the columnwise usages of x and dy) is delivered as the gradient
     of the fp32 master, as TransformerEngine does for FP8 weights. Each data rank receives the
     gradient of its own master shard (summed over the mesh in rank order, so that any number of
     processes gives the same bits) and updates that shard with Adam (ZeRO-1 style).
Runs on 8 simulated CPU devices by default, unchanged on GPUs. ``--recipe mxfp8`` runs it all in MXFP8
(master weights with one uint8 scale all-reduce, 1x32 / 32x1 blocks; its GEMMs need Blackwell, elsewhere
they run as their reference). Then the same model trains with bf16 GEMMs on the same data (``--no-bf16``
skips it, and so does a run resumed from a checkpoint, saying why) for the loss ratio; the final summary
gives the bytes each collective moves per step next to the bf16 alternative.

Several processes (one per GPU or host, as multi-host JAX runs) join one mesh with
jax.distributed.initialize; each loads only the rows of every batch its devices hold, process 0
prints. --checkpoint-dir saves the training state (master weights and Adam moments in the weights'
shapes, biases, step, data position) with Orbax from every process, and a restart resumes from the
latest complete checkpoint, onto any mesh; while a run lives it holds the directory (a flock on
DIR/run.lock, which a crash releases), and a second run on it is refused. ``--spawn``'s processes end
with their launcher, however it ends.

  python examples/shard_map_model.py [--steps 100] [--data 4 --seq 2] [--log-every 10] [--recipe mxfp8]
  python examples/shard_map_model.py --spawn 2            # 2 local CPU processes x 4 devices (gloo)
  python examples/shard_map_model.py --checkpoint-dir ckpt --checkpoint-every 20   # run it again to resume
  python examples/shard_map_model.py --coordinator-address HOST0:1234 --num-processes 2 --process-id I
"""
from __future__ import annotations

import argparse
import json
import os
from functools import partial
import sys
import time
import warnings

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fp8 as jf  # noqa: E402
from jax import shard_map  # noqa: E402
from jax_fp8.distributed import all_gather_first_dim, gather_master_weights, quantize_master_weights  # noqa: E402
from jax_fp8.gemm import fp8_gemm, gemm_operand  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkpoint import (CheckpointMismatch, DirectoryHeld, held_message, lock_directory,  # noqa: E402
                         open_checkpoints, restore, save)
from _fp8_mlp import init_mlp, teacher_data  # noqa: E402
from _launch import (add_flags, check_flags, die_with_launcher, join_processes,  # noqa: E402
                     process_local_array, spawn, spawned, usage_error, without_spawn)

RECIPES = {"blockwise": jf.Float8BlockScaling(),  # 1x128 activations and gradients, 128x128 weights, E4M3
           "mxfp8": jf.MXFP8BlockScaling()}          # every operand in 1x32 / 32x1 blocks with E8M0 scales
QUANTIZED = (jf.BlockwiseTensor, jf.MXFP8Tensor)
FPROP = (((1,), (0,)), ((), ()))     # x (M, K) . W (K, N)
DGRAD = (((1,), (1,)), ((), ()))     # dy (M, N) . W (K, N), contracted over N


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_linear(x, wq, w_grad, recipe):
    """y (M, N) = x · W in bf16 on the FP8 GEMM of ``recipe``. ``x``: (M, K) bf16, or a tensor already
    quantized as the recipe's lhs (the gathered input); ``wq``: the gathered quantized weight (K, N);
    ``w_grad``: zeros of W's shape whose gradient is the straight-through weight gradient (see the
    module docstring)."""
    return jf.fp8_dot_general(x, wq, FPROP, preferred_element_type=jnp.bfloat16, recipe=recipe)


def _fp8_linear_fwd(x, wq, w_grad, recipe):
    pre = isinstance(x, QUANTIZED)
    xq = x if pre else jf.quantize(x, recipe.scheme("lhs"))  # one pass: rowwise (fprop) and columnwise (wgrad)
    y = jf.fp8_dot_general(xq, wq, FPROP, preferred_element_type=jnp.bfloat16, recipe=recipe)
    return y, (xq, wq, None if pre else jnp.zeros((0,), x.dtype))  # a pre-quantized x gets no gradient


def _fp8_linear_bwd(recipe, res, dy):
    xq, wq, x_dtype = res
    dyq = jf.quantize(dy, recipe.scheme("grad"))  # rowwise (dgrad) and columnwise (wgrad), one pass
    dx = (None if x_dtype is None else
          jf.fp8_dot_general(dyq, wq, DGRAD, preferred_element_type=x_dtype.dtype, recipe=recipe))
    # wgrad, dW (K, N) = xᵀ (K, M) · [dyᵀ (N, M)]ᵀ, contracted over the tokens M: both columnwise usages
    dw = fp8_gemm(gemm_operand(xq, "first"), gemm_operand(dyq, "first"), out_dtype=jnp.float32)
    return dx, None, dw


fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


@jax.custom_vjp
def bf16_linear(x, w, w_grad):
    """The bf16 baseline of fp8_linear: y = x · W in bf16 (fp32 accumulation), the weight gradient
    delivered to ``w_grad`` the same way."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _bf16_linear_fwd(x, w, w_grad):
    return bf16_linear(x, w, w_grad), (x, w)


def _bf16_linear_bwd(res, dy):
    x, w = res
    dx = jnp.dot(dy, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    return dx, None, jnp.dot(x.T, dy, preferred_element_type=jnp.float32)


bf16_linear.defvjp(_bf16_linear_fwd, _bf16_linear_bwd)


def mlp_fp8(x, ws, sinks, bs, recipe):
    """x (tokens, d): the gathered input (quantized); ws: the gathered weights (FP8); every layer on the
    FP8 GEMM of ``recipe`` (None: the bf16 baseline, bf16 inputs and weights)."""
    for i, (w, g, b) in enumerate(zip(ws, sinks, bs)):
        x = (bf16_linear(x, w, g) if recipe is None else fp8_linear(x, w, g, recipe)) + b
        if i < len(ws) - 1:
            x = jax.nn.gelu(x).astype(jnp.bfloat16)
    return x


def collective_bytes(shapes, Ls, nd: int, ns: int, rows_local: int, d_in: int, mx: bool) -> list[tuple[str, int, int]]:
    """(collective, bytes gathered/reduced per step as seen by one rank, the bf16 alternative's bytes)."""
    bm, scale_bytes = (32, 1) if mx else (128, 4)  # MXFP8: 1x32 / 32x1 blocks, uint8 E8M0 scales
    if mx:  # one uint8 exponent per 32-element block, rowwise and columnwise, for every weight
        scales = sum(a * -(-b // 32) + -(-a // 32) * b for a, b in shapes)
        scale_name = "master scale all-reduce over 'data' (one pmax of the E8M0 block scales, uint8)"
    else:
        scales = 4 * sum(-(-a // 128) * -(-b // 128) for a, b in shapes)
        scale_name = "master scale all-reduce over 'data' (one pmax of the 128x128 tile amaxes, uint32)"
    weights = nd * sum(Ls)  # elements of the gathered (padded) flat shards
    rows = rows_local * ns
    if rows_local % bm == 0:  # rowwise + columnwise FP8 data and their scales
        act = 2 * rows * d_in + scale_bytes * ns * (rows_local * -(-d_in // bm) + (rows_local // bm) * d_in)
        act_name = ("activation all-gather over 'seq' (fast path: FP8 rowwise data for fprop + columnwise for wgrad, "
                    "and their scales; each rank quantized only its own rows)")
    else:
        act = 2 * rows * d_in
        act_name = "activation all-gather over 'seq' (fallback: bf16 rows, quantized after the gather)"
    grads = 4 * weights * (1 + ns)  # all-to-all of the ranks' parts, then the seq ranks' parts gathered
    return [
        (scale_name, scales, 0),
        ("master weight all-gather over 'data' (FP8, 1 byte per element; plus 2 int32 shard windows per "
         "weight)", weights, 2 * weights),
        (act_name, act, 2 * rows * d_in),
        ("weight-gradient reduce-scatter over 'data' x 'seq' (fp32: an all-to-all over 'data', the 'seq' ranks' "
         "parts gathered, added in rank order)", grads, grads),
    ]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="The FP8 MLP on a (data x seq) device mesh with ZeRO-sharded "
                                 "master weights (8 simulated CPU devices by default).")
    ap.add_argument("--steps", type=int, default=100, help="train until this step (a resumed run included)")
    ap.add_argument("--data", type=int, default=4, help="data-parallel ranks (mesh axis 'data')")
    ap.add_argument("--seq", type=int, default=2, help="sequence-parallel ranks (mesh axis 'seq')")
    ap.add_argument("--seq-len", type=int, default=50 * 2, help="tokens per sequence (global)")
    ap.add_argument("--batch", type=int, default=12, help="sequences per step (global)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (and the last)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="skip the bf16 baseline (the same model, data and collectives with bf16 GEMMs, trained "
                         "after the FP8 run to report the loss ratio; not after a resumed run, which lacks the "
                         "FP8 losses of the steps before it)")
    ap.add_argument("--recipe", default="blockwise", choices=sorted(RECIPES),
                    help="Float8 blockwise (Hopper's FP8 GEMM) or MXFP8 (Blackwell's; elsewhere its GEMMs run as "
                         "their reference, the same numbers)")
    ap.add_argument("--metrics-out", metavar="FILE", help="append one JSON line per step, {step, loss}")
    g = ap.add_argument_group("checkpoints (Orbax)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save the training state here and resume from the "
                   "latest complete checkpoint in it on start; a run holds DIR (DIR/run.lock) while it lives, "
                   "and another run on it is refused")
    g.add_argument("--checkpoint-every", type=int, default=50, metavar="N", help="save every N steps (and the last)")
    add_flags(ap)
    return ap


def _check_flags(ap, args):
    """An argparse error naming the flag (exit status 2) for a flag the mesh or the data cannot take."""
    for flag in ("steps", "data", "seq", "seq_len", "batch", "width", "log_every", "checkpoint_every"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.batch % args.data:
        ap.error(f"--batch {args.batch} is not divisible by --data {args.data}: each data rank takes "
                 f"batch/data whole sequences")
    if args.seq_len % args.seq:
        ap.error(f"--seq-len {args.seq_len} is not divisible by --seq {args.seq}: each seq rank takes "
                 f"seq-len/seq tokens of every sequence")
    if args.spawn is not None and args.spawn < 1:
        ap.error(f"--spawn must be a positive integer, got {args.spawn}")
    if args.spawn and args.data * args.seq % args.spawn:
        ap.error(f"--spawn {args.spawn} does not divide the mesh's --data {args.data} x --seq {args.seq} = "
                 f"{args.data * args.seq} devices: every process takes the same number of them")
    check_flags(ap, args)


def _mesh_devices(ap, args):
    """The --data x --seq devices: every process's (several processes: each process loads the rows of
    its own devices, so none may sit out), else the first of the default backend's (one process may
    leave some of its devices idle, as the log's first line says), or of the CPU devices when it has
    too few."""
    n = args.data * args.seq
    if jax.process_count() > 1:
        if jax.device_count() != n:
            usage_error(ap, f"--data {args.data} x --seq {args.seq} = {n} devices, but the {jax.process_count()} "
                        f"processes have {jax.device_count()} in all: the mesh takes every process's devices")
        return jax.devices()
    devs = jax.devices()
    if len(devs) < n:  # e.g. one GPU: run the mesh on the (simulated) CPU devices instead
        cpus = jax.devices("cpu")
        if len(cpus) < n:
            have = (f"{len(cpus)} CPU device(s)" if jax.default_backend() == "cpu" else
                    f"{len(devs)} {jax.default_backend()} and {len(cpus)} CPU device(s)")
            ap.error(f"--data {args.data} x --seq {args.seq} needs {n} devices, but only {have} exist "
                     f"(for more simulated CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
        print(f"{len(devs)} {jax.default_backend()} device(s) < {n}: using the CPU devices")
        devs = cpus
    return devs[:n]


def _zero(w, nd: int):
    """A weight as ZeRO master shards: flattened, padded with zeros to a multiple of the data ranks,
    one row per rank (split "per_weight")."""
    flat = w.reshape(-1)
    return jnp.pad(flat, (0, -flat.size % nd)).reshape(nd, -1)


def _unzero(m, shape):
    """The weight of ``shape`` the master shards ``m`` hold (the inverse of _zero)."""
    return m.reshape(-1)[:shape[0] * shape[1]].reshape(shape)


def _sum_in_rank_order(x, axes, rows: bool = False):
    """The sum over the ranks of ``axes`` of ``x`` (with ``rows``: of its rows too), added in rank order,
    the same on every rank. The collective only moves values (each rank's ``x`` lands in its own slot
    of a psum, which adds zeros: exact), so one process or many, gloo or NCCL, give the same bits."""
    slots = jnp.zeros((lax.axis_size(axes),) + x.shape, x.dtype).at[lax.axis_index(axes)].set(x)
    parts = lax.psum(slots, axes)
    parts = parts.reshape((-1,) + x.shape[1:]) if rows else parts
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _hold_checkpoint_dir(ap, args):
    """The checkpoint directory's run lock (``_checkpoint.lock_directory``), taken by process 0 alone
    (the processes of one run would exclude each other) before any process opens the directory; every
    process learns whether it got it, and a directory that another live run holds is a usage error
    in all of them (exit status 2, not a hang)."""
    lock = held = None
    if jax.process_index() == 0:
        try:
            about = f", process 0 of {jax.process_count()}" if jax.process_count() > 1 else ""
            about += f" (its --spawn launcher: pid {os.getppid()})" if spawned() else ""
            lock = lock_directory(args.checkpoint_dir, about)
        except DirectoryHeld as e:
            held = str(e)
    refused = held is not None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refused)))
    if refused:
        usage_error(ap, f"--checkpoint-dir: {held or held_message(args.checkpoint_dir)}: a second run would "
                    f"overwrite its checkpoints; wait for it to end, stop it, or give another directory")
    return lock


def main(argv=None):
    """Trains the model; returns this run's losses (None from ``--spawn``'s parent process)."""
    die_with_launcher()  # first: a process of --spawn must not outlive its launcher
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _parser()
    args = ap.parse_args(argv)
    _check_flags(ap, args)
    if args.spawn:
        status = spawn(os.path.abspath(__file__), without_spawn(argv), args.spawn, args.data * args.seq)
        if status:
            raise SystemExit(status)
        return None
    join_processes(ap, args)
    devices = _mesh_devices(ap, args)
    lock = _hold_checkpoint_dir(ap, args) if args.checkpoint_dir else None
    try:
        return _train(ap, args, devices)
    finally:
        if lock is not None:
            lock.close()


def _train(ap, args, devices):
    """main's training run on ``devices``; returns its losses."""
    nd, ns = args.data, args.seq
    mesh = Mesh(np.array(devices).reshape(nd, ns), ("data", "seq"))
    log = print if jax.process_index() == 0 else (lambda *a, **k: None)  # the others print only errors
    sizes = [128, args.width, args.width, 16]
    shapes = [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
    opt = optax.adam(3e-3)
    on = lambda spec: NamedSharding(mesh, spec)  # noqa: E731

    def init_state():
        params = init_mlp(jax.random.key(0), sizes)
        masters = [_zero(p["w"], nd) for p in params]
        biases = [p["b"] for p in params]
        return {"masters": masters, "biases": biases,  # one Adam state per data rank's shards
                "opt": {"masters": jax.vmap(opt.init)(masters), "biases": opt.init(biases)}}

    shape_of_state = jax.eval_shape(init_state)
    specs = {"masters": [P("data")] * len(shapes), "biases": [P()] * len(shapes),
             "opt": {"masters": jax.tree.map(lambda _: P("data"), shape_of_state["opt"]["masters"]),
                     "biases": jax.tree.map(lambda _: P(), shape_of_state["opt"]["biases"])}}
    init_state = jax.jit(init_state, out_shardings=jax.tree.map(on, specs))
    state = init_state()

    # a checkpoint holds the weights and their Adam moments in the model's shapes, not in the ZeRO
    # layout of one mesh, so that it restores onto another mesh
    def to_checkpoint(state, step, position):
        adam, badam = state["opt"]["masters"][0], state["opt"]["biases"][0]
        un = lambda ms: [_unzero(m, s) for m, s in zip(ms, shapes)]  # noqa: E731
        return {"weights": un(state["masters"]), "biases": state["biases"],
                "adam": {"count": adam.count[0], "mu": un(adam.mu), "nu": un(adam.nu)},
                "bias_adam": {"count": badam.count, "mu": badam.mu, "nu": badam.nu},
                "step": step, "data_position": position}

    def from_checkpoint(c):
        masters = [_zero(w, nd) for w in c["weights"]]
        adam, *rest = jax.vmap(opt.init)(masters)  # the optimizer's structure; the values come from c
        adam = adam._replace(count=jnp.full((nd,), c["adam"]["count"]), mu=[_zero(v, nd) for v in c["adam"]["mu"]],
                             nu=[_zero(v, nd) for v in c["adam"]["nu"]])
        badam, *brest = opt.init(c["biases"])
        return {"masters": masters, "biases": c["biases"],
                "opt": {"masters": (adam, *rest), "biases": (badam._replace(**c["bias_adam"]), *brest)}}

    zero = jnp.zeros((), jnp.int32)
    c_shape = jax.eval_shape(to_checkpoint, state, zero, zero)
    c_specs = jax.tree.map(lambda a: P("data") if a.ndim == 2 and a.shape[0] % nd == 0 else P(), c_shape)
    to_checkpoint = jax.jit(to_checkpoint, out_shardings=jax.tree.map(on, c_specs))
    from_checkpoint = jax.jit(from_checkpoint, out_shardings=jax.tree.map(on, specs))

    x_all, y_all = (np.asarray(a) for a in teacher_data(jax.random.key(1), 4096, sizes[0], sizes[-1]))
    batch_sharding = on(P("seq", "data"))

    def load_batch(position):
        """Batch number ``position`` (seq, batch, d): each process reads only the rows its devices hold."""
        idx = np.random.default_rng([2, position]).integers(0, len(x_all), (args.seq_len, args.batch))
        return tuple(process_local_array(batch_sharding, idx.shape + a.shape[1:],
                                         lambda box, a=a: a[idx[box[:2]]][..., box[2]]) for a in (x_all, y_all))

    seq_local = args.seq_len // ns
    b_local = args.batch // nd
    rows_local = seq_local * b_local
    recipe = RECIPES[args.recipe]
    mx = args.recipe == "mxfp8"
    bm = 32 if mx else 128  # rows of the columnwise blocks
    procs = f"{jax.process_count()} processes, " if jax.process_count() > 1 else ""
    pool = jax.local_devices(backend=devices[0].platform)  # one process may leave some of them idle
    subset = f" (on {len(devices)} of the {len(pool)} {pool[0].platform} devices)" if len(devices) < len(pool) else ""
    what = ("MXFP8: 1x32 / 32x1 blocks, E8M0 scales" if mx else
            "Float8 blockwise: 1x128 activations/gradients, 128x128 weights")
    log(f"backend {jax.default_backend()}, {procs}mesh data={nd} x seq={ns}{subset}; MLP {sizes}, every layer on the "
        f"FP8 GEMM ({what}); local activations ({seq_local} tokens x {b_local} seqs) = {rows_local} rows: " +
        ("fast path (FP8 gathered)" if rows_local % bm == 0 else
         f"fallback (not a multiple of the {bm}-row columnwise blocks)"))

    def local_step(state, x, y, recipe):
        masters = [m[0] for m in state["masters"]]
        opt_m = jax.tree.map(lambda a: a[0], state["opt"]["masters"])
        biases = state["biases"]
        s, b = x.shape[:2]
        x = x.reshape(s * b, -1).astype(jnp.bfloat16)
        if recipe is None:  # the bf16 baseline: bf16 weights and activations gathered
            ws = [_unzero(lax.all_gather(m.astype(jnp.bfloat16), "data"), shape) for m, shape in zip(masters, shapes)]
            xs = lax.all_gather(x, "seq", tiled=True)
        else:
            qs = quantize_master_weights(masters, shapes, "data", **({"fmt": "mxfp8"} if mx else
                                                                     {"fmt": "blockwise", "block": (128, 128)}))
            ws = gather_master_weights(qs, "data", layout="gemm_ready")  # FP8, both orientations
            # the input, gathered along the sequence as the GEMMs read it (no gradient: it is data)
            xs = all_gather_first_dim(x, "seq", recipe.scheme("lhs"))
        # their gradients: the masters' (straight-through) and the biases', this rank's share (typed per
        # device, so that JAX leaves the sums to us: in rank order, below)
        ranks = ("data", "seq")
        sinks = [lax.pcast(jnp.zeros(shape, jnp.float32), ranks, to="varying") for shape in shapes]

        def loss_fn(sinks, biases):
            out = mlp_fp8(xs, ws, sinks, biases, recipe)  # the full sequence on every seq rank
            mine = lax.dynamic_slice_in_dim(out, lax.axis_index("seq") * s * b, s * b)
            return jnp.sum((mine - y.reshape(s * b, -1)) ** 2) / (args.seq_len * args.batch * sizes[-1])

        loss, (gw, gb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(sinks, lax.pcast(biases, ranks, to="varying"))
        loss = _sum_in_rank_order(loss, ranks)
        gb = [_sum_in_rank_order(g, ranks) for g in gb]
        # ZeRO: each data rank receives every rank's part of its own master shard's gradient (an all-to-all
        # over 'data', the seq ranks' parts gathered) and adds them up in rank order
        gs = [_sum_in_rank_order(lax.all_to_all(_zero(g, nd), "data", 0, 0, tiled=True), "seq", rows=True) for g in gw]
        upd, opt_m = opt.update(gs, opt_m, masters)
        masters = optax.apply_updates(masters, upd)
        upd, opt_b = opt.update(gb, state["opt"]["biases"], biases)
        state = {"masters": [m[None] for m in masters], "biases": optax.apply_updates(biases, upd),
                 "opt": {"masters": jax.tree.map(lambda a: a[None], opt_m), "biases": opt_b}}
        return state, loss

    def make_step(recipe):
        return jax.jit(shard_map(partial(local_step, recipe=recipe), mesh=mesh,
                                 in_specs=(specs, P("seq", "data"), P("seq", "data")), out_specs=(specs, P())))

    step = make_step(recipe)

    start = position = 0
    checkpoints = open_checkpoints(args.checkpoint_dir) if args.checkpoint_dir else None
    if checkpoints is not None and checkpoints.latest_step() is not None:
        latest = checkpoints.latest_step()
        target = jax.tree.map(lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on(p)), c_shape, c_specs)
        try:
            c = restore(checkpoints, latest, target)
        except CheckpointMismatch as e:
            usage_error(ap, f"--checkpoint-dir: {e}: it was saved by a model of other flags (here --width "
                        f"{args.width})")
        state, start, position = from_checkpoint(c), int(c["step"]), int(c["data_position"])
        log(f"resumed from the checkpoint of step {start} in {checkpoints.directory}")
    metrics = open(args.metrics_out, "a") if args.metrics_out and jax.process_index() == 0 else None
    losses = []
    t0 = time.time()
    with warnings.catch_warnings():
        # the gather's one-time fallback notice (the header line reports the path); GEMM warnings still show
        warnings.filterwarnings("ignore", message="all_gather_first_dim: local shape")
        for i in range(start, args.steps):
            x, y = load_batch(position)
            position += 1
            state, loss = step(state, x, y)
            losses.append(float(loss))
            if metrics:
                print(json.dumps({"step": i + 1, "loss": losses[-1]}), file=metrics, flush=True)
            if i == start or (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                log(f"step {i + 1:4d}/{args.steps}  loss {losses[-1]:.5f}  ({time.time() - t0:.1f}s)", flush=True)
            if checkpoints is not None and ((i + 1) % args.checkpoint_every == 0 or i + 1 == args.steps):
                save(checkpoints, i + 1, to_checkpoint(state, jnp.int32(i + 1), jnp.int32(position)))
    if checkpoints is not None:
        checkpoints.wait_until_finished()
        checkpoints.close()
    if metrics:
        metrics.close()
    if not losses:
        log(f"already at step {start} of --steps {args.steps}: nothing to train")
        return losses
    log(f"loss {losses[0]:.4f} -> {losses[-1]:.5f} in {time.time() - t0:.1f}s")
    if args.bf16 and start:
        log(f"no bf16 baseline: this run resumed at step {start}, and the loss ratio needs the FP8 losses of "
            f"every step from 1 (a run from step 1 ends with it)")
    elif args.bf16:  # the same steps from the same start, with bf16 GEMMs
        bf16_step, bf16_state, bf16_losses = make_step(None), init_state(), []
        for position in range(args.steps):
            bf16_state, loss = bf16_step(bf16_state, *load_batch(position))
            bf16_losses.append(float(loss))
        tail = max(1, args.steps // 10)
        fp8_final, bf16_final = (sum(v[-tail:]) / tail for v in (losses, bf16_losses))
        log(f"final loss (mean of the last {tail} steps): fp8 ({args.recipe}) {fp8_final:.5f}   bf16 {bf16_final:.5f}"
            f"   fp8 / bf16: loss ratio {fp8_final / bf16_final:.4f}")

    log("bytes per step (each rank's gathered / reduced payload) vs the same step with bf16 weights and activations:")
    Ls = [-(-a * b // nd) for a, b in shapes]
    for name, fp8, bf16 in collective_bytes(shapes, Ls, nd, ns, rows_local, sizes[0], mx):
        log(f"  {name}: {fp8:,} B   (bf16: {bf16:,} B" + (f", {fp8 / bf16:.2f}x)" if bf16 else ", none)"))
    return losses


if __name__ == "__main__":
    main()
