"""Train a small mixture-of-experts language model whose experts run on ``jax_fp8.fp8_ragged_dot``,
next to the same model on bf16 ``lax.ragged_dot``.

The model: token embedding, then per layer a causal self-attention (bf16) and a mixture-of-experts
SwiGLU feed-forward, each behind an RMSNorm with a residual, then the unembedding. The MoE block: a
router (fp32) picks each token's top-k experts and weights them (softmax over the chosen k), a
load-balancing loss (Switch Transformer's: experts x sum_e fraction_e x mean probability_e) keeps the
experts in use, ``jax_fp8.groups.route`` sorts the token copies by expert into the grouped layout
(each expert's rows padded to 128: the layout the blockwise FP8 grouped GEMMs prefer), the experts'
gate, up and down projections are three grouped GEMMs (``ragged_dot``), and ``Routing.unpermute`` sums
each token's k outputs with its router weights. Group sizes stay on the device: one compile serves
every routing. Both runs start from the same parameters and see the same batches (next-token
prediction on a fixed random Markov chain).

  python examples/train_moe.py [--steps 60] [--experts 8] [--top-k 2] [--d-model 128 --ffn 256]
                               [--layers 1] [--seq 64 --batch 8] [--expert-parallel N]

``--expert-parallel N`` splits the experts over N devices (``jax.shard_map`` over a mesh axis "ep", the
batch split over it too): each device routes its tokens, sends each token copy to the device holding
its expert with an all-to-all, runs its own experts on what it receives, and sends the outputs back. In
the FP8 run the outgoing activations travel as FP8 (``jax_fp8.distributed.all_to_all_dequantized``: data
and scales); the bf16 run sends bf16. On the CPU it simulates the devices (XLA_FLAGS, set here).

On the CPU the grouped FP8 GEMMs run as their reference (fp32 products of the FP8 data per 128-wide
block, scaled), so the CPU's step times say nothing about a GPU's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Optional

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # --expert-parallel on a CPU
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _transformer as T  # noqa: E402  (the Markov-chain data)
import jax_fp8 as jf  # noqa: E402
from jax_fp8.distributed import all_to_all_dequantized  # noqa: E402

PAD_TO = 128  # each expert's rows padded to whole 128-row blocks
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # split over the "ep" axis by their first dim
WIRE = jf.Scheme("blockwise", jnp.float8_e4m3fn, rowwise=True, colwise=False, block=(1, 128))

#: the variants' grouped GEMM: bf16 operands, outputs in bf16
RAGGED_DOTS = {"fp8": jf.fp8_ragged_dot, "bf16": lax.ragged_dot}


def exchange(x, axis: str, fp8: bool):
    """Chunk i of x's first dim to device i over ``axis``: FP8 on the wire in the FP8 run."""
    return all_to_all_dequantized(x, axis, WIRE) if fp8 else lax.all_to_all(x, axis, 0, 0, tiled=True)


def experts_apart(x, ids, weights, experts, axis: str, ffn_of, fp8: bool):
    """The expert-parallel MoE output of this device's tokens ``x`` (T, d) routed to experts ``ids`` (T, k)
    with ``weights``: every token copy sent to the device holding its expert (``experts`` per device) in a
    chunk of T * k rows per device (none ever dropped), the received rows run through ``ffn_of`` (rows,
    local expert ids) in the grouped layout, the outputs sent back and summed per token."""
    T, k = ids.shape
    n, A = lax.psum(1, axis), T * k
    flat = ids.reshape(-1)
    dest, local = flat // experts, flat % experts
    order = jnp.argsort(flat, stable=True)  # by device, then expert, then token
    counts = jnp.zeros((n,), jnp.int32).at[dest].add(1)  # copies per device
    first = jnp.cumsum(counts) - counts
    slot = jnp.zeros((A,), jnp.int32).at[order].set(jnp.arange(A, dtype=jnp.int32) - first[dest[order]])
    send = jnp.zeros((n, A, x.shape[1]), x.dtype).at[dest, slot].set(x[jnp.arange(A) // k])
    send_ids = jnp.full((n, A), experts, jnp.int32).at[dest, slot].set(local)  # `experts`: an empty row
    rows, row_ids = exchange(send, axis, fp8), lax.all_to_all(send_ids, axis, 0, 0, tiled=True)
    out = ffn_of(rows.reshape(n * A, -1), row_ids.reshape(-1))
    back = lax.all_to_all(out.reshape(n, A, -1), axis, 0, 0, tiled=True)  # the outputs, home again
    return (back[dest, slot].reshape(T, k, -1) * weights[..., None].astype(back.dtype)).sum(axis=1)


class MoE(nn.Module):
    """A mixture-of-experts SwiGLU feed-forward on (tokens, d_model) rows; returns (output, balance loss)."""

    experts: int
    top_k: int
    ffn: int
    ragged_dot: Callable
    dtype: jnp.dtype = jnp.bfloat16
    expert_axis: Optional[str] = None  # expert parallel: the shard_map axis the experts split over

    @nn.compact
    def __call__(self, x):
        tokens, d = x.shape
        E, k = self.experts, self.top_k
        probs = jax.nn.softmax(nn.Dense(E, use_bias=False, name="router")(x.astype(jnp.float32)))
        top, ids = lax.top_k(probs, k)
        weights = top / top.sum(-1, keepdims=True)
        fraction = jnp.zeros((E,), jnp.float32).at[ids.reshape(-1)].add(1.0) / (tokens * k)
        balance = E * jnp.sum(fraction * probs.mean(0))  # 1 when balanced (this device's tokens)
        here = E // (lax.psum(1, self.expert_axis) if self.expert_axis else 1)  # the experts on this device
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2)
        w_gate, w_up = (self.param(n, init, (here, d, self.ffn)).astype(self.dtype) for n in ("w_gate", "w_up"))
        w_down = self.param("w_down", init, (here, self.ffn, d)).astype(self.dtype)

        def ffn_of(rows, row_ids):  # the SwiGLU experts on rows in the grouped layout of their experts' ids
            routing = jf.groups.route(row_ids[:, None], here + 1, PAD_TO)  # id `here`: an empty row, last
            grouped, sizes = routing.permute(rows, 1), routing.group_sizes[:here]  # past the experts' rows: 0
            h = nn.silu(self.ragged_dot(grouped, w_gate, sizes)) * self.ragged_dot(grouped, w_up, sizes)
            return routing.unpermute(self.ragged_dot(h.astype(self.dtype), w_down, sizes),
                                     jnp.ones((rows.shape[0], 1), self.dtype))

        x = x.astype(self.dtype)
        if self.expert_axis:
            fp8 = self.ragged_dot is jf.fp8_ragged_dot
            return experts_apart(x, ids, weights, here, self.expert_axis, ffn_of, fp8), balance
        copies = jnp.repeat(x, k, axis=0)  # each token's k copies, in (token, choice) order
        out = ffn_of(copies, ids.reshape(-1))
        return (out.reshape(tokens, k, d) * weights[..., None].astype(out.dtype)).sum(axis=1), balance


class Layer(nn.Module):
    heads: int
    moe: MoE

    @nn.compact
    def __call__(self, x):  # (batch, seq, d_model)
        B, S, d = x.shape
        h = nn.RMSNorm(name="attn_norm")(x)
        attn = nn.SelfAttention(self.heads, dtype=jnp.bfloat16, use_bias=False, name="attn")
        x = x + attn(h, mask=nn.make_causal_mask(jnp.ones((B, S)))).astype(x.dtype)
        h = nn.RMSNorm(name="moe_norm")(x)
        y, balance = self.moe(h.reshape(B * S, d))
        return x + y.reshape(B, S, d).astype(x.dtype), balance


class Model(nn.Module):
    vocab: int
    d_model: int
    heads: int
    layers: int
    experts: int
    top_k: int
    ffn: int
    ragged_dot: Callable
    expert_axis: Optional[str] = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, name="embed")(tokens)
        balance = 0.0
        for i in range(self.layers):
            moe = MoE(self.experts, self.top_k, self.ffn, self.ragged_dot, expert_axis=self.expert_axis, name=f"moe_{i}")
            x, b = Layer(self.heads, moe, name=f"layer_{i}")(x)
            balance = balance + b
        logits = nn.Dense(self.vocab, use_bias=False, name="unembed")(nn.RMSNorm(name="final_norm")(x))
        return logits, balance / self.layers


def expert_specs(params):
    """The expert weights split over "ep" by their first dim, every other parameter replicated."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: P("ep") if getattr(path[-1], "key", None) in EXPERT_WEIGHTS else P(), params)


def train(model: Model, params, batches, steps: int, lr: float, balance_weight: float, log, log_every: int,
          mesh=None):
    """Adam with warmup on next-token prediction plus the balance loss; returns (losses, step seconds).
    With a ``mesh`` (expert parallel) the loss and gradients come from ``jax.shard_map`` over its "ep" axis
    (each device its share of the batch and of the experts; the losses averaged over the devices), and
    the optimizer updates the sharded parameters under ``jit``."""
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adam(optax.linear_schedule(0.0, lr, max(1, steps // 6))))
    state = tx.init(params)

    def loss_fn(p, tokens):
        logits, balance = model.apply(p, tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
        if mesh is not None:  # the batch's mean over the devices
            ce, balance = lax.pmean(ce, "ep"), lax.pmean(balance, "ep")
        return ce + balance_weight * balance, (ce, balance)

    grads = jax.value_and_grad(loss_fn, has_aux=True)
    if mesh is not None:
        specs = expert_specs(params)
        grads = jax.shard_map(grads, mesh=mesh, in_specs=(specs, P("ep")), out_specs=((P(), (P(), P())), specs))

    @jax.jit
    def step(params, state, tokens):
        (_, (ce, balance)), g = grads(params, tokens)
        upd, state = tx.update(g, state, params)
        return optax.apply_updates(params, upd), state, ce, balance

    losses, times = [], []
    name = "fp8" if model.ragged_dot is jf.fp8_ragged_dot else "bf16"
    for i in range(steps):
        t0 = time.perf_counter()
        params, state, ce, balance = step(params, state, batches[i])
        ce = float(ce)  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(ce)
        if i % log_every == 0 or i == steps - 1:
            log(f"  [{name:>4}] step {i:4d}  loss {ce:.4f}  balance {float(balance):.3f}")
    return losses, times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256, help="each expert's hidden width")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--balance-weight", type=float, default=1e-2, help="the load-balancing loss's weight")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                    help="split the experts (and the batch) over N devices (module doc)")
    args = ap.parse_args(argv)
    for name in ("steps", "experts", "top_k", "d_model", "ffn", "heads", "layers", "seq", "batch", "vocab",
                 "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.top_k > args.experts:
        ap.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    ep = args.expert_parallel
    if ep < 1 or args.experts % ep or args.batch % ep or ep > len(jax.devices()):
        ap.error(f"--expert-parallel {ep} must divide --experts {args.experts} and --batch {args.batch}, and at most "
                 f"{len(jax.devices())} devices are here")
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep]) if ep > 1 else None
    log = lambda s: print(s, flush=True)  # noqa: E731
    tokens = args.batch * args.seq
    log(f"backend {jax.default_backend()}; MoE LM: {args.layers} layer(s), d_model {args.d_model}, {args.experts} "
        f"experts (top-{args.top_k}, ffn {args.ffn}), vocab {args.vocab}; {tokens} tokens a step in "
        f"{jf.groups.layout_rows(tokens, args.top_k, args.experts, PAD_TO)} grouped rows (experts padded to "
        f"{PAD_TO}); {args.steps} steps")
    chain = T.markov_chain(args.vocab, args.seed)
    seqs = T.sample_sequences(chain, args.steps * args.batch, args.seq + 1, seed=args.seed + 1)
    batches = jnp.asarray(seqs.reshape(args.steps, args.batch, args.seq + 1))
    log(f"data: Markov chain entropy {T.chain_entropy(chain):.4f} nats (the lowest reachable loss); uniform guess "
        f"{np.log(args.vocab):.4f}")
    axis = "ep" if mesh is not None else None
    models = {v: Model(args.vocab, args.d_model, args.heads, args.layers, args.experts, args.top_k, args.ffn, rd,
                       expert_axis=axis) for v, rd in RAGGED_DOTS.items()}
    init = models["bf16"].clone(expert_axis=None)  # the whole model, as one device holds it
    params = init.init(jax.random.key(args.seed), batches[0, :, :-1])  # every expert's weights, on one device
    if mesh is not None:
        log(f"expert parallel: {args.experts // ep} experts and {args.batch // ep} sequences on each of {ep} devices; "
            f"token copies sent as FP8 (data + scales) in the FP8 run, bf16 in the bf16 run")
        params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), expert_specs(params)))
        batches = jax.device_put(batches, NamedSharding(mesh, P(None, "ep")))
    results = {v: train(m, params, batches, args.steps, args.lr, args.balance_weight, log, args.log_every, mesh)
               for v, m in models.items()}
    tail = max(1, args.steps // 10)
    final = {v: sum(losses[-tail:]) / tail for v, (losses, _) in results.items()}
    step_ms = {v: 1e3 * statistics.median(times[1:] or times) for v, (_, times) in results.items()}
    log(f"final loss (mean of the last {tail} steps): fp8 {final['fp8']:.4f}   bf16 {final['bf16']:.4f}   ratio "
        f"{final['fp8'] / final['bf16']:.4f}")
    log(f"step time (median after the first): fp8 {step_ms['fp8']:.1f} ms   bf16 {step_ms['bf16']:.1f} ms")
    return {v: losses for v, (losses, _) in results.items()}


if __name__ == "__main__":
    main()
