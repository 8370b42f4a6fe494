"""The FP8 MLP under shard_map on a (data x seq) mesh, with ZeRO-sharded fp32 master weights.

Each step, inside shard_map:
  1. quantize_master_weights: every data rank casts its flat fp32 master shard of every weight to
     MXFP8 with ONE uint8 pmax of the E8M0 scales; gather_master_weights assembles the FP8 weights.
  2. Activations are sequence-sharded; all_gather_dequantized gathers them along the sequence (the
     local length is not a multiple of the 32-row block, so the dequantize-gather-requantize fallback
     runs), the MLP runs on the full sequence, each seq rank keeps its own tokens' outputs.
  3. Weight gradients (straight-through) are summed over the mesh and each data rank updates only its
     own master shard with Adam (ZeRO-1 style).
Runs on 8 simulated CPU devices by default, unchanged on GPUs.

  python examples/shard_map_model.py [--steps 100] [--data 4 --seq 2] [--log-every 10]
"""
from __future__ import annotations

import argparse
import os
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
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_fp8 as jf  # noqa: E402
from jax_fp8._compat import shard_map  # noqa: E402
from jax_fp8.distributed import (Quantizer, all_gather_dequantized, gather_master_weights,  # noqa: E402
                                 quantize_master_weights)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fp8_mlp import init_mlp, teacher_data  # noqa: E402


def mlp_fp8(ws, bs, x):
    """x (tokens, d) through the gathered FP8 weights (dequantized to bf16 for the matmul)."""
    for i, (w, b) in enumerate(zip(ws, bs)):
        x = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32) + b
        if i < len(ws) - 1:
            x = jax.nn.gelu(x)
    return x


def _mesh_devices(ap, args):
    """Checks the mesh flags (argparse error naming the flag, exit status 2) and returns the
    --data x --seq devices: the default backend's, or the CPU devices when it has too few."""
    for flag in ("steps", "data", "seq", "seq_len", "batch", "width", "log_every"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.batch % args.data:
        ap.error(f"--batch {args.batch} is not divisible by --data {args.data}: each data rank takes "
                 f"batch/data whole sequences")
    if args.seq_len % args.seq:
        ap.error(f"--seq-len {args.seq_len} is not divisible by --seq {args.seq}: each seq rank takes "
                 f"seq-len/seq tokens of every sequence")
    n = args.data * args.seq
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


def main(argv=None):
    ap = argparse.ArgumentParser(description="The FP8 MLP on a (data x seq) device mesh with ZeRO-sharded "
                                 "master weights (8 simulated CPU devices by default).")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--data", type=int, default=4, help="data-parallel ranks (mesh axis 'data')")
    ap.add_argument("--seq", type=int, default=2, help="sequence-parallel ranks (mesh axis 'seq')")
    ap.add_argument("--seq-len", type=int, default=50 * 2, help="tokens per sequence (global)")
    ap.add_argument("--batch", type=int, default=12, help="sequences per step (global)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (and the last)")
    args = ap.parse_args(argv)
    nd, ns = args.data, args.seq
    devs = _mesh_devices(ap, args)
    mesh = Mesh(np.array(devs).reshape(nd, ns), ("data", "seq"))
    sizes = [128, args.width, args.width, 16]
    shapes = [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
    params = init_mlp(jax.random.key(0), sizes)
    # ZeRO layout: each weight flattened, padded to a multiple of the data ranks, split evenly.
    Ls = [-(-a * b // nd) for a, b in shapes]
    masters = [jnp.pad(p["w"].reshape(-1), (0, nd * L - p["w"].size)).reshape(nd, L) for p, L in zip(params, Ls)]
    biases = [p["b"] for p in params]
    opt = optax.adam(3e-3)
    opt_state = jax.vmap(opt.init)(masters)  # one Adam state per data rank's shards
    bias_state = opt.init(biases)
    x_all, y_all = teacher_data(jax.random.key(1), 4096, sizes[0], sizes[-1])
    seq_local = args.seq_len // ns
    b_local = args.batch // nd
    quantizer = Quantizer("mxfp8", rowwise=True, colwise=False)
    print(f"backend {jax.default_backend()}, mesh data={nd} x seq={ns}; MLP {sizes}; local activations "
          f"({seq_local} tokens x {b_local} seqs) = {seq_local * b_local} rows: "
          f"{'fast path' if (seq_local * b_local) % 32 == 0 else 'fallback (not a multiple of 32)'}")

    def local_step(masters, opt_state, biases, x, y):
        masters = [m[0] for m in masters]
        opt_state = jax.tree_util.tree_map(lambda a: a[0], opt_state)
        qs = quantize_master_weights(masters, shapes, "data", colwise=True)
        ws = [jf.dequantize(w, jnp.bfloat16, "colwise") for w in gather_master_weights(qs, "data")]
        s, b = x.shape[:2]

        def loss_fn(ws, biases):
            xs = all_gather_dequantized(x.reshape(s * b, -1).astype(jnp.bfloat16), "seq", quantizer)
            out = mlp_fp8(ws, biases, xs)  # the full sequence on every seq rank
            mine = lax.dynamic_slice_in_dim(out, lax.axis_index("seq") * s * b, s * b)
            return jnp.sum((mine - y.reshape(s * b, -1)) ** 2) / (args.seq_len * args.batch * sizes[-1])

        loss, (gw, gb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(ws, biases)
        loss = lax.psum(loss, ("data", "seq"))
        gw = [lax.psum(g.astype(jnp.float32), ("data", "seq")) for g in gw]
        gb = [lax.psum(g, ("data", "seq")) for g in gb]
        # ZeRO: each data rank keeps the gradient slice of its own master shard
        r = lax.axis_index("data")
        gs = [lax.dynamic_slice_in_dim(jnp.pad(g.reshape(-1), (0, nd * m.size - g.size)), r * m.size, m.size)
              for g, m in zip(gw, masters)]
        upd, opt_state = opt.update(gs, opt_state, masters)
        masters = optax.apply_updates(masters, upd)
        return ([m[None] for m in masters], jax.tree_util.tree_map(lambda a: a[None], opt_state), loss, gb)

    spec_state = jax.tree_util.tree_map(lambda _: P("data"), opt_state)
    step = jax.jit(shard_map(local_step, mesh=mesh,
                             in_specs=([P("data")] * len(masters), spec_state, P(), P("seq", "data"),
                                       P("seq", "data")),
                             out_specs=([P("data")] * len(masters), spec_state, P(), P())))

    rng = np.random.default_rng(2)
    losses = []
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's one-time notice; the header line reports the path
        for i in range(args.steps):
            idx = rng.integers(0, x_all.shape[0], (args.seq_len, args.batch))
            x, y = x_all[idx], y_all[idx]  # (seq, batch, d)
            masters, opt_state, loss, gb = step(masters, opt_state, biases, x, y)
            upd, bias_state = opt.update(gb, bias_state, biases)
            biases = optax.apply_updates(biases, upd)
            losses.append(float(loss))
            if i == 0 or (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                print(f"step {i + 1:4d}/{args.steps}  loss {losses[-1]:.5f}  ({time.time() - t0:.1f}s)", flush=True)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.5f} in {time.time() - t0:.1f}s")

    n_blocks = sum(a * -(-b // 32) + -(-a // 32) * b for a, b in shapes)
    print(f"scale all-reduce per step: one uint8 pmax of {n_blocks} E8M0 bytes per rank "
          f"(bf16-amax alternative: {2 * n_blocks} bytes, fp32: {4 * n_blocks} bytes)")
    return losses


if __name__ == "__main__":
    main()
